"""The engine's log: every record of a run, in the run folder, and the human lines on the terminal.

A record is one JSON object (`event`: start, step, eval, checkpoint, stopped, done, report) stamped with its wall
time (`time`, Unix seconds). Each one is

  - appended to `<out>/train.jsonl` (LOG_NAME): the run folder's own log, across resumes (a resumed process
    appends after the records of the last; its start record says the step it resumed from), rank 0 only;
  - printed on stdout as one line when asked (`train --json`): the proxy's engine child asks (the proxy reads
    stdout, microgpt/proxy/child.py); a person at a terminal gets no JSON there;
  - handed to the trackers (microgpt/run/trackers.py: TensorBoard, W&B, trackio), from a queue the run loop drains
    between steps (`pump`), so a tracker never runs inside a signal handler.

The same rows are the proxy's `<run>.loss.json` rows (microgpt/proxy/runfiles.py): one history format, so a folder
`train` wrote and one `run` wrote tell the same story, times included.

Human lines (progress, evaluations, `checkpoint step N written`, the stop) go to stderr, the terminal. Both
writers use one os.write per line: safe from the SIGTERM handler that announces its checkpoint, and no line of
one writer is ever split by another. A log line the disk refuses is a WriteError (exit 4, microgpt/errors.py).

The log is the run's own history, and every reader reads it the same way (`load_log`: the report card, the
proxy taking over a `train` folder, the dashboard): a line that is not a record of the shape its event has
(RECORD_FIELDS: a cut-off line, NaN or 1e400 where a number goes, a step record without its step) is passed over
and counted, and the reader says so once (Log.note). The writer keeps it readable: every record is strict JSON (a
number that is not finite, an fp16 step's overflowed grad_norm, is written as null), the log must be a regular
file of the run folder (not a named pipe, a folder or a symbolic link), and a log whose last line was cut short
(a kill or a full disk mid-write) gets its line ended before the next record, so no record is glued onto it.
With `lock` (the run folder's lock, runlock.RunLock), every record is written only while the run folder is still
the one this process locked (RunLock.check), and the other writes of the run (checkpoints, the report card) go
through its anchor (RunLog.anchor).
"""

from __future__ import annotations

import os
import stat
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from microgpt import events
from microgpt.errors import InputError, WriteError
from microgpt.fileio import Anchor, dumps_strict, file_kind, open_at, parse_json, read_input
from microgpt.runlock import RunLock

LOG_NAME = "train.jsonl"
STDERR_FD = 2
STEP_MAX = 2**31 - 1  # config.INT_MAX: a step beyond it is no step of ours
MAX_LOG_BYTES = 1 << 30  # a 200,000-step log is about 50 MB (a data mixture's, about twice that)

NUMBER = (int, float)
NULL = type(None)
VALUE = (int, float, NULL)  # a measured number: null where it was not finite (the writer's rule)
# The fields of each event that a reader relies on, and their JSON types (a number is an int or a finite float;
# NaN and infinities never parse). "step" is required in every record but heartbeats, and a step record's "loss" is
# a number (the engine stops before it logs one that is not finite); other fields and events are kept as they are.
RECORD_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "start": {"run": (str,), "config": (dict,), "versions": (dict, NULL), "git": (str, NULL), "pid": (int, NULL),
              "memory_measure": (str, NULL), "n_params": (int,), "memory": (dict,), "device": (str,),
              "world_size": (int,), "flops_per_token": VALUE, "peak_flops": VALUE, "recipe": (dict,),
              "init": (dict, NULL), "schedule_end": (int,)},
    "step": {"loss": NUMBER, "lr": VALUE, "grad_norm": VALUE, "tokens_per_s": VALUE, "dt_ms": VALUE, "tokens": VALUE,
             "elapsed_s": VALUE, "memory_peak": VALUE, "mixture": (dict,), "phase": (str, NULL)},
    "eval": {"val_loss": VALUE, "source_val_loss": (dict,), "hellaswag": VALUE, "hellaswag_acc_norm": VALUE,
             "hellaswag_examples": (int, NULL), "phase": (str, NULL)},
    "checkpoint": {"path": (str,), "reason": (str,)},
    "report": {"path": (str,)},
}  # fmt: skip
UNSTEPPED = ("heartbeat",)


def record_problem(rec: Any) -> str | None:
    """What makes rec no record a reader can use (RECORD_FIELDS), or None."""
    if not isinstance(rec, dict) or not isinstance(rec.get("event"), str):
        return "not a JSON object with an event"
    kind, step = rec["event"], rec.get("step")
    if kind not in UNSTEPPED and (not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= STEP_MAX):
        return f"its step is {'missing' if 'step' not in rec else repr(step)[:40]}"
    if kind == "step" and "loss" not in rec:
        return "a step record without a loss"
    if not isinstance(rec.get("time", 0), NUMBER) or isinstance(rec.get("time"), bool):
        return "field 'time' is not a number"
    for name, types in RECORD_FIELDS.get(kind, {}).items():
        if name in rec and (not isinstance(rec[name], types) or isinstance(rec[name], bool)):
            return f"field {name!r} is {repr(rec[name])[:40]}"
    return None


@dataclass
class Log:
    """The readable records of a run's log, in order, and the lines passed over (record_problem)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    unreadable: int = 0
    first_unreadable: int = 0  # its line number (1-based); 0: none
    why: str = ""  # what was wrong with it

    def note(self, where: str | Path) -> str | None:
        """The one line a reader says about what it passed over, or None when nothing was."""
        if not self.unreadable:
            return None
        lines = "line was" if self.unreadable == 1 else "lines were"
        return (
            f"{where}: {self.unreadable} unreadable {lines} passed over (the first, line {self.first_unreadable}: "
            f"{self.why})"
        )


class Tracker(Protocol):
    """Where records go besides the log (microgpt/run/trackers.py); each gets every record, in order."""

    def record(self, rec: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


class RunLog:
    """The sinks of one process's records. path None: no log file (a data-parallel rank other than 0, a test)."""

    def __init__(
        self,
        path: Path | None = None,
        json_stdout: bool = False,
        trackers: Sequence[Tracker] = (),
        lock: RunLock | None = None,
    ):
        self.path, self.json_stdout, self.trackers, self.lock = path, json_stdout, list(trackers), lock
        self.fd: int | None = None
        self.queue: deque[dict[str, Any]] = deque()  # records the trackers have not seen yet

    def open(self) -> None:
        """Open the log for appending (the run folder exists by now): a regular file, made if missing, never
        through a symbolic link, never blocking (a named pipe there is refused, InputError); a last line cut short
        is ended first."""
        if self.path is None or self.fd is not None:
            return
        check_log_path(self.path)
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = open_at(self.path, flags, 0o644, self.anchor)  # in the locked folder, wherever it is now
        except OSError as e:
            raise WriteError(f"{self.path}: cannot open the run's log ({e.strerror or e})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # replaced since check_log_path
                raise InputError(f"{self.path}: the run's log must be a regular file, not {file_kind(st.st_mode)}")
            os.set_blocking(fd, True)
            if st.st_size and os.pread(fd, 1, st.st_size - 1) != b"\n":
                write_all(fd, b"\n")  # the cut-off line stays one unreadable line, alone
        except OSError as e:
            os.close(fd)
            raise WriteError(f"{self.path}: cannot append to the run's log ({e.strerror or e})") from None
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def emit(self, rec: dict[str, Any]) -> dict[str, Any]:
        """The record with its time, written to every sink; returned as written (a non-finite number as null)."""
        rec = {**rec, "time": round(time.time(), 3)}
        line = (dumps_strict(rec) + "\n").encode()
        if self.fd is not None:
            self.check_folder()
            try:
                write_all(self.fd, line)
            except OSError as e:  # a full disk: earlier lines are intact (appends), this one may be cut short
                self.check_folder()
                raise WriteError(f"{self.path}: cannot append to the run's log ({e.strerror or e})") from None
        if self.json_stdout:  # under the events' lock: a heartbeat line never lands inside this one
            events.write_line(line)
        if self.trackers:
            self.queue.append(rec)
        return rec

    def check_folder(self) -> None:
        """Before any write into the run folder (a record, a checkpoint, the report card): it is still the folder
        this process locked (RunLock.check; a LockError when it was moved aside or replaced: nothing is written,
        wherever it went). Without a lock (a test, a script, a rank that writes nothing), nothing to check."""
        if self.lock is not None:
            self.lock.check()

    @property
    def anchor(self) -> Anchor | None:
        """Where a write into the run folder goes (fileio.Anchor): the locked folder by descriptor, so a move
        between check_folder and the write cannot send it into a folder made again; None without a lock."""
        return self.lock.anchor if self.lock is not None else None

    @staticmethod
    def say(text: str) -> None:
        """One human line on the terminal (stderr)."""
        write_all(STDERR_FD, (text + "\n").encode())

    def pump(self) -> None:
        """Hand the queued records to the trackers (called by the run loop between steps, never in a handler)."""
        while self.queue:
            rec = self.queue.popleft()
            for tracker in self.trackers:
                tracker.record(rec)

    def close(self) -> None:
        self.pump()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def check_log_path(path: Path) -> None:
    """The run's log, where it exists, is a regular file (not a named pipe, a folder or a symbolic link: InputError
    naming it), so opening it can neither hang nor write anywhere else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise WriteError(f"{path}: cannot open the run's log ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise InputError(f"{path}: the run's log must be a regular file, not {file_kind(mode)}; move it away")


def load_log(path: Path) -> Log:
    """The records of the log at path (parse_log); an empty Log when there is none. A log that cannot be read at
    all (a named pipe, a folder, over MAX_LOG_BYTES) is an InputError naming it."""
    try:
        data = read_input(path, "run log", limit=MAX_LOG_BYTES)
    except FileNotFoundError:
        return Log()
    return parse_log(data.decode("utf-8", errors="replace"))


def read_log(path: Path) -> list[dict[str, Any]]:
    """The readable records of a log, in order (load_log); [] when there is no log."""
    return load_log(path).records


def parse_log(text: str) -> Log:
    """The records of a log's text, in order; a line that is not strict JSON (a line cut short by a full disk or a
    kill, NaN, a number that overflows) or not a record of its event's shape (record_problem) is passed over and
    counted. Blank lines are nothing."""
    log = Log()
    for lineno, line in enumerate(text.split("\n"), 1):  # the writer's line ends only (no U+2028 in JSON it wrote)
        if not line.strip():
            continue
        try:
            rec = parse_json(line, f"line {lineno}", allow_nan=False)
        except InputError:
            rec, why = None, "not JSON (cut short?)"
        else:
            why = record_problem(rec)
        if why is None:
            log.records.append(rec)
            continue
        log.unreadable += 1
        if not log.first_unreadable:
            log.first_unreadable, log.why = lineno, why
    return log
