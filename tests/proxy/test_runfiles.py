"""The run files: atomic writes, a loss history with each step once, archives that copy and never move."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microgpt import fileio
from microgpt.fileio import atomic_write_json
from microgpt.proxy.runfiles import LOSS_FORMAT, JsonDoc, LossHistory, RunFileError, archive


def row(step: int, loss: float = 1.0) -> dict:
    return {"step": step, "loss": loss, "phase": "train", "time": 0.0}


def test_history_keeps_each_step_once_across_a_restart(tmp_path: Path) -> None:
    h = LossHistory(tmp_path / "r.loss.json", "r")
    for s in range(1, 8):
        h.add("train", row(s, 10.0 - s))
    h.add("val", {"step": 5, "val_loss": 4.0})
    assert h.truncate_after(4) == 4  # the engine restarts from the checkpoint at step 4: rows 5..7 and val 5 go
    for s in range(5, 9):
        h.add("train", row(s, 20.0 + s))
    h.add("val", {"step": 5, "val_loss": 4.5})
    h.flush()
    data = json.loads((tmp_path / "r.loss.json").read_text())
    assert [r["step"] for r in data["train"]] == list(range(1, 9))
    assert [r["loss"] for r in data["train"]][3:6] == [6.0, 25.0, 26.0]
    assert data["val"] == [{"step": 5, "val_loss": 4.5}] and h.last_step == 8


def test_a_val_row_does_not_drop_the_train_row_of_its_step(tmp_path: Path) -> None:
    h = LossHistory(tmp_path / "r.loss.json", "r")
    h.add("train", row(10))
    h.add("val", {"step": 10, "val_loss": 3.0})
    assert [r["step"] for r in h.data["train"]] == [10]


def test_a_repeated_step_replaces_the_rows_from_there(tmp_path: Path) -> None:
    """An engine restarted without a start line still leaves no duplicate."""
    h = LossHistory(tmp_path / "r.loss.json", "r")
    for s in (1, 2, 3, 2, 3, 4):
        h.add("train", row(s, float(s)))
    assert [r["step"] for r in h.data["train"]] == [1, 2, 3, 4]


def test_non_finite_values_become_null_so_the_file_stays_json(tmp_path: Path) -> None:
    h = LossHistory(tmp_path / "r.loss.json", "r")
    h.add("train", {**row(1), "loss": float("nan"), "grad_norm": float("inf"), "source_loss": {"a": float("nan")}})
    h.add("val", {"step": 1, "val_loss": 2.0, "weights": [0.5, float("-inf")]})
    h.flush()
    data = json.loads((tmp_path / "r.loss.json").read_text())
    assert data["train"][0]["loss"] is None and data["train"][0]["grad_norm"] is None
    assert data["train"][0]["source_loss"] == {"a": None} and data["val"][0]["weights"] == [0.5, None]


def test_history_reloads_and_marks_accumulate(tmp_path: Path) -> None:
    h = LossHistory(tmp_path / "r.loss.json", "r")
    h.add("train", row(1))
    h.mark("restart", 1, reason="engine signal SIGKILL")
    h.flush()
    again = LossHistory(tmp_path / "r.loss.json", "r")
    assert again.last_step == 1 and again.data["marks"][0]["reason"] == "engine signal SIGKILL"
    assert again.data["format"] == LOSS_FORMAT and not again.dirty


@pytest.mark.parametrize("blob", [b"{", b'{"format": "something-else"}', b"[]", b"\xff"])
def test_an_unreadable_run_file_is_an_error_not_overwritten(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "r.loss.json"
    path.write_bytes(blob)
    before = path.read_bytes()
    with pytest.raises(RunFileError, match="r.loss.json"):
        LossHistory(path, "r")
    assert path.read_bytes() == before


def test_atomic_write_leaves_the_old_file_when_it_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s.json"
    atomic_write_json(path, {"a": 1})

    def boom(src: str, dst: str, **_: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(fileio.os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1} and [p.name for p in tmp_path.iterdir()] == ["s.json"]


def test_nan_is_refused_by_the_writer_rather_than_written_as_invalid_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        atomic_write_json(tmp_path / "x.json", {"x": float("nan")})


def test_archive_copies_with_phase_and_stamp(tmp_path: Path) -> None:
    doc = JsonDoc(tmp_path / "r.samples.json", "microgpt-samples-1", {"samples": [1]})
    doc.flush()
    done = archive([tmp_path / "r.samples.json", tmp_path / "r.missing.json"], "pretrain")
    assert len(done) == 1 and Path(done[0]).parent == tmp_path / "archive"
    assert Path(done[0]).name.startswith("r.samples.pretrain.") and Path(done[0]).name.endswith("Z.json")
    assert (tmp_path / "r.samples.json").exists(), "archiving copies: the live file is never missing"
    assert json.loads(Path(done[0]).read_text())["samples"] == [1]
