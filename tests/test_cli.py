"""The real CLI in real subprocesses: bit-exact resume, signals, sampling, and bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from microgpt import checkpoint
from tests.conftest import REPO, cli, json_lines, write_experiment


def step_lines(stdout: str) -> list[str]:
    """The raw step lines minus the wall-clock fields, which legitimately differ between runs."""
    out = []
    for rec in json_lines(stdout):
        if rec["event"] in ("step", "eval"):
            drop = ("tokens_per_s", "dt_ms", "time", "elapsed_s", "memory_peak")  # wall-clock fields
            out.append(json.dumps({k: v for k, v in rec.items() if k not in drop}))
    return out


def test_resume_is_bit_exact(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path)
    straight = cli("train", str(exp), "--steps", "6", "--out", str(tmp_path / "a"), "--json")
    assert straight.returncode == 0, straight.stderr
    half = cli("train", str(exp), "--steps", "6", "--out", str(tmp_path / "b"), "--set", "train.ckpt_every=3")
    assert half.returncode == 0, half.stderr
    # Resume the second run from its step-3 checkpoint in a fresh folder: steps 4..6 again.
    ck3 = tmp_path / "b" / "ckpt" / checkpoint.ckpt_name(3)
    resumed = cli("train", str(exp), "--steps", "6", "--out", str(tmp_path / "c"), "--resume", str(ck3), "--json")
    assert resumed.returncode == 0, resumed.stderr
    final = checkpoint.ckpt_name(6)
    assert (tmp_path / "a/ckpt" / final).read_bytes() == (tmp_path / "c/ckpt" / final).read_bytes()
    want = step_lines(straight.stdout)
    got = step_lines(resumed.stdout)
    assert got == want[len(want) - len(got) :] and len(got) == 4  # steps 4, 5, 6 and the eval at 6
    assert json_lines(resumed.stdout)[0]["step"] == 3
    assert f"resuming from {ck3} (step 3)" in resumed.stderr.splitlines()
    latest = cli("train", str(exp), "--steps", "7", "--out", str(tmp_path / "b"), "--resume", "latest")
    assert latest.returncode == 0, latest.stderr  # --resume latest says which checkpoint it took
    assert f"resuming from {tmp_path / 'b' / 'ckpt' / final} (step 6)" in latest.stderr.splitlines()


def start_training(exp: Path, out: Path, steps: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "microgpt.cli", "train", str(exp), "--steps", str(steps), "--out", str(out), "--json"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)


def wait_for_step(proc: subprocess.Popen, step: int, seen: list[dict]) -> None:
    for line in proc.stdout:
        rec = json.loads(line)
        if rec["event"] != "heartbeat":  # the run's heartbeat beats between its records under load
            seen.append(rec)
        if rec["event"] == "step" and rec["step"] >= step:
            return
    raise AssertionError(f"training ended before step {step}: {proc.stderr.read()}")


def test_sigterm_checkpoints_and_exits_within_2s(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path, model={"d_model": 64, "n_layer": 2, "seq_len": 64})
    proc = start_training(exp, tmp_path / "run", steps=10_000)
    seen: list[dict] = []
    wait_for_step(proc, 2, seen)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=10)
    elapsed = time.monotonic() - t0
    rest = [json.loads(line) for line in proc.stdout.read().splitlines()]
    assert rc == 0 and elapsed < 2.0, (rc, elapsed)
    ck = [r for r in rest if r["event"] == "checkpoint"]
    assert len(ck) == 1 and ck[0]["reason"] == "SIGTERM", rest
    got = checkpoint.read_checkpoint(ck[0]["path"])
    assert got.step == ck[0]["step"] >= 2
    assert checkpoint.verify_sha(ck[0]["path"])


def test_sigusr1_checkpoints_and_training_goes_on(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path)
    proc = start_training(exp, tmp_path / "run", steps=40)
    seen: list[dict] = []
    wait_for_step(proc, 2, seen)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    recs = seen + json_lines(out)
    ck = [r for r in recs if r["event"] == "checkpoint"]
    assert [r["reason"] for r in ck] == ["SIGUSR1", "final"], ck
    assert 2 <= ck[0]["step"] < 40 and [(r["event"], r["step"]) for r in recs[-2:]] == [("done", 40), ("report", 40)]
    assert checkpoint.read_checkpoint(ck[0]["path"]).step == ck[0]["step"]
    assert [r["step"] for r in recs if r["event"] == "step"] == list(range(1, 41))


def test_sample_from_a_run_folder(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path)
    assert cli("train", str(exp), "--steps", "2", "--out", str(tmp_path / "r")).returncode == 0
    res = cli("sample", str(tmp_path / "r"), "--prompt", "import ", "--tokens", "40", "--json")
    assert res.returncode == 0, res.stderr
    rec = json.loads(res.stdout)
    assert rec["step"] == 2 and rec["prompt"] == "import " and len(rec["text"]) > 0


def one_line_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def run_with_checkpoint(tmp_path: Path) -> tuple[Path, Path, bytes]:
    exp = write_experiment(tmp_path)
    res = cli("train", str(exp), "--steps", "2", "--out", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    ck = tmp_path / "run" / "ckpt" / checkpoint.ckpt_name(2)
    return exp, ck, ck.read_bytes()


def test_truncated_checkpoint(tmp_path: Path, run_with_checkpoint) -> None:
    exp, ck, before = run_with_checkpoint
    bad = tmp_path / "truncated.bin"
    bad.write_bytes(before[:1000])
    res = cli("train", str(exp), "--steps", "4", "--out", str(ck.parent.parent), "--resume", str(bad))
    one_line_error(res, str(bad), "truncated")
    assert ck.read_bytes() == before and checkpoint.list_checkpoints(ck.parent) == [ck]


def test_checkpoint_for_another_model_size(tmp_path: Path, run_with_checkpoint) -> None:
    _, ck, before = run_with_checkpoint
    (tmp_path / "other").mkdir()
    other = write_experiment(tmp_path / "other", model={"d_model": 48})
    res = cli("train", str(other), "--steps", "4", "--out", str(ck.parent.parent), "--resume", str(ck))
    one_line_error(res, str(ck), "parameters")
    assert ck.read_bytes() == before and checkpoint.list_checkpoints(ck.parent) == [ck]


@pytest.mark.parametrize(
    "section, values, needles",
    [
        ("model", {"d_modle": 32}, ["model", "d_modle"]),
        ("model", {"d_model": "32"}, ["d_model", "int"]),
        ("model", {"d_model": 30}, ["d_model", "n_head"]),
        ("train", {"lr": -1.0}, ["train.lr"]),
        ("train", {"precision": "fp12"}, ["train.precision"]),
        ("data", {"source": "shards", "path": "/nonexistent/shards"}, ["/nonexistent/shards"]),
    ],
)
def test_bad_config_is_one_line_and_touches_nothing(
    tmp_path: Path, run_with_checkpoint, section, values, needles
) -> None:
    _, ck, before = run_with_checkpoint
    (tmp_path / "bad").mkdir()
    exp = write_experiment(tmp_path / "bad", **{section: values})
    res = cli("train", str(exp), "--steps", "4", "--out", str(ck.parent.parent), "--resume", str(ck))
    one_line_error(res, str(exp) if section != "data" else "", *needles)
    assert ck.read_bytes() == before and checkpoint.list_checkpoints(ck.parent) == [ck]


def test_fresh_run_refuses_a_folder_with_checkpoints(run_with_checkpoint) -> None:
    exp, ck, before = run_with_checkpoint
    res = cli("train", str(exp), "--steps", "4", "--out", str(ck.parent.parent))
    one_line_error(res, "--out", "--resume")
    assert ck.read_bytes() == before


def test_bad_flag_is_one_line() -> None:
    res = cli("train", "experiments/ANDREA-tiny-TRAIN.json", "--steps", "many")
    one_line_error(res, "--steps")


def test_resume_latest_refuses_checkpoints_of_another_model(tmp_path: Path, run_with_checkpoint) -> None:
    _, ck, before = run_with_checkpoint
    (tmp_path / "other").mkdir()
    other = write_experiment(tmp_path / "other", model={"d_model": 48})
    res = cli("train", str(other), "--steps", "4", "--out", str(ck.parent.parent), "--resume", "latest")
    one_line_error(res, "--resume latest", "none is valid for this model")
    assert ck.read_bytes() == before and checkpoint.list_checkpoints(ck.parent) == [ck]


def test_builtin_corpus_never_replaces_a_foreign_folder(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "keep.txt").write_text("not a corpus")
    exp = write_experiment(tmp_path, model={"vocab_size": 512}, data={"path": str(folder)})
    res = cli("train", str(exp), "--steps", "1", "--out", str(tmp_path / "run"))
    one_line_error(res, "data.path", "not empty")
    assert sorted(p.name for p in folder.iterdir()) == ["keep.txt"]


def test_triton_backend_without_a_gpu_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    exp = write_experiment(tmp_path)
    res = cli(
        "train",
        str(exp),
        "--steps",
        "1",
        "--backend",
        "triton",
        "--out",
        str(tmp_path / "run"),
        env={"TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""},
    )
    one_line_error(res, "train.backend 'triton'")
    assert not (tmp_path / "run").exists()  # the folder this failed start made goes with it


def test_a_failed_start_keeps_a_folder_it_did_not_make(tmp_path: Path) -> None:
    """Only a folder the failed start itself made is removed, and only while it is empty."""
    exp = write_experiment(tmp_path, data={"source": "shards", "path": str(tmp_path / "none")})
    for folder, files in ((tmp_path / "empty", []), (tmp_path / "mine", ["notes.txt"])):
        folder.mkdir()
        for name in files:
            (folder / name).write_text("kept")
        res = cli("train", str(exp), "--steps", "1", "--out", str(folder))
        assert res.returncode == 2, res.stderr
        assert folder.is_dir() and sorted(p.name for p in folder.iterdir()) == files


def test_version() -> None:
    import microgpt

    r = cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"microgpt {microgpt.__version__}\n"
    assert (
        f"Version: {microgpt.__version__}"
        in subprocess.run([sys.executable, "-m", "pip", "show", "microgpt"], capture_output=True, text=True).stdout
    )


@pytest.mark.parametrize(
    "command, shown",
    [
        ("train", []),  # every train flag defaults to the experiment file's value: nothing to show
        ("run", ["127.0.0.1:PORT (default 8765"]),
        ("sample", ["--tokens TOKENS       tokens to generate (default: 200)", "(default: 0.8)", "(default: 40)"]),
        ("chat", ["(default: 200)", "(default: 0.8)"]),
        ("eval", ["with --data: which split (default: val)"]),
        ("export", ["(default: fp32)"]),
        ("prep", ["(default: 100000000)", "(default: 50000000)", "(default: 512)"]),
        ("pull-hermes3", ["(default: data/hermes3.jsonl)"]),
    ],
)
def test_help_shows_defaults(command: str, shown: list[str]) -> None:
    """Every subcommand's --help (errors.ArgParser) shows each option's default where there is one."""
    r = cli(command, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: microgpt {command}")
    text = " ".join(r.stdout.split())  # argparse wraps lines at the terminal width
    for piece in shown:
        assert " ".join(piece.split()) in text, (piece, r.stdout)
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: )" not in text
