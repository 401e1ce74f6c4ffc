"""Tuner.choose inside the warm-up's window: a candidate that cannot run on this GPU (it fails to compile, or
asks for more shared memory than there is) is left out and the fastest of the others is recorded; if none runs,
one error names them all. Tuner.launch on top of it: timed once, then remembered; outside the window the first
configuration, nothing kept. The CUDA-event timer is replaced by each candidate's own figure (no GPU in CI)."""

from __future__ import annotations

import json

import pytest
import torch
from triton.runtime.errors import OutOfResources

from microgpt.kernels import gemm as kgemm
from microgpt.kernels import tuning
from microgpt.kernels.gemm import Gemm

from ._kutil import DEVICE


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
    assert window.path.name == "tuning-v3-test-device.json"  # one file per device (name and compute capability)
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
    tuner = tuner_in(tmp_path, monkeypatch)
    tuner.set_probe(torch.zeros(64))
    gemm = Gemm(tuner, None)
    asked: list[int] = []
    monkeypatch.setattr(gemm, "_ways", lambda out, a, b: asked.append(1) or ["triton", "cublas"])
    ran: list[str] = []
    monkeypatch.setattr(gemm, "_run", lambda way, *args: ran.append(way) or {"triton": 2.0, "cublas": 1.0}[way])
    out, a, b = torch.zeros(4, 4), torch.randn(4, 3), torch.randn(3, 4)
    gemm._plain(out, a, b, False)
    gemm._plain(out, a, b, False)
    assert ran == ["triton", "triton"] and len(asked) == 1
    with tuner.window():
        gemm._plain(out, a, b, False)
    assert ran[-1] == "cublas" and len(asked) == 2
    (key,) = gemm.choices()
    assert gemm.choices() == {key: "cublas"}
    assert json.loads(tuner.path.read_text())["gemm"] == {key: "cublas"}
    gemm._plain(out, a, b, False)
    assert ran[-1] == "cublas" and len(asked) == 2


def too_big(ms: float = 0.0):
    """A candidate this device cannot run: Triton raises OutOfResources before launching it (here: sm_86's 99 KiB
    of shared memory a block against a 112 KiB attention tile)."""

    def run() -> float:
        raise OutOfResources(114688, 101376, "shared memory")

    return run


def test_a_candidate_that_does_not_fit_is_not_offered_and_said_once(window, capsys) -> None:
    for key in ("k1", "k2"):
        assert window.choose("fit", key, {"big": too_big(), "slow": lambda: 2.0, "fast": lambda: 1.0}) == "fast"
    err = capsys.readouterr().err
    assert (
        err.count(
            "note: fit candidate big does not fit test-device (shared memory: needs 114688, the device "
            "has 101376); it is not offered on this device"
        )
        == 1
    )


def test_launch_outside_the_window_runs_the_first_configuration_that_fits(tmp_path, monkeypatch, capsys) -> None:
    """Outside the warm-up the default is the first configuration; where the device cannot run it, the next that
    fits runs instead (nothing is kept for an unrecorded key), and the note says why once."""
    tuner = tuner_in(tmp_path, monkeypatch)
    monkeypatch.setattr(tuning, "INTERPRET", False)
    launched: list[str] = []
    configs = {"big": ("big", None), **CONFIGS}

    def make(name: str, ms: float | None):
        return too_big() if ms is None else _recording(launched)(name, ms)

    tuner.launch("fit_launch", "k", configs, make)
    tuner.launch("fit_launch", "k", configs, make)
    assert launched == ["first", "first"] and tuner._launches == {}
    assert capsys.readouterr().err.count("fit_launch candidate big does not fit") == 1
    with pytest.raises(RuntimeError, match="no launch configuration of fit_launch k fits test-device"):
        tuner.launch("fit_launch", "k", {"big": ("big", None)}, make)


def test_a_gemm_tile_that_does_not_fit_leaves_the_gemms_to_cublas(tmp_path, monkeypatch, capsys) -> None:
    """The warm-up's reference way is the Triton tile: where the device refuses it, cuBLAS computes the reference
    and every GEMM of that dtype from then on, and the note says so once, instead of the run ending at step 1."""
    tuner = tuner_in(tmp_path, monkeypatch)
    tuner.set_probe(torch.zeros(64))
    g = kgemm.Gemm(tuner, None)

    def refused(*args) -> None:
        raise OutOfResources(98304 + 4096, 101376, "shared memory")

    monkeypatch.setattr(kgemm, "triton_mm", refused)
    torch.manual_seed(0)
    out, a, b = torch.zeros(4, 4), torch.randn(4, 3), torch.randn(3, 4)
    with tuner.window():
        g._plain(out, a, b, False)
    torch.testing.assert_close(out, a @ b)
    assert list(g.choices().values()) == ["cublas"] and g._ways(out, a, b) == ["cublas"]
    g._plain(out, a, b, True)
    torch.testing.assert_close(out, 2 * (a @ b))
    err = capsys.readouterr().err
    assert err.count("note: the Triton GEMM tile (") == 1 and "torch.float32 GEMMs run on cuBLAS" in err


class NoGeluAux:
    """A cuBLASLt whose heuristic offers no algorithm for the GELU_AUX epilogue (as cublaslt.CublasLt raises it)."""

    def n_algos(self, *args) -> int:
        raise RuntimeError("cuBLASLt has no algorithm for epilogue 160 at 64x128 torch.float16->torch.float16")

    def gelu_aux(self, *args) -> None:
        raise AssertionError("no GELU_AUX algorithm: never called")


def test_no_gelu_aux_algorithm_leaves_the_gelu_to_its_pass(tmp_path, monkeypatch, capsys) -> None:
    tuner = tuner_in(tmp_path, monkeypatch)
    g = Gemm(tuner, NoGeluAux())
    torch.manual_seed(0)
    x, w = torch.randn(64, 32).half().to(DEVICE), (torch.randn(32, 128) / 8).half().to(DEVICE)
    h, a = (torch.empty(64, 128, dtype=torch.float16, device=DEVICE) for _ in range(2))
    for _ in range(2):
        g.mm_act(a, h, x, w, "gelu")
    ref = x.float() @ w.float()
    torch.testing.assert_close(h.float(), ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(a.float(), torch.nn.functional.gelu(h.float(), approximate="tanh"), rtol=1e-2, atol=1e-2)
    err = capsys.readouterr().err
    said = "epilogue 160 at 64x128 torch.float16->torch.float16: the MLP's GELU runs as its own pass or in our tile"
    assert err.count(said) == 1


class NoAlgorithm:
    """A cuBLASLt whose heuristic offers nothing for a plain GEMM."""

    def n_algos(self, *args) -> int:
        raise RuntimeError("cuBLASLt has no algorithm for epilogue 1 at 4x4 torch.float32->torch.float32")


def test_no_cublaslt_algorithm_leaves_the_gemm_to_torch_s_cublas(tmp_path, monkeypatch, capsys) -> None:
    g = Gemm(tuner_in(tmp_path, monkeypatch), NoAlgorithm())
    out, a, b = torch.zeros(4, 4), torch.randn(4, 3), torch.randn(3, 4)
    assert g._ways(out, a, b) == g._ways(out, a, b) == ["triton", "cublas"]
    assert capsys.readouterr().err.count("epilogue 1 at 4x4 torch.float32->torch.float32: torch's cuBLAS runs") == 1


def test_a_forced_configuration_wins_at_every_launch(tmp_path, monkeypatch) -> None:
    """MICROGPT_<TABLE> forces the configuration of each launch, even of a key whose choice the process keeps (the
    GPU tests force each candidate in turn through one tuner)."""
    tuner = tuner_in(tmp_path, monkeypatch)
    monkeypatch.setattr(tuning, "INTERPRET", False)
    launched: list[str] = []
    with tuner.window():
        tuner.launch("demo_forced", "k", CONFIGS, _recording(launched))
    for name in ("other", "first"):
        monkeypatch.setenv("MICROGPT_DEMO_FORCED", name)
        tuner.launch("demo_forced", "k", CONFIGS, _recording(launched))
    assert launched[-2:] == ["other", "first"]
