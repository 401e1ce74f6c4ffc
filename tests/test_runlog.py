"""The run's log (microgpt/runlog.py), issue 49 class 2: one tolerant reader that every reader uses (a line that is
not a record of its event's shape is passed over and counted, never a traceback), and a writer that keeps the log
readable (strict JSON, a cut-off last line ended before the next record, never a named pipe or a link)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from microgpt import runlock
from microgpt.errors import InputError
from microgpt.proxy.runfiles import ROW_FIELDS
from microgpt.runlog import RECORD_FIELDS, RunLog, load_log, parse_log, read_log

STEP = {"event": "step", "step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1e4, "dt_ms": 3.0,
        "tokens": 256, "time": 1.8e9}  # fmt: skip

# (line, what record_problem says): every way a hostile run folder's log line can be unreadable
BAD_LINES = [
    ('{"event":"step","step":2,"lo', "not JSON (cut short?)"),
    ('{"event":"step","loss":2.0}', "its step is missing"),
    ('{"event":"step","step":"3","loss":2.0}', "its step is '3'"),
    ('{"event":"step","step":null,"loss":2.0}', "its step is None"),
    ('{"event":"step","step":-1,"loss":2.0}', "its step is -1"),
    ('{"event":"step","step":true,"loss":2.0}', "its step is True"),
    ('{"event":"step","step":3}', "a step record without a loss"),
    ('{"event":"step","step":3,"loss":"low"}', "field 'loss' is 'low'"),
    ('{"event":"step","step":3,"loss":NaN}', "not JSON (cut short?)"),
    ('{"event":"step","step":3,"loss":1e400}', "not JSON (cut short?)"),
    ('{"event":"step","step":3,"loss":-Infinity}', "not JSON (cut short?)"),
    ('{"event":"eval","step":3,"val_loss":[1]}', "field 'val_loss' is [1]"),
    ('{"event":"start","step":0,"versions":[1]}', "field 'versions' is [1]"),
    ('{"event":"checkpoint","step":3,"path":7}', "field 'path' is 7"),
    ('{"event":"step","step":3,"loss":2.0,"time":"now"}', "field 'time' is not a number"),
    ('{"step":3,"loss":2.0}', "not a JSON object with an event"),
    ("[1, 2]", "not a JSON object with an event"),
    ('{"event":"step","step":3,"loss":2,"loss":3}', "not JSON (cut short?)"),
    ("[" * 100_000 + "]" * 100_000, "not JSON (cut short?)"),
]


@pytest.mark.parametrize("line, why", BAD_LINES)
def test_an_unreadable_line_is_passed_over_and_counted(line: str, why: str) -> None:
    before, after = json.dumps({**STEP, "step": 2}), json.dumps({**STEP, "step": 4})
    log = parse_log(f"{before}\n{line}\n{after}\n")
    assert [r["step"] for r in log.records] == [2, 4]
    assert (log.unreadable, log.first_unreadable, log.why) == (1, 2, why)
    assert log.note("train.jsonl") == f"train.jsonl: 1 unreadable line was passed over (the first, line 2: {why})"


def test_nothing_passed_over_says_nothing() -> None:
    log = parse_log(json.dumps(STEP) + "\n\n" + json.dumps({"event": "heartbeat", "uptime_s": 1.0}) + "\n")
    assert len(log.records) == 2 and log.unreadable == 0 and log.note("x") is None


def test_the_schema_holds_what_the_proxy_history_holds() -> None:
    """A record the log's reader keeps is a row the proxy's history can hold (runfiles.replay_log relies on it):
    each field ROW_FIELDS types is typed here too, as strictly."""
    for kind, key in (("step", "train"), ("eval", "val")):
        for name, types in ROW_FIELDS[key].items():
            if name == "time":
                continue  # checked for every record (record_problem)
            assert name in RECORD_FIELDS[kind] and set(RECORD_FIELDS[kind][name]) <= set(types), (kind, name)


def test_the_writer_ends_a_cut_off_line_before_the_next_record(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(STEP) + "\n" + '{"event":"step","step":4,"lo')  # a kill or a full disk mid-write
    log = RunLog(path)
    log.open()
    log.emit({"event": "start", "run": "r", "step": 4})
    log.close()
    read = load_log(path)
    assert [r["event"] for r in read.records] == ["step", "start"]  # the start record is whole, not glued on
    assert (read.unreadable, read.first_unreadable) == (1, 2)


def test_the_writer_writes_strict_json(tmp_path: Path) -> None:
    """fp16's overflowed step has a grad_norm of inf or NaN: the log says null, never a token JSON has not."""
    path = tmp_path / "train.jsonl"
    log = RunLog(path)
    log.open()
    rec = log.emit({**STEP, "grad_norm": float("inf"), "lr": float("nan"), "mixture": {"a": float("-inf")}})
    log.close()
    assert rec["grad_norm"] == float("inf")  # the record the caller holds is as it was
    text = path.read_text()
    assert "Infinity" not in text and "NaN" not in text
    (got,) = read_log(path)
    assert (got["grad_norm"], got["lr"], got["mixture"]) == (None, None, {"a": None})


@pytest.mark.parametrize("kind", ["a named pipe", "a folder", "a symbolic link"])
def test_the_writer_refuses_a_log_that_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    """One line, at once: a named pipe's open would wait for a reader forever, a link would write elsewhere."""
    path = tmp_path / "train.jsonl"
    if kind == "a named pipe":
        os.mkfifo(path)
    elif kind == "a folder":
        path.mkdir()
    else:
        (tmp_path / "elsewhere.jsonl").write_text("")
        path.symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(InputError, match=f"train.jsonl: the run's log must be a regular file, not {kind}"):
        RunLog(path).open()
    assert [p.name for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size] == []  # nothing written anywhere


def test_the_reader_refuses_a_named_pipe_at_once(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    os.mkfifo(path)
    done = threading.Event()

    def read() -> None:
        with pytest.raises(InputError, match="must be a regular file, not a named pipe"):
            load_log(path)
        done.set()

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(60)
    assert done.is_set()  # a plain open() of a named pipe with no writer never returns
    assert load_log(tmp_path / "missing.jsonl").records == []


def test_a_record_after_the_folder_moved_is_written_nowhere(tmp_path: Path) -> None:
    """RunLog with the run folder's lock checks it before every record: the folder moved aside and made again, the
    next record is a LockError, written neither into the moved log nor into the folder made again."""
    out = tmp_path / "run"
    with runlock.acquire(out) as lock:
        log = RunLog(out / "train.jsonl", lock=lock)
        log.open()
        log.emit({"event": "start", "run": "r", "step": 0})
        out.rename(tmp_path / "moved")
        out.mkdir()
        with pytest.raises(runlock.LockError, match="moved or replaced"):
            log.emit(STEP)
        log.close()
    assert [r["event"] for r in read_log(tmp_path / "moved" / "train.jsonl")] == ["start"]
    assert list(out.iterdir()) == []
