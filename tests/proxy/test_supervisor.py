"""The proxy over the real engine: kill -9, SIGTERM, Ctrl-C, SIGUSR1, a hung engine, a corrupt checkpoint,
phases. Every run is compared with one uninterrupted run of the same experiment and seed: the loss history
must hold each step exactly once with the same values, and the final checkpoint must be byte-identical."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.proxy._helpers import EXP, ProxyRun, assert_every_step_once, ckpt_bytes, read, run_to_end, write_exp

STEPS = EXP["train"]["steps"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One uninterrupted run under the proxy: the trajectory every interrupted run must reproduce."""
    folder = tmp_path_factory.mktemp("reference")
    run = run_to_end(write_exp(folder), folder / "run")
    return SimpleNamespace(out=run.out, loss=run.file("loss"), final=ckpt_bytes(run.out, STEPS))


def check_same_as_reference(run: ProxyRun, reference: SimpleNamespace) -> dict:
    loss = run.file("loss")
    assert_every_step_once(run.steps(), STEPS)
    assert [r["loss"] for r in loss["train"]] == [r["loss"] for r in reference.loss["train"]]
    val = [(r["step"], r["val_loss"]) for r in loss["val"]]
    assert val == [(r["step"], r["val_loss"]) for r in reference.loss["val"]]
    assert ckpt_bytes(run.out, STEPS) == reference.final, "final checkpoint differs from the uninterrupted run's"
    return loss


def test_uninterrupted_run_records_everything(reference: SimpleNamespace) -> None:
    state = read(reference.out / "proxy-test.state.json")
    assert state["status"] == "done" and state["step"] == STEPS and state["restarts"] == 0
    assert state["checkpoint"].endswith(f"step-{STEPS:08d}.bin") and state["engine_pid"] is None
    assert_every_step_once([r["step"] for r in reference.loss["train"]], STEPS)
    row = reference.loss["train"][0]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "dt_ms", "tokens", "phase", "time"} <= set(row)
    assert [r["step"] for r in reference.loss["val"]] == list(range(20, STEPS + 1, 20))
    assert reference.loss["meta"]["n_params"] > 0 and [m["kind"] for m in reference.loss["marks"]] == ["phase"]
    assert not list(reference.out.glob(".*.tmp*")), "a temp file of an atomic write was left behind"


def test_kill9_of_the_engine_resumes_bit_exact(tmp_path: Path, reference: SimpleNamespace) -> None:
    run = ProxyRun(write_exp(tmp_path), tmp_path / "run")
    pid = run.engine_pid()
    run.wait_for(lambda: max(run.steps(), default=0) >= 50, "step 50 (past the checkpoint at 40)")
    os.kill(pid, signal.SIGKILL)
    assert run.wait() == 0, run.output()
    state = run.file("state")
    assert state["status"] == "done" and state["restarts"] == 1, run.output()
    assert "SIGKILL" in state["restart_log"][0]["reason"]
    loss = check_same_as_reference(run, reference)
    assert [m["kind"] for m in loss["marks"]] == ["phase", "restart"]


def test_sigterm_stops_and_rerun_skips_a_corrupt_newest_checkpoint(tmp_path: Path, reference: SimpleNamespace) -> None:
    exp, out = write_exp(tmp_path), tmp_path / "run"
    run = ProxyRun(exp, out)
    engine = run.engine_pid()
    run.wait_for(lambda: max(run.steps(), default=0) >= 50, "step 50")
    run.signal(signal.SIGTERM)
    assert run.wait() == 0, run.output()
    state = run.file("state")
    last = run.steps()[-1]
    assert state["status"] == "stopped" and state["engine_pid"] is None and state["restarts"] == 0
    assert state["checkpoint_step"] == last < STEPS, "the engine's SIGTERM checkpoint is the last completed step"
    side = read(out / "ckpt" / f"step-{last:08d}.state.json")
    assert side["reason"] == "SIGTERM"
    assert_every_step_once(run.steps(), last)
    with pytest.raises(ProcessLookupError):
        os.kill(engine, 0)
    # Corrupt the newest checkpoint (one weight byte: its sidecar sha256 no longer matches): the next run
    # resumes from the one before, keeps the corrupt file, and still ends bit-exact.
    newest = out / "ckpt" / f"step-{last:08d}.bin"
    blob = bytearray(newest.read_bytes())
    blob[100] ^= 0xFF
    newest.write_bytes(blob)
    run2 = run_to_end(exp, out)
    state = run2.file("state")
    assert state["status"] == "done" and state["restarts"] == 0
    assert [s["path"] for s in state["skipped_checkpoints"]] == [str(newest)]
    assert "sha256" in state["skipped_checkpoints"][0]["reason"]
    loss = check_same_as_reference(run2, reference)
    assert [m["kind"] for m in loss["marks"]] == ["phase", "stop", "resume"]


def test_ctrl_c_stops_like_sigterm(tmp_path: Path) -> None:
    run = ProxyRun(write_exp(tmp_path), tmp_path / "run")
    run.wait_for(lambda: max(run.steps(), default=0) >= 30, "step 30")
    run.signal(signal.SIGINT)
    assert run.wait() == 0, run.output()
    state, last = run.file("state"), run.steps()[-1]
    assert state["status"] == "stopped" and state["checkpoint_step"] == last
    assert read(tmp_path / "run" / "ckpt" / f"step-{last:08d}.state.json")["reason"] == "SIGTERM"


def test_sigusr1_checkpoints_and_training_goes_on(tmp_path: Path, reference: SimpleNamespace) -> None:
    run = ProxyRun(write_exp(tmp_path), tmp_path / "run")
    run.wait_for(lambda: max(run.steps(), default=0) >= 30, "step 30")
    run.signal(signal.SIGUSR1)
    assert run.wait() == 0, run.output()
    assert "(SIGUSR1)" in run.output(), "the engine did not announce a SIGUSR1 checkpoint"
    state = run.file("state")
    assert state["status"] == "done" and state["restarts"] == 0
    check_same_as_reference(run, reference)


def test_hung_engine_is_killed_and_restarted(tmp_path: Path, reference: SimpleNamespace) -> None:
    run = ProxyRun(write_exp(tmp_path), tmp_path / "run", "--hang-timeout", "1.5")
    pid = run.engine_pid()
    run.wait_for(lambda: max(run.steps(), default=0) >= 50, "step 50")
    os.kill(pid, signal.SIGSTOP)  # alive but silent: what a deadlocked or wedged engine looks like
    assert run.wait() == 0, run.output()
    state = run.file("state")
    assert state["restarts"] == 1 and state["restart_log"][0]["reason"] == "hung: no output for 1.5 s"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    check_same_as_reference(run, reference)


def test_an_engine_stopped_before_its_first_step_is_found_by_its_missing_heartbeat(
    tmp_path: Path, reference: SimpleNamespace
) -> None:
    """SIGSTOP as soon as the engine exists, inside its warm-up (imports, data, the first step): no line comes,
    not even the heartbeat (microgpt/events.py), so after proxy.silence_timeout_s (here 3 s; the start-up limit,
    600 s here, never comes into it) the engine is killed and a new one trains the run to the same end."""
    proxy = {**EXP["proxy"], "silence_timeout_s": 3, "startup_timeout_s": 600, "hang_timeout_s": 600}
    run = ProxyRun(write_exp(tmp_path, proxy=proxy), tmp_path / "run")
    pid = run.engine_pid()
    os.kill(pid, signal.SIGSTOP)
    assert run.wait() == 0, run.output()
    state = run.file("state")
    assert state["restarts"] == 1, state["restart_log"]
    assert state["restart_log"][0]["reason"] == "silent: not even a heartbeat for 3 s (stopped or frozen)"
    assert state["restart_log"][0]["step"] == 0  # stopped before the first step: no row of it in the history
    check_same_as_reference(run, reference)


def test_phases_run_in_order_and_polish_archives_samples_and_state(tmp_path: Path) -> None:
    phases = [
        {"name": "pretrain", "steps": 40},
        {"name": "polish", "steps": 20, "lr": 1e-3, "min_lr": 1e-4, "train": {"eval_every": 10}},
    ]
    proxy = {"sample_every": 20, "prompts": ["def "], "sample_tokens": 8}
    out = tmp_path / "run"
    run = run_to_end(write_exp(tmp_path, phases=phases, proxy=proxy), out)
    loss, state, samples = run.file("loss"), run.file("state"), run.file("samples")
    assert_every_step_once(run.steps(), 60)
    assert [r["phase"] for r in loss["train"]] == ["pretrain"] * 40 + ["polish"] * 20
    assert [(m["kind"], m["step"], m.get("phase")) for m in loss["marks"]] == [
        ("phase", 0, "pretrain"),
        ("phase", 40, "polish"),
    ]
    assert [r["step"] for r in loss["val"]] == [20, 40, 50, 60]
    polish = read(out / "phases" / "polish.json")
    assert polish["train"]["lr"] == 1e-3 and polish["train"]["steps"] == 60 and "phases" not in polish
    assert state["status"] == "done" and state["phase"] == "polish" and len(state["archived"]) == 2
    archived = {Path(p).name.split(".")[1]: read(Path(p)) for p in state["archived"]}
    assert archived["state"]["phase"] == "pretrain" and archived["state"]["status"] == "running"
    assert [(s["step"], s["phase"]) for s in archived["samples"]["samples"]] == [(20, "pretrain"), (40, "pretrain")]
    assert [(s["step"], s["phase"]) for s in samples["samples"]] == [(60, "polish")]
    for s in archived["samples"]["samples"] + samples["samples"]:
        assert "error" not in s and isinstance(s["text"], str) and s["temperature"] == 0.8, s


def test_a_finished_run_is_not_run_again(tmp_path: Path, reference: SimpleNamespace) -> None:
    out = tmp_path / "run"
    shutil.copytree(reference.out, out)
    exp = write_exp(tmp_path)
    run = run_to_end(exp, out)
    assert run.file("state")["status"] == "done"
    assert json.loads((out / "proxy-test.loss.json").read_text())["train"] == reference.loss["train"]
