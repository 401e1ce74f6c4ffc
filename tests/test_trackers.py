"""Trackers (microgpt/run/trackers.py), an optional extra off by default: `--track tensorboard` writes event files that
TensorBoard's own reader gives back as the scalars of the run's log; a resumed run adds to the same folder; an
unknown tracker is one `error:` line; without --track nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from microgpt.runlog import read_log
from tests.conftest import cli, write_experiment

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def read_scalars(folder: Path) -> dict[str, dict[int, float]]:
    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_hold_the_logs_scalars_across_a_resume(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path, train={"ckpt_every": 3})
    out = tmp_path / "run"
    assert cli("train", str(exp), "--out", str(out), "--steps", "3", "--track", "tensorboard").returncode == 0
    r = cli("train", str(exp), "--out", str(out), "--resume", "latest", "--track", "tensorboard")
    assert r.returncode == 0, r.stderr
    log = read_log(out / "train.jsonl")
    got = read_scalars(out / "tb")
    steps = {e["step"]: e for e in log if e["event"] == "step"}
    assert sorted(steps) == list(range(1, 7))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"):
        assert got[f"train/{key}"] == pytest.approx({s: e[key] for s, e in steps.items()}, rel=1e-6), key
    assert got["val/loss"] == pytest.approx({e["step"]: e["val_loss"] for e in log if e["event"] == "eval"}, rel=1e-6)
    assert len(list((out / "tb").iterdir())) == 2  # one event file per process, read as one run


def test_trackers_are_off_by_default_and_an_unknown_one_is_one_line(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path)
    assert cli("train", str(exp), "--out", str(tmp_path / "plain")).returncode == 0
    assert not (tmp_path / "plain" / "tb").exists() and not (tmp_path / "plain" / "wandb").exists()
    r = cli("train", str(exp), "--out", str(tmp_path / "x"), "--track", "mlflow")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: --track mlflow: unknown tracker (known: tensorboard, wandb, trackio)"
    ]
    assert not (tmp_path / "x" / "ckpt").exists()


def test_a_tracker_not_installed_is_one_line_naming_its_install_before_the_folder(tmp_path: Path) -> None:
    """trackio is not in the 'trackers' extra: its line names its own package; nothing is made."""
    import importlib.util

    exp = write_experiment(tmp_path)
    for name, install in (("trackio", "pip install trackio"), ("wandb", "pip install -e '.[trackers]'")):
        if importlib.util.find_spec(name) is not None:
            continue
        r = cli("train", str(exp), "--out", str(tmp_path / name), "--track", name)
        assert r.returncode == 2 and r.stderr.splitlines() == [
            f"error: --track {name}: the {name} package is not installed ({install})"
        ]
        assert not (tmp_path / name).exists()
