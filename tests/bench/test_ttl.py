"""bench/ttl.py on the CPU: the whole time-to-loss command on the tiny shape (prep of this machine's Python sources,
sides (a) and (b) by `microgpt train` on the NumPy engine, side (c) by the PyTorch twin in eager fp32, each in its own
invocation over the same prepared data, then --merge), and its parts: the time to a loss, the training-seconds count
and the budget's plan (bench/ttl_results.py), the source gathering (bench/ttl_data.py) and the PNG writer
(bench/plot.py). No timing is asserted: these check that the GPU run's tables and plot come out whole and say what
they measured."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from bench import plot, ttl, ttl_data, ttl_results
from microgpt import config, data
from microgpt.config import TrainConfig
from microgpt.engine.optim import lr_at
from tests.conftest import REPO

MODERN_TINY = {
    "name": "ANDREA-tiny-modern",
    "model": {"vocab_size": 2048, "d_model": 192, "n_layer": 4, "n_head": 6, "seq_len": 128, "block": "modern"},
    "train": {"micro_batch": 16, "n_micro": 1, "steps": 300, "lr": 0.1, "min_lr": 0.01, "warmup_steps": 0,
              "weight_decay": 0.0, "seed": 1337, "optimizer": "muon", "schedule": "warmdown", "head_lr": 0.008,
              "muon_lr": 0.05, "eval_every": 50, "eval_batches": 8},
    "data": {"source": "builtin"},
}  # fmt: skip


def read_png(path: Path) -> tuple[int, int, set[tuple[int, int, int]]]:
    """(width, height, the colours used) of an 8-bit RGB PNG of filter-0 rows, every chunk's CRC checked."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])[0] == zlib.crc32(kind + body), kind
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + n
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == h * (1 + 3 * w) and all(raw[y * (1 + 3 * w)] == 0 for y in range(h))
    pixels = b"".join(raw[y * (1 + 3 * w) + 1 : (y + 1) * (1 + 3 * w)] for y in range(h))
    return w, h, {tuple(pixels[i : i + 3]) for i in range(0, len(pixels), 3)}


def test_line_chart_is_a_png_with_every_series(tmp_path: Path) -> None:
    path = tmp_path / "chart.png"
    series = {"(a) one": [(0.5, 7.1), (10.0, 5.2), (20.3, 4.0)], "(b) two": [(1.0, 6.0), (19.0, 3.5)]}
    plot.line_chart(path, series, "a title", "seconds", "loss", hline=(4.0, "target 4.0"), size=(400, 300))
    w, h, colors = read_png(path)
    assert (w, h) == (400, 300)
    assert {plot.COLORS[0], plot.COLORS[1], plot.TEXT, plot.WHITE} <= colors
    assert plot.ticks(0.0, 21.0) == list(range(0, 21, 2)) and plot.ticks(3.37, 3.61) == [3.4, 3.45, 3.5, 3.55, 3.6]


def test_seconds_to_a_loss_interpolates_between_evaluations() -> None:
    evals = [{"train_s": 10.0, "val_loss": 6.0}, {"train_s": 20.0, "val_loss": 4.0}, {"train_s": 30.0, "val_loss": 3.0}]
    assert ttl_results.seconds_to(evals, 5.0, 8.0) == pytest.approx(15.0)
    assert ttl_results.seconds_to(evals, 3.0, 8.0) == pytest.approx(30.0)
    assert ttl_results.seconds_to(evals, 7.0, 8.0) == pytest.approx(5.0)  # before the first: from (0 s, start loss)
    assert ttl_results.seconds_to(evals, 2.9, 8.0) is None


def test_training_seconds_count_the_first_steps_at_the_median() -> None:
    steps = [
        {"event": "step", "step": i + 1, "dt_ms": dt, "tokens": 100, "loss": 5.0}
        for i, dt in enumerate([9000.0, 500.0, 100.0, 110.0, 90.0, 100.0])
    ]
    evals = [{"event": "eval", "step": 3, "val_loss": 6.0}, {"event": "eval", "step": 6, "val_loss": 5.5}]
    s = ttl_results.summarize([{"event": "start", "n_params": 7}, *steps[:3], evals[0], *steps[3:], evals[1]], warm=2)
    assert s["step_s"] == pytest.approx(0.1) and s["first_steps_s"] == [9.0, 0.5]
    assert [e["train_s"] for e in s["evals"]] == pytest.approx([0.3, 0.6])
    assert s["train_s"] == pytest.approx(0.6) and s["tokens_per_s"] == pytest.approx(1000.0)
    assert ttl_results.plan(200.0, 0.25, 10.0, 5) == (800, 40) and ttl_results.plan(1.0, 1.0, 10.0, 5) == (11, 10)
    assert ttl_results.scaled_warmup(TrainConfig(steps=200_000, warmup_steps=2000), 900) == 9
    sets = ["train.seed=3", "a:train.lr=0.001", "b,c:train.muon_lr=0.03", "data.path=x:y"]
    assert ttl.side_sets(sets, "a") == ["train.seed=3", "train.lr=0.001", "data.path=x:y"]
    assert ttl.side_sets(sets, "c") == ["train.seed=3", "train.muon_lr=0.03", "data.path=x:y"]
    lever = [*sets, "b,d:model.n_head=3", "d:model.value_embeds=2"]  # (d): (b) with a lever, which its label names
    assert ttl.side_sets(lever, "d")[-1] == "model.value_embeds=2" and ttl.own_sets(lever, "d") == [
        "model.value_embeds=2"
    ]
    assert "model.value_embeds=2" not in ttl.side_sets(lever, "b") and ttl.parser().parse_args([]).sides == list("abc")
    levers = [*lever, "e:train.precision=fp8"]  # a second lever side: its own override, not (d)'s
    assert ttl.own_sets(levers, "e") == ["train.precision=fp8"] and "train.precision=fp8" not in ttl.side_sets(
        levers, "d"
    )
    assert ttl.parser().parse_args(["--sides", "b,d,e,h"]).sides == ["b", "d", "e", "h"]


def test_a_batch_warmup_side_counts_its_cheaper_steps(tmp_path: Path) -> None:
    """Side (d) with a batch warmup: its warm steps counted at the median of the later steps of their tokens, its step
    time and tokens/s its whole steps', the tokens it read summed; the budget's steps those whose micro-batches are
    the whole steps' (unchanged without a warmup); its calibration runs whole steps."""
    tokens = [100, 200, 300, 300, 100, 200, 300, 300, 300]  # a warmup's counts (1, 2, 3 of 100 tokens), then whole
    dts = [9000.0, 8000.0, 7000.0, 300.0, 100.0, 210.0, 310.0, 290.0, 300.0]
    steps = [
        {"event": "step", "step": i + 1, "dt_ms": dt, "tokens": n, "loss": 5.0}
        for i, (dt, n) in enumerate(zip(dts, tokens))
    ]
    s = ttl_results.summarize([*steps, {"event": "eval", "step": 9, "val_loss": 5.0}], warm=3)
    assert s["step_s"] == pytest.approx(0.3) and s["tokens_per_s"] == pytest.approx(1000.0)
    assert s["first_steps_s"] == [9.0, 8.0, 7.0] and s["tokens"] == sum(tokens) and s["tokens_per_step"] == 300
    assert s["train_s"] == pytest.approx(0.1 + 0.21 + 0.3 + sum(dts[3:]) / 1000)  # the warm steps at 0.1, 0.21, 0.3
    micro = data.MicroSchedule(n_micro=4, warmup_steps=6, start=1)  # 1, 1, 2, 2, 3, 3: 12 micro-batches, then 4
    assert ttl_results.plan(20.0, 1.0, 5.0, 2) == ttl_results.plan(20.0, 1.0, 5.0, 2, data.MicroSchedule(4)) == (20, 5)
    steps_w, every = ttl_results.plan(20.0, 1.0, 5.0, 2, micro)
    assert (steps_w, every) == (23, 5) and micro.before(steps_w) == 80 > micro.before(steps_w - 1)
    window = ["model.attn_window=0", "train.attn_window_start=16", "train.attn_window_every=5"]
    cmd = ttl.calibration_cmd(str(REPO / ttl.SHAPES["tiny"].modern), tmp_path, ["train.seed=3", *window], 15)
    assert cmd[-12:] == ["--set", "train.batch_warmup_steps=0", "--set", "train.attn_window_start=0", "--set",
                         "train.attn_window_every=0", "--set", "train.steps=15", "--set",
                         f"train.eval_every={config.INT_MAX}", "--set", "train.warmup_steps=0"]  # fmt: skip
    check = subprocess.run([*cmd, "--check"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert check.returncode == 0, check.stderr  # the window's schedule, turned off, is a valid experiment


def test_fixed_steps_give_the_twin_the_engines_schedule(tmp_path: Path) -> None:
    """--steps c=N: the twin's lr at every step is the engine side's of --steps b=N (engine/optim.py's lr_at over the
    warmup scaled to N), read off the two commands ttl runs."""
    from bench import torch_modern as tm

    modern = tmp_path / "modern.json"
    modern.write_text(json.dumps({**MODERN_TINY, "train": {**MODERN_TINY["train"], "warmup_steps": 30}}))
    args = ttl.parser().parse_args(["--shape", "tiny"])
    steps, every, sets = 50, 10, ["train.lr=0.2"]
    engine = ttl.engine_cmd(str(modern), tmp_path / "run", ttl.schedule(str(modern), sets, steps, every))
    twin = tm.parser().parse_args(ttl.twin_cmd(str(modern), sets, ttl.SHAPES["tiny"], steps, every, args)[2:])
    e = config.load(str(modern), [a for flag, a in zip(engine, engine[1:]) if flag == "--set"])
    c = config.load(twin.experiment, twin.set)
    twin_steps = twin.steps or c.train.steps
    assert twin_steps == steps and (twin.eval_every or c.train.eval_every) == every
    t = tm.schedule(c.train, twin_steps)
    assert [lr_at(s, t) for s in range(steps)] == [lr_at(s, e.train) for s in range(steps)]
    assert lr_at(0, t) == pytest.approx(0.2 / 5)  # a warmup of 30 of 300 steps: 5 of 50


def test_a_lever_side_and_the_twin_take_muon_ns_steps(tmp_path: Path) -> None:
    """--set c,d:train.muon_ns_steps=3: the experiment that side (d)'s engine command and side (c)'s twin command load
    runs 3 Newton-Schulz steps, (b)'s the default 5; (d)'s label names the lever; a value out of range is the
    config's one line."""
    from bench import torch_modern as tm

    modern = tmp_path / "modern.json"
    modern.write_text(json.dumps(MODERN_TINY))
    args = ttl.parser().parse_args(["--shape", "tiny", "--set", "c,d:train.muon_ns_steps=3"])
    for x, want in (("b", 5), ("d", 3)):
        cmd = ttl.engine_cmd(str(modern), tmp_path / x, ttl.side_sets(args.set, x))
        assert config.load(str(modern), [a for f, a in zip(cmd, cmd[1:]) if f == "--set"]).train.muon_ns_steps == want
    twin = tm.parser().parse_args(
        ttl.twin_cmd(str(modern), ttl.side_sets(args.set, "c"), ttl.SHAPES["tiny"], 50, 10, args)[2:]
    )
    assert config.load(twin.experiment, twin.set).train.muon_ns_steps == 3
    assert ttl.own_sets(args.set, "d") == ["train.muon_ns_steps=3"]
    with pytest.raises(config.ConfigError, match=r"train\.muon_ns_steps must be in \[1, 10\], got 0"):
        config.load(str(modern), ttl.side_sets(["d:train.muon_ns_steps=0"], "d"))


def test_gather_links_distinct_python_sources(tmp_path: Path) -> None:
    found = ttl_data.gather(tmp_path / "src", 300_000)
    assert ttl_data.source_roots(stdlib_only=True) == ttl_data.source_roots()[:1]  # the tiny shape's: stdlib alone
    assert ttl_data.gather(tmp_path / "std", 300_000, stdlib_only=True)["roots"] == [str(ttl_data.source_roots()[0])]
    links = sorted(p for p in (tmp_path / "src").rglob("*") if p.is_symlink())
    assert len(links) == found["files"] > 0 and found["bytes"] >= 300_000
    assert all(p.suffix == ".py" and p.resolve().is_file() for p in links)
    bodies = [p.read_bytes() for p in links]
    assert len(set(bodies)) == len(bodies) and sum(map(len, bodies)) == found["bytes"]


def run_ttl(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "ttl.py"),
            "--shape",
            "tiny",
            "--out",
            str(out),
            "--budget-s",
            "2",
            "--eval-s",
            "0.5",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def out_d(folder: Path) -> list[str]:
    """Side (d)'s command: its lever reached its experiment."""
    return json.loads((folder / "side-d.json").read_text())["command"]


@pytest.mark.slow
def test_tiny_sides_in_separate_invocations_then_merged(tmp_path: Path) -> None:
    modern = tmp_path / "modern.json"
    modern.write_text(json.dumps(MODERN_TINY))
    sides = ["a", "b", "c", "d"]
    for side in sides:
        res = run_ttl(tmp_path, "--sides", side, "--modern", str(modern), "--set", "d:model.value_embeds=1")
        assert res.returncode == 0, res.stderr[-3000:]
    res = run_ttl(tmp_path, "--merge")
    assert res.returncode == 0, res.stderr[-3000:]
    folder = tmp_path / "tiny"
    out = json.loads((folder / "ttl.json").read_text())
    prep = json.loads((folder / "prep.json").read_text())
    assert prep["train_tokens"] > 0 and prep["vocab_size"] == 512 and not (folder / "sources").exists()
    assert sorted(out["sides"]) == sorted(sides)
    for x, s in out["sides"].items():
        assert "error" not in s, s
        assert s["steps"] > s["warm"] and s["tokens_per_step"] == 8 * 64 and s["train_s"] > 0
        assert [e["step"] for e in s["evals"]][-1] == s["steps"] and all(
            math.isfinite(e["val_loss"]) for e in s["evals"]
        )
        assert "train.eval_batches=2" in s["command"]  # every side scores the same validation windows
        assert 0 < out["seconds_to"][x][x] <= s["train_s"]  # its own final loss: reached by its end
    assert not (folder / "side-a" / "ckpt").exists() and not (folder / "side-a-calibrate").exists()
    side_c = json.loads((folder / "side-c.json").read_text())
    assert side_c["calibration"]["step_s"] > 0 and len(side_c["step_dt_ms"]) == side_c["steps"]
    assert "(a) val loss at training seconds:" in res.stdout and "| a | microgpt gpt-2 |" in res.stdout
    assert "| d | microgpt modern, model.value_embeds=1 |" in res.stdout and "model.value_embeds=1" in out_d(folder)
    w, h, colors = read_png(folder / "ttl.png")
    assert (w, h) == (960, 600) and {plot.COLORS[0], plot.COLORS[1]} <= colors


def test_a_missing_experiment_is_one_error_line_before_any_prep(tmp_path: Path) -> None:
    res = run_ttl(tmp_path, "--sides", "a,b", "--modern", str(tmp_path / "nope.json"))
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"error: side b: no experiment file {tmp_path / 'nope.json'} (give one with --modern)"
    ]
    assert not (tmp_path / "tiny").exists()
