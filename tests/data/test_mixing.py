"""FIREHOSE online mixing (microgpt/data/mixing.py): three synthetic sources (a learnable repeating pattern, uniform
noise, a copy of the pattern) on a tiny model; the bandit's weights, bit-exact resume through the real CLI, data
parallel, and the one-line errors for a bad section, a source that vanished and a source that ran dry."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from microgpt import checkpoint, config, data
from microgpt.data import mixing, shards
from microgpt.run import trainer
from tests.conftest import REPO, TINY, json_lines

SOURCES = ("a-pattern", "b-noise", "c-pattern-copy")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}  # 2 shared cores: BLAS threads only contend


def write_sources(root: Path, n_train: int = 20_000, n_val: int = 2_000, sizes: dict | None = None) -> Path:
    """One shard set per source under root; the pattern cycles through 16 distinct byte values."""
    rng = np.random.default_rng(0)
    cycle = rng.permutation(256)[:16].astype(np.uint16)
    gen = {
        "a-pattern": lambda n: np.resize(cycle, n),
        "c-pattern-copy": lambda n: np.resize(cycle, n),
        "b-noise": lambda n: rng.integers(0, 256, n).astype(np.uint16),
    }
    for name in SOURCES:
        (root / name).mkdir(parents=True, exist_ok=True)
        n = (sizes or {}).get(name, n_train)
        shards.write_shard(root / name / "train_000000.bin", gen[name](n))
        shards.write_shard(root / name / "val_000000.bin", gen[name](n_val))
    return root


def experiment(root: Path, mixing_section: dict, **train: int) -> dict:
    raw = json.loads(json.dumps(TINY))
    raw["train"].update({"eval_every": 1000, "ckpt_every": 1000, **train})
    raw["data"] = {"source": "shards", "path": str(root), "tokenizer": "bytes"}
    raw["mixing"] = mixing_section
    return raw


FIREHOSE = {"policy": "firehose", "prior": "uniform", "warmup_steps": 5}


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **ONE_THREAD}
    args = (*args, "--json") if args[0] == "train" else args  # the records on stdout, as the proxy asks for them
    return subprocess.run(
        [sys.executable, "-m", "microgpt.cli", *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )


def write_exp(tmp: Path, raw: dict, name: str = "exp.json") -> Path:
    (tmp / name).write_text(json.dumps(raw))
    return tmp / name


# --- the bandit ----------------------------------------------------------------------------------------------
def test_weights_move_away_from_noise(tmp_path: Path) -> None:
    """Within 60 steps the noise source falls below half its uniform share; the fixed policy never moves."""
    root = write_sources(tmp_path / "src")
    tr = trainer.Trainer(config.from_dict(experiment(root, FIREHOSE, steps=60)), tmp_path / "run")
    recs = [tr.train_step() for _ in range(60)]
    noise = [r["mixture"]["b-noise"] for r in recs]
    assert all(w == pytest.approx(1 / 3) for w in noise[:4])  # warm-up: the prior
    low = int(np.argmin(noise))
    assert noise[low] < 1 / 6, noise
    assert recs[low]["mixture"]["a-pattern"] + recs[low]["mixture"]["c-pattern-copy"] > 0.8
    seen = [r["source_loss"] for r in recs]
    assert {k for s in seen for k in s} == set(SOURCES)  # every source is drawn and reported
    assert min(s["b-noise"] for s in seen if "b-noise" in s) > 5.0  # ln 256 = 5.55: noise cannot be learned
    assert min(s["a-pattern"] for s in seen if "a-pattern" in s) < 0.5
    fixed = trainer.Trainer(config.from_dict(experiment(root, {"policy": "fixed", "prior": "uniform"})), tmp_path / "f")
    assert {tuple(fixed.train_step()["mixture"].values()) for _ in range(8)} == {(1 / 3, 1 / 3, 1 / 3)}


def test_exploration_floor_and_prior() -> None:
    cfg = mixing.parse({"policy": "firehose", "min_explore": 0.02, "prior": {"x": 1, "y": 3}})
    b = mixing.Bandit(cfg, ["x", "y"], np.array([1.0, 3.0]))
    b.t = 10**6
    np.testing.assert_allclose(b.policy(), [0.96 * 0.25 + 0.02, 0.96 * 0.75 + 0.02])  # equal rewards: the prior
    eps = []
    for t in (1, 4, 100, 10_000):
        b.t = t
        eps.append(b.explore())
    assert eps[0] == 0.5 and eps[1] == pytest.approx(np.sqrt(np.log(2) / 8)) and eps[-1] == 0.02
    b.rewards[:] = [50.0, -50.0]
    assert b.policy()[1] == pytest.approx(0.02)  # the floor holds however bad a source looks


@pytest.mark.parametrize("train", [{}, {"n_micro": 3, "batch_warmup_steps": 4}], ids=["plain", "batch-warmup"])
def test_draws_are_pure_and_shared_by_ranks(tmp_path: Path, train: dict) -> None:
    """Every rank draws the same source for each micro-batch of a step (a batch warmup's fewer, as many as the step
    reads) and reads its rows of that source's micro-batch."""
    root = write_sources(tmp_path / "src")
    exp = config.from_dict(experiment(root, FIREHOSE, **train))
    whole, val = data.make_loaders(exp, 8)
    assert isinstance(whole, mixing.MixtureLoader) and list(val.sources) == list(SOURCES)
    ranks = [data.make_loaders(exp, 4, shard=(r, 2))[0] for r in range(2)]
    for step in range(6):
        plan = whole.plan(step)
        for micro, (i, k) in enumerate(plan):
            assert plan == ranks[0].plan(step) == ranks[1].plan(step)  # same source on every rank
            x, _ = whole.batch(step, micro)
            np.testing.assert_array_equal(x, whole.loaders[i].batch_at(k)[0])
            np.testing.assert_array_equal(x, np.concatenate([r.batch(step, micro)[0] for r in ranks]))
        for ld in (whole, *ranks):
            ld.end_step(step, [1.0] * len(plan))
        assert len(plan) == data.MicroSchedule.of(exp.train).count(step)
        assert whole.draws.sum() == data.MicroSchedule.of(exp.train).before(step + 1)
    with pytest.raises(RuntimeError, match="stands at 6"):
        whole.batch(2, 0)


# --- resume, data parallel ------------------------------------------------------------------------------------
def step_lines(stdout: str) -> list[str]:
    drop = ("tokens_per_s", "dt_ms", "time", "elapsed_s", "memory_peak")
    return [
        json.dumps({k: v for k, v in r.items() if k not in drop})
        for r in json_lines(stdout)
        if r["event"] in ("step", "eval")
    ]


def test_resume_with_the_bandit_is_bit_exact(tmp_path: Path) -> None:
    root = write_sources(tmp_path / "src")
    exp = write_exp(tmp_path, experiment(root, {**FIREHOSE, "warmup_steps": 2, "update_every": 2}, eval_every=6))
    straight = cli("train", str(exp), "--steps", "12", "--out", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr
    half = cli("train", str(exp), "--steps", "12", "--out", str(tmp_path / "b"), "--set", "train.ckpt_every=5")
    assert half.returncode == 0, half.stderr
    ck5 = tmp_path / "b/ckpt" / checkpoint.ckpt_name(5)  # odd: the bandit holds observations not yet folded in
    state = checkpoint.read_sidecar(ck5)["mixing"]
    rec5 = next(r for r in json_lines(half.stdout) if r["event"] == "step" and r["step"] == 5)
    assert state["weights"] == list(rec5["mixture"].values()) and sum(state["pending_n"]) > 0
    resumed = cli("train", str(exp), "--steps", "12", "--out", str(tmp_path / "c"), "--resume", str(ck5))
    assert resumed.returncode == 0, resumed.stderr
    final = checkpoint.ckpt_name(12)
    assert (tmp_path / "a/ckpt" / final).read_bytes() == (tmp_path / "c/ckpt" / final).read_bytes()
    a, c = (checkpoint.read_sidecar(tmp_path / d / "ckpt" / final)["mixing"] for d in ("a", "c"))
    assert a == c
    want, got = step_lines(straight.stdout), step_lines(resumed.stdout)
    assert got == want[len(want) - len(got) :] and len(got) == 9  # steps 6..12 and the evals at 6 and 12
    moved = [json.loads(s)["mixture"] for s in got if '"mixture"' in s]
    assert len({tuple(m.values()) for m in moved}) > 1, "the bandit should move during the resumed part"
    assert "source_val_loss" in json.loads(got[-1])


def test_two_processes_draw_and_weigh_like_one(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    root = write_sources(tmp_path / "src")
    exp = write_exp(tmp_path, experiment(root, {**FIREHOSE, "warmup_steps": 2}, eval_every=4))
    one = cli("train", str(exp), "--steps", "8", "--out", str(tmp_path / "one"), "--set", "train.micro_batch=8")
    two = cli(
        "train",
        str(exp),
        "--steps",
        "8",
        "--out",
        str(tmp_path / "two"),
        "--set",
        "train.micro_batch=4",
        "--procs",
        "2",
    )
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    s1, s2 = ([r for r in json_lines(p.stdout) if r["event"] == "step"] for p in (one, two))
    assert len(s1) == len(s2) == 8
    for a, b in zip(s1, s2):
        assert list(a["source_loss"]) == list(b["source_loss"])  # the same sources drawn
        for key in ("source_loss", "mixture"):
            np.testing.assert_allclose(list(b[key].values()), list(a[key].values()), rtol=1e-5, err_msg=key)


# --- bad input: one line, exit 2 ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "section, expected",
    [
        ({"policy": "greedy"}, "mixing.policy must be one of fixed, firehose"),
        ({"reward": "loss", "eta": 0}, "mixing.eta must be > 0"),
        ({"warmup": 3}, "unknown field 'mixing.warmup'"),
        ({"prior": {"a-pattern": -1}}, "mixing.prior weights must be numbers > 0"),
        ({"update_every": "2"}, "field 'mixing.update_every' must be int"),
    ],
)
def test_bad_mixing_section_is_one_line(tmp_path: Path, section: dict, expected: str) -> None:
    exp = write_exp(tmp_path, experiment(tmp_path, section))
    with pytest.raises(config.ConfigError, match="mixing") as err:
        data.validate(config.load(exp), str(exp))  # the data layer owns the section (config.py keeps it verbatim)
    assert str(err.value).startswith(f"{exp}: ") and expected in str(err.value) and "\n" not in str(err.value)
    r = cli("train", str(exp), "--out", str(tmp_path / "run"))
    assert (r.returncode, r.stderr.splitlines()) == (2, [f"error: {err.value}"]) and not (tmp_path / "run").exists()


def one_line_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "Traceback" not in res.stderr, res.stderr[-2000:]
    for needle in needles:
        assert needle in line, line
    return line


def test_a_source_that_vanished_is_an_error(tmp_path: Path) -> None:
    root = write_sources(tmp_path / "src")
    exp = write_exp(tmp_path, experiment(root, FIREHOSE))
    res = cli("train", str(exp), "--steps", "3", "--out", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    shutil.rmtree(root / "c-pattern-copy")
    ck = str(tmp_path / "run/ckpt" / checkpoint.ckpt_name(3))
    res = cli("train", str(exp), "--steps", "6", "--out", str(tmp_path / "run2"), "--resume", ck)
    one_line_error(res, "source 'c-pattern-copy'", "missing from", str(root))
    named = write_exp(tmp_path, experiment(root, {**FIREHOSE, "prior": dict.fromkeys(SOURCES, 1)}), "named.json")
    one_line_error(cli("train", str(named), "--out", str(tmp_path / "run3")), "mixing.prior", "'c-pattern-copy'")
    (root / "c-pattern-copy").mkdir()
    shards.write_shard(root / "c-pattern-copy" / "train_000000.bin", np.arange(20, dtype=np.uint16))  # < T + 1
    one_line_error(cli("train", str(exp), "--out", str(tmp_path / "run4")), "c-pattern-copy train", "20 tokens")


@pytest.mark.parametrize("edit", [{"draws": "many"}, {"weights": [1.0]}, {"weights": [-1.0, 1.0, 1.0]}, {"t": []}])
def test_a_malformed_mixture_state_is_one_line(tmp_path: Path, edit: dict) -> None:
    """A sidecar's 'mixing' field edited by hand: the resume is refused naming the checkpoint and the field."""
    root = write_sources(tmp_path / "src")
    exp = write_exp(tmp_path, experiment(root, FIREHOSE))
    assert cli("train", str(exp), "--steps", "3", "--out", str(tmp_path / "run")).returncode == 0
    ck = tmp_path / "run/ckpt" / checkpoint.ckpt_name(3)
    side = json.loads(checkpoint.sidecar_path(ck).read_text())
    side["mixing"].update(edit)
    checkpoint.sidecar_path(ck).write_text(json.dumps(side))
    res = cli("train", str(exp), "--steps", "6", "--out", str(tmp_path / "run2"), "--resume", str(ck))
    one_line_error(res, str(ck), "field 'mixing'")


def test_a_source_that_ran_dry_is_an_error(tmp_path: Path) -> None:
    root = write_sources(tmp_path / "src", sizes={"b-noise": 8 * 32 + 1})  # 8 windows: 2 micro-batches of 4 rows
    exp = write_exp(tmp_path, experiment(root, {**FIREHOSE, "max_epochs": 1}))
    res = cli("train", str(exp), "--steps", "20", "--out", str(tmp_path / "run"))
    line = one_line_error(res, "source 'b-noise' ran dry at step", "8 windows", "mixing.max_epochs=1")
    assert "ran dry" in line and [r for r in json_lines(res.stdout) if r["event"] == "step"]


def test_single_shard_set_with_firehose_is_an_error(tmp_path: Path) -> None:
    flat = tmp_path / "flat"
    flat.mkdir()
    for split in ("train", "val"):
        shards.write_shard(flat / f"{split}_000000.bin", np.arange(500, dtype=np.uint16) % 256)
    exp = write_exp(tmp_path, experiment(flat, FIREHOSE))
    one_line_error(cli("train", str(exp), "--out", str(tmp_path / "run")), "one shard set", "--per-source")


def test_prep_per_source(tmp_path: Path) -> None:
    out = tmp_path / "split"
    res = cli(
        "prep", "--builtin", "--per-source", "--out", str(out), "--vocab-size", "384", "--max-bytes", "30000", "--quiet"
    )
    assert res.returncode == 0, res.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["per_source"] == ["stdlib", "synthetic-chat"] and (out / "tokenizer.json").exists()
    assert all(p.startswith(("stdlib/", "synthetic-chat/")) for p in manifest["splits"]["train"]["shards"])
    assert cli("prep", "--check", str(out)).returncode == 0
    raw = {**TINY, "model": {**TINY["model"], "vocab_size": 384}, "data": {"source": "shards", "path": str(out)}}
    train, val = data.make_loaders(config.from_dict(raw), 2)
    assert train.names == ["stdlib", "synthetic-chat"] and list(val.sources) == train.names
    np.testing.assert_allclose(train.bandit.weights, train.bandit.prior)  # fixed, prior "tokens"
    assert train.bandit.weights[0] > train.bandit.weights[1]  # stdlib holds most of the tokens


def test_a_fixed_phase_after_firehose_keeps_the_prior(tmp_path: Path) -> None:
    """A checkpoint of a firehose run continued with policy fixed (a later phase, say) draws with the prior."""
    root = write_sources(tmp_path / "src")
    first = write_exp(tmp_path, experiment(root, {**FIREHOSE, "warmup_steps": 1}), "first.json")
    res = cli("train", str(first), "--steps", "6", "--out", str(tmp_path / "a"))
    assert res.returncode == 0, res.stderr
    ck = tmp_path / "a/ckpt" / checkpoint.ckpt_name(6)
    assert checkpoint.read_sidecar(ck)["mixing"]["weights"] != [1 / 3] * 3
    then = write_exp(tmp_path, experiment(root, {"policy": "fixed", "prior": "uniform"}), "then.json")
    res = cli("train", str(then), "--steps", "9", "--out", str(tmp_path / "b"), "--resume", str(ck))
    assert res.returncode == 0, res.stderr
    steps = [r for r in json_lines(res.stdout) if r["event"] == "step"]
    assert [r["step"] for r in steps] == [7, 8, 9] and all(r["mixture"] == dict.fromkeys(SOURCES, 1 / 3) for r in steps)
