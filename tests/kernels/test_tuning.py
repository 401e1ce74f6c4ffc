"""Tuner.choose inside the warm-up's window: a candidate that cannot run on this GPU (it fails to compile, or
asks for more shared memory than there is) is left out and the fastest of the others is recorded; if none runs,
one error names them all. Tuner.launch on top of it: timed once, then remembered; outside the window the first
configuration, nothing kept. The CUDA-event timer is replaced by each candidate's own figure (no GPU in CI)."""

from __future__ import annotations

import json

import pytest

from microgpt.kernels import tuning


def tuner_in(folder, monkeypatch: pytest.MonkeyPatch) -> tuning.Tuner:
    """A device's tuner with its cache file in folder, its timer each candidate's own figure."""
    monkeypatch.setenv("MICROGPT_CACHE", str(folder))
    tuner = tuning.Tuner("test-device")
    monkeypatch.setattr(tuner, "_time", lambda fn: fn())  # each candidate returns its own time
    return tuner


@pytest.fixture
def window(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MICROGPT_TUNING_LOG", "1")
    tuner = tuner_in(tmp_path, monkeypatch)
    with tuner.window():
        yield tuner


def fails(why: str):
    def run() -> float:
        raise RuntimeError(f"compiling\nout of resource: shared memory, {why}")

    return run


def test_a_candidate_that_cannot_run_is_left_out(window, capsys) -> None:
    best = window.choose("demo", "k1", {"big": fails("Required: 278568"), "slow": lambda: 2.0, "fast": lambda: 1.0})
    assert best == "fast"
    assert json.loads(window.path.read_text())["demo"] == {"k1": "fast"}
    assert window.path.name == "tuning-v2-test-device.json"  # one file per device (name and compute capability)
    log = capsys.readouterr().err
    assert "slow=2.0000ms fast=1.0000ms -> fast" in log
    assert "big failed: RuntimeError: out of resource: shared memory, Required: 278568" in log


def test_no_candidate_runs_is_one_error_naming_them(window) -> None:
    with pytest.raises(RuntimeError, match="no candidate of demo k2 runs: .*'a': .*'b': "):
        window.choose("demo", "k2", {"a": fails("1"), "b": fails("2")})
    assert not window.path.exists()


def _recording(launched: list[str]):
    """make(name, ms) for Tuner.launch: the launch records its name and returns its time (the fake timer's)."""

    def make(name: str, ms: float):
        def run() -> float:
            launched.append(name)
            return ms

        return run

    return make


CONFIGS = {"first": ("first", 3.0), "best": ("best", 1.0), "other": ("other", 2.0)}


def test_launch_times_once_in_the_window_then_remembers(window, monkeypatch) -> None:
    """Inside the window every configuration is timed and the fastest runs and is recorded; later launches of the
    key run it without timing anything again."""
    monkeypatch.setattr(tuning, "INTERPRET", False)
    launched: list[str] = []
    window.launch("demo_launch", "k", CONFIGS, _recording(launched))
    assert launched == ["first", "best", "other", "best"]  # each timed (the fake timer runs it once), then the best
    assert json.loads(window.path.read_text())["demo_launch"] == {"k": "best"}
    launched.clear()
    window.launch("demo_launch", "k", CONFIGS, _recording(launched))
    assert launched == ["best"]


def test_launch_outside_the_window_takes_the_first_and_keeps_nothing(tmp_path, monkeypatch) -> None:
    """Outside the warm-up an unrecorded key runs the first configuration untimed and remembers nothing, so the
    next warm-up still times it; MICROGPT_<TABLE> forces a configuration by name."""
    tuner = tuner_in(tmp_path, monkeypatch)
    monkeypatch.setattr(tuning, "INTERPRET", False)
    launched: list[str] = []
    tuner.launch("demo_launch", "k", CONFIGS, _recording(launched))
    assert launched == ["first"] and tuner._launches == {}
    monkeypatch.setenv("MICROGPT_DEMO_LAUNCH", "other")
    tuner.launch("demo_launch", "k", CONFIGS, _recording(launched))
    assert launched == ["first", "other"]


def test_gemm_default_before_the_warm_up_is_kept_until_the_warm_up_times_it(tmp_path, monkeypatch) -> None:
    """The GEMM router's choice: before any warm-up (a kernel called outside a training step) a shape takes the
    reference way untimed and keeps it, so later calls choose nothing again; the warm-up, when it comes, still times
    it and records the fastest, which the process then keeps."""
    import torch

    from microgpt.kernels.gemm import Gemm

    tuner = tuner_in(tmp_path, monkeypatch)
    tuner.set_probe(torch.zeros(64))
    gemm = Gemm(tuner, None)
    asked: list[int] = []
    monkeypatch.setattr(gemm, "_ways", lambda out, a, b: asked.append(1) or ["triton", "cublas"])
    ran: list[str] = []
    monkeypatch.setattr(gemm, "_run", lambda way, *args: ran.append(way) or {"triton": 2.0, "cublas": 1.0}[way])
    out, a, b = torch.zeros(4, 4), torch.randn(4, 3), torch.randn(3, 4)
    gemm._tuned(out, a, b, False)
    gemm._tuned(out, a, b, False)
    assert ran == ["triton", "triton"] and len(asked) == 1
    with tuner.window():
        gemm._tuned(out, a, b, False)
    assert ran[-1] == "cublas" and len(asked) == 2
    (key,) = gemm.choices()
    assert gemm.choices() == {key: "cublas"}
    assert json.loads(tuner.path.read_text())["gemm"] == {key: "cublas"}
    gemm._tuned(out, a, b, False)
    assert ran[-1] == "cublas" and len(asked) == 2
