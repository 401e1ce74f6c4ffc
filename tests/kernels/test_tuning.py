"""tuning.choose inside the warm-up's window: a candidate that cannot run on this GPU (it fails to compile, or
asks for more shared memory than there is) is left out and the fastest of the others is recorded; if none runs,
one error names them all. The CUDA-event timer is replaced by each candidate's own figure (no GPU in CI)."""

from __future__ import annotations

import json

import pytest

from microgpt.kernels import tuning


@pytest.fixture
def window(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MICROGPT_CACHE", str(tmp_path))
    monkeypatch.setenv("MICROGPT_TUNING_LOG", "1")
    monkeypatch.setattr(tuning, "_cache", None)
    monkeypatch.setattr(tuning, "_time", lambda fn: fn())  # each candidate returns its own time
    with tuning.window():
        yield tmp_path


def fails(why: str):
    def run() -> float:
        raise RuntimeError(f"compiling\nout of resource: shared memory, {why}")

    return run


def test_a_candidate_that_cannot_run_is_left_out(window, capsys) -> None:
    best = tuning.choose("demo", "k1", {"big": fails("Required: 278568"), "slow": lambda: 2.0, "fast": lambda: 1.0})
    assert best == "fast"
    assert json.loads(tuning.cache_path().read_text())["demo"] == {"k1": "fast"}
    log = capsys.readouterr().err
    assert "slow=2.0000ms fast=1.0000ms -> fast" in log
    assert "big failed: RuntimeError: out of resource: shared memory, Required: 278568" in log


def test_no_candidate_runs_is_one_error_naming_them(window) -> None:
    with pytest.raises(RuntimeError, match="no candidate of demo k2 runs: .*'a': .*'b': "):
        tuning.choose("demo", "k2", {"a": fails("1"), "b": fails("2")})
    assert not tuning.cache_path().exists()
