"""What the dashboard server answers from run files: bounded min/max downsampling that keeps spikes, only new rows
for a poll, full detail for a zoom, and a file that changes under it (replaced, half-written) never breaks it."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from microgpt.proxy.dashdata import Columns, RunFolder, RunNotReady, RunUnavailable, _appended, _parse, columns, view
from microgpt.proxy.runfiles import LossHistory


def history(n: int, spike: int | None = None, dip: int | None = None, t0: float = 1.7e9) -> dict:
    rng = random.Random(0)
    train = []
    for s in range(1, n + 1):
        loss = 3 + 5 / (1 + s / 1000) + rng.gauss(0, 0.05)
        loss = 50.0 if s == spike else 0.01 if s == dip else loss
        train.append(
            {
                "step": s,
                "loss": loss,
                "lr": 1e-3,
                "grad_norm": 0.5 + rng.random(),
                "tokens_per_s": 1e5,
                "tokens": 1024,
                "time": t0 + s * 0.25,
                "phase": "main",
            }
        )
    val = [{"step": s, "val_loss": 4.0, "time": t0 + s * 0.25} for s in range(100, n + 1, 100)]
    marks = [{"kind": "stop", "step": n // 2, "time": t0}, {"kind": "resume", "step": n // 2, "time": t0}]
    return {"format": "microgpt-loss-1", "run": "r", "meta": {}, "train": train, "val": val, "marks": marks}


def test_a_200k_step_history_is_downsampled_per_pixel_and_keeps_its_spikes() -> None:
    c = columns(history(200_000, spike=123_457, dip=7_001), "v1")
    ans = view(c, 1000)
    assert ans["rows"] == 200_000 and ans["last_step"] == 200_000
    for name, s in ans["series"].items():
        assert 1000 <= len(s["step"]) <= 2 * 1000 + 2, name  # min and max of each of 1000 buckets, both ends
        assert s["step"] == sorted(set(s["step"])) and s["step"][0] == 1 and s["step"][-1] == 200_000
    loss = dict(zip(ans["series"]["loss"]["step"], ans["series"]["loss"]["y"]))
    assert loss[123_457] == 50.0 and loss[7_001] == 0.01  # one-step spike and dip survive
    assert len(ans["val"]["step"]) == 2000 and len(ans["clock"]["step"]) <= 2 * 1000 + 1
    assert ans["clock"]["tokens"][-1] == 200_000 * 1024  # cumulative, for the tokens axis
    assert len(json.dumps(ans)) < 400_000  # against 25+ MB for the file


def test_a_poll_gets_only_the_rows_after_its_step() -> None:
    c = columns(history(5000), "v")
    ans = view(c, 1000, since=4990, vsince=4900)
    assert all(s["step"] == list(range(4991, 5001)) for s in ans["series"].values())
    assert ans["val"]["step"] == [5000] and ans["points"] == 4 * 10
    nothing = view(c, 1000, since=5000, vsince=5000)
    assert nothing["points"] == 0 and nothing["val"]["step"] == [] and nothing["last_step"] == 5000
    many = view(c, 100, since=0)  # a page that slept through many steps: downsampled like a first load
    assert all(len(s["step"]) <= 202 for s in many["series"].values())


def test_hellaswag_is_its_own_eval_series_and_moves_the_polls_cursor() -> None:
    """Eval rows of the val loss, of HellaSwag (train.hellaswag) or of both: each series holds the rows that carry
    it, and last_val_step (the poll's vsince) is the last step of either, so a poll gets each new point once."""
    obj = history(500)
    obj["val"] = [
        {"step": 100, "val_loss": 4.0},
        {"step": 150, "hellaswag": 0.25, "hellaswag_acc_norm": 0.3},
        {"step": 200, "val_loss": 3.9, "hellaswag": 0.26, "hellaswag_acc_norm": None},
        {"step": 250, "hellaswag": 0.27, "hellaswag_acc_norm": 0.31},
    ]
    ans = view(columns(obj, "v"), 1000)
    assert ans["val"] == {"step": [100, 200], "y": [4.0, 3.9]} and ans["last_val_step"] == 250
    assert ans["hellaswag"] == {
        "acc": {"step": [150, 200, 250], "y": [0.25, 0.26, 0.27]},
        "acc_norm": {"step": [150, 250], "y": [0.3, 0.31]},
    }
    poll = view(columns(obj, "v"), 1000, since=500, vsince=200)
    assert poll["val"]["step"] == [] and poll["hellaswag"]["acc"] == {"step": [250], "y": [0.27]}
    assert view(columns(history(500), "v"), 1000)["hellaswag"] == {
        "acc": {"step": [], "y": []},
        "acc_norm": {"step": [], "y": []},
    }


def test_a_zoom_gets_its_steps_at_full_detail() -> None:
    c = columns(history(200_000), "v")
    ans = view(c, 1000, lo=150_000, hi=150_500)
    assert ans["series"]["loss"]["step"] == list(range(149_999, 150_502))  # one beyond each edge


def test_null_values_are_left_out_of_their_series_only() -> None:
    obj = history(10)
    obj["train"][4]["loss"] = None  # a diverged step, as runfiles stores NaN
    c = columns(obj, "v")
    assert 5 not in c.series["loss"][0] and 5 in c.series["grad_norm"][0] and len(c.steps) == 10


def write(path: Path, text: str, mtime_ns: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_a_file_that_changes_under_the_server(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    with pytest.raises(RunUnavailable, match="no run"):
        folder.loss("r")
    path = tmp_path / "r.loss.json"
    write(path, json.dumps(history(100))[:5000], 1)  # half a file and nothing better yet: unavailable, a 503
    with pytest.raises(RunNotReady, match="not readable yet"):
        folder.loss("r")
    write(path, json.dumps(history(100)), 2)
    assert folder.loss("r").steps[-1] == 100
    write(path, json.dumps(history(200))[:-10], 3)  # half-written again: the last good version is served
    assert folder.loss("r").steps[-1] == 100
    write(path, "[1, 2]", 4)
    assert folder.loss("r").steps[-1] == 100
    path.unlink()
    history_ = LossHistory(path, "r")  # the proxy's own writer: atomic replace; a restart truncated the rows
    history_.data = history(50)
    history_.dirty = True
    history_.flush()
    assert folder.loss("r").steps[-1] == 50


def test_runs_are_the_folder_and_its_run_folders(tmp_path: Path) -> None:
    (tmp_path / "top.loss.json").write_text("{}")
    for sub in ("b", "a", "ckpt", "archive", ".hidden"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / f"{sub}run.loss.json").write_text("{}")
    (tmp_path / "a" / "second.loss.json").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert list(RunFolder(tmp_path).runs()) == ["top", "a/arun", "a/second", "b/brun"]
    assert RunFolder(tmp_path).parts("a/second", "samples") == ("a", "second.samples.json")
    assert RunFolder(tmp_path / "missing").runs() == {}


def same(a: Columns, b: Columns) -> bool:
    fields = ("meta", "marks", "steps", "series", "tokens", "times", "val")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


@pytest.mark.parametrize("reason", ["engine killed", 'tail: ],"val":[ in a message'])
def test_a_live_run_is_parsed_by_its_new_rows_only(tmp_path: Path, reason: str) -> None:
    """The proxy rewrites the whole file each flush; the server parses only what follows the rows it has."""
    path = tmp_path / "r.loss.json"
    hist = LossHistory(path, "r")
    hist.set_meta({"n_params": 5, "config": {"train": {"grad_clip": 1.0}}})
    folder = RunFolder(tmp_path)
    versions = []
    for first, last in ((1, 0), (1, 100), (101, 150), (151, 151)):
        for r in history(last)["train"][first - 1 :]:
            hist.add("train", r)
        if last == 150:
            hist.add("val", {"step": 150, "val_loss": 3.0})
            hist.mark("restart", 150, reason=reason)
        hist.flush()
        os.utime(path, ns=(len(versions) + 1, len(versions) + 1))
        old = folder.cache.get(path)
        new = folder.loss("r")
        full = _parse(path.read_bytes(), new.version)
        assert same(new, full) and new.steps == list(range(1, last + 1))
        versions.append(old is not None and _appended(old, path.read_bytes(), "v") is not None)
    assert versions == [False, False, True, True]  # the empty first version: the next one is parsed whole
    hist.truncate_after(120)  # a restart from step 120: not an append, parsed whole, still right
    hist.flush()
    os.utime(path, ns=(9, 9))
    assert not _appended(folder.cache[path], path.read_bytes(), "v") and folder.loss("r").steps[-1] == 120
