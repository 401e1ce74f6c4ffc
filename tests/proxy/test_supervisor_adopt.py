"""`microgpt run` on a folder `microgpt train` wrote (as `make train` does), and `train --resume latest` after a run:
each continues from the other's newest checkpoint, and the proxy's loss history covers the steps it did not see."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from microgpt.runlog import read_log
from tests.proxy._helpers import ENV, REPO, assert_every_step_once, ckpt_bytes, run_to_end, write_exp

TRAIN = {"steps": 40, "ckpt_every": 20, "eval_every": 10}


def train(exp: Path, out: Path, *args: str) -> list[dict]:
    """`microgpt train EXP --out OUT ARGS` (as `make train` runs it); the records it appended to out/train.jsonl."""
    before = len(read_log(out / "train.jsonl"))
    cmd = [sys.executable, "-m", "microgpt.cli", "train", str(exp), "--out", str(out), *args]
    r = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""  # no JSON on stdout unless asked: the log holds the records
    return read_log(out / "train.jsonl")[before:]


def adopt_marks(loss: dict) -> list[dict]:
    return [m for m in loss["marks"] if m["kind"] == "adopt"]


def test_run_continues_a_folder_make_train_wrote(tmp_path: Path) -> None:
    exp, out = write_exp(tmp_path, train=TRAIN), tmp_path / "run"
    lines = train(exp, out, "--steps", "20", "--resume", "latest")
    run = run_to_end(exp, out)
    assert f"continuing from {out / 'ckpt' / 'step-00000020.bin'}" in run.output()
    assert "from step 20 to 40, resuming" in run.output()
    loss, state = run.file("loss"), run.file("state")
    assert state["status"] == "done" and state["step"] == 40
    assert_every_step_once([r["step"] for r in loss["train"]], 40)
    train_rows = {e["step"]: e["loss"] for e in lines if e["event"] == "step"}
    assert {r["step"]: r["loss"] for r in loss["train"][:20]} == train_rows  # taken from train.jsonl as they were
    times = [r["time"] for r in loss["train"]]  # the log's real times, then the proxy's engine's: one clock
    assert times[:20] == [e["time"] for e in lines if e["event"] == "step"] and times == sorted(times)
    assert [r["elapsed_s"] for r in loss["train"]] == sorted(r["elapsed_s"] for r in loss["train"])
    assert [r["step"] for r in loss["val"]] == [10, 20, 30, 40]
    (mark,) = adopt_marks(loss)
    assert (mark["step"], mark["history"]) == (20, str(out / "train.jsonl"))
    # the proxy's engine continued from step 20 exactly as `train --resume latest` does
    other = tmp_path / "other"
    train(exp, other, "--steps", "20")
    train(exp, other, "--resume", "latest")
    assert ckpt_bytes(out, 40) == ckpt_bytes(other, 40)


def test_without_train_jsonl_the_history_starts_at_the_checkpoint(tmp_path: Path) -> None:
    """`microgpt train` run by hand (its JSON lines not kept): the steps before the checkpoint have no train rows;
    the val loss the checkpoint's sidecar recorded is the one val row before it."""
    exp, out = write_exp(tmp_path, train=TRAIN), tmp_path / "run"
    train(exp, out, "--steps", "20")
    (out / "train.jsonl").unlink()  # as a folder of a version that kept no log
    run = run_to_end(exp, out)
    loss = run.file("loss")
    assert [r["step"] for r in loss["train"]] == list(range(21, 41))
    assert [r["step"] for r in loss["val"]] == [20, 30, 40] and loss["val"][0]["time"] is None
    assert [(m["step"], m["history"]) for m in adopt_marks(loss)] == [(20, "checkpoint sidecars")]
    assert run.file("state")["status"] == "done"


def test_train_resume_latest_after_run_and_run_again(tmp_path: Path) -> None:
    exp, out = write_exp(tmp_path, train=TRAIN), tmp_path / "run"
    run_to_end(exp, out, "--steps", "20")
    lines = train(exp, out, "--resume", "latest")
    assert lines[0]["event"] == "start" and lines[0]["step"] == 20  # continued from the proxy's checkpoint
    assert [(e["event"], e["step"]) for e in lines[-2:]] == [("done", 40), ("report", 40)]
    run = run_to_end(exp, out)
    assert "engine from step" not in run.output().split("continuing from")[-1]  # complete: no engine started
    loss = run.file("loss")
    assert_every_step_once([r["step"] for r in loss["train"]], 40)
    assert [r["step"] for r in loss["val"]] == [10, 20, 30, 40]
    assert [m["step"] for m in adopt_marks(loss)] == [40]
    assert run.file("state")["status"] == "done" and run.file("state")["step"] == 40


def test_checkpoints_of_another_run_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    exp = write_exp(tmp_path, train=TRAIN)
    train(exp, out, "--steps", "20")
    before = sorted(str(p) for p in out.rglob("*"))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads(exp.read_text()), "name": "other-run"}))
    cmd = [sys.executable, "-m", "microgpt.cli", "run", str(other), "--out", str(out)]
    r = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"error: {out / 'ckpt' / 'step-00000020.bin'}: a checkpoint of run "
        "'proxy-test', not 'other-run'; use another --out"
    ]
    assert sorted(str(p) for p in out.rglob("*")) == before  # nothing written


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(experiment, run folder) of a 20-step `make train` (its JSON lines kept in train.jsonl), trained once."""
    folder = tmp_path_factory.mktemp("made")
    exp, out = write_exp(folder, train=TRAIN), folder / "run"
    train(exp, out, "--steps", "20")
    return exp, out


def refused_run(exp: Path, out: Path, *needles: str) -> None:
    """`microgpt run` on the folder: exit 2, one `error:` line holding every needle, every file as it was."""
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.rglob("*") if p.is_file()}
    cmd = [sys.executable, "-m", "microgpt.cli", "run", str(exp), "--out", str(out)]
    r = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.rglob("*") if p.is_file()} == before


def with_line(out: Path, n: int, edit: Callable[[dict], object]) -> int:
    """train.jsonl with its n-th step line replaced by edit(line); that line's number in the file (1-based)."""
    log = out / "train.jsonl"
    lines = log.read_text().splitlines()
    i = [i for i, line in enumerate(lines) if json.loads(line)["event"] == "step"][n - 1]
    lines[i] = json.dumps(edit(json.loads(lines[i])))
    log.write_text("\n".join(lines) + "\n")
    return i + 1


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda ev: {k: v for k, v in ev.items() if k != "step"}, "its step is missing"),
        (lambda ev: {**ev, "step": "5"}, "its step is '5'"),
        (lambda ev: {**ev, "step": None}, "its step is None"),
        (lambda ev: {**ev, "step": 2**40}, "its step is 1099511627776"),
        (lambda ev: {**ev, "loss": "low"}, "field 'loss' is 'low'"),
        (lambda ev: {**ev, "lr": True}, "field 'lr' is True"),
        (lambda ev: {**ev, "mixture": [1, 2]}, "field 'mixture' is [1, 2]"),
    ],
)
def test_adopting_an_engine_log_with_a_bad_record(made: tuple[Path, Path], tmp_path: Path, edit, needle: str) -> None:
    """A step record of the wrong shape is passed over (the log's one reader, runlog.load_log), said once by each
    reader (the proxy taking the history, the engine's report card) with its line, and the rest of the log's history
    is taken: every other step once, the run continuing to its end."""
    exp, out = made
    shutil.copytree(out, tmp_path / "run")
    line = with_line(tmp_path / "run", 5, edit)
    run = run_to_end(exp, tmp_path / "run")
    said = f"{tmp_path / 'run' / 'train.jsonl'}: 1 unreadable line was passed over (the first, line {line}: {needle})"
    notes = [x for x in run.output().splitlines() if "unreadable line was passed over" in x]
    assert notes == [f"proxy: {said}", f"warning: {said}; the report card is made from the rest"], run.output()
    steps = [r["step"] for r in run.file("loss")["train"]]
    assert steps == [s for s in range(1, 41) if s != 5]


def test_a_line_nested_100000_deep_in_the_engine_log_is_passed_over(made: tuple[Path, Path], tmp_path: Path) -> None:
    exp, out = made
    shutil.copytree(out, tmp_path / "run")
    with open(tmp_path / "run" / "train.jsonl", "a") as f:
        f.write("[" * 100_000 + "]" * 100_000 + "\n")
    run = run_to_end(exp, tmp_path / "run")
    assert_every_step_once([r["step"] for r in run.file("loss")["train"]], 40)


LOSS_ROWS = [
    ("marks", {"step": 3, "time": 1.0}, "field 'marks' row 0 has no field 'kind'"),
    ("train", {"step": 1.5, "loss": 2.0}, "field 'train' row 0 field 'step' must be an integer"),
    ("train", {"step": 1, "loss": "2.0"}, "field 'train' row 0 field 'loss' must be a number or null"),
    ("val", {"step": 1, "val_loss": [2.0]}, "field 'val' row 0 field 'val_loss' must be a number or null"),
    ("train", {"loss": 2.0}, "field 'train' row 0 has no step"),
]


@pytest.mark.parametrize("key, row, needle", LOSS_ROWS)
def test_a_loss_history_with_a_bad_row(
    made: tuple[Path, Path], tmp_path: Path, key: str, row: dict, needle: str
) -> None:
    exp, out = made
    shutil.copytree(out, tmp_path / "run")
    history = {"format": "microgpt-loss-1", "run": "proxy-test", "meta": {}, "train": [], "val": [], "marks": []}
    (tmp_path / "run" / "proxy-test.loss.json").write_text(json.dumps({**history, key: [row]}))
    refused_run(exp, tmp_path / "run", "proxy-test.loss.json", needle, "move it away")


@pytest.mark.parametrize("pid", [2**31, 2**63, 10**30, 0, -1, "123", True])
def test_a_state_with_a_pid_out_of_range(made: tuple[Path, Path], tmp_path: Path, pid: object) -> None:
    exp, out = made
    shutil.copytree(out, tmp_path / "run")
    state = {"format": "microgpt-proxy-state-1", "run": "proxy-test", "status": "running", "proxy_pid": pid}
    (tmp_path / "run" / "proxy-test.state.json").write_text(json.dumps(state))
    refused_run(exp, tmp_path / "run", "proxy-test.state.json", "field 'proxy_pid' must be")
