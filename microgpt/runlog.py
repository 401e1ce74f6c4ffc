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
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from microgpt import events
from microgpt.errors import WriteError

LOG_NAME = "train.jsonl"
STDERR_FD = 2


class Tracker(Protocol):
    """Where records go besides the log (microgpt/run/trackers.py); each gets every record, in order."""

    def record(self, rec: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


class RunLog:
    """The sinks of one process's records. path None: no log file (a data-parallel rank other than 0, a test)."""

    def __init__(self, path: Path | None = None, json_stdout: bool = False, trackers: Sequence[Tracker] = ()):
        self.path, self.json_stdout, self.trackers = path, json_stdout, list(trackers)
        self.fd: int | None = None
        self.queue: deque[dict[str, Any]] = deque()  # records the trackers have not seen yet

    def open(self) -> None:
        """Open the log for appending (the run folder exists by now)."""
        if self.path is not None and self.fd is None:
            try:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as e:
                raise WriteError(f"{self.path}: cannot open the run's log ({e.strerror or e})") from None

    def emit(self, rec: dict[str, Any]) -> dict[str, Any]:
        """The record with its time, written to every sink; returned as written."""
        rec = {**rec, "time": round(time.time(), 3)}
        line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        if self.fd is not None:
            try:
                write_all(self.fd, line)
            except OSError as e:  # a full disk: earlier lines are intact (appends), this one may be cut short
                raise WriteError(f"{self.path}: cannot append to the run's log ({e.strerror or e})") from None
        if self.json_stdout:  # under the events' lock: a heartbeat line never lands inside this one
            events.write_line(line)
        if self.trackers:
            self.queue.append(rec)
        return rec

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


def read_log(path: Path) -> list[dict[str, Any]]:
    """The records of a log, in order (parse_log); [] when there is no log."""
    try:
        return parse_log(path.read_text(errors="replace"))
    except FileNotFoundError:
        return []


def parse_log(text: str) -> list[dict[str, Any]]:
    """The records of a log's text, in order; lines that are not JSON objects with an event (a line cut short by a
    full disk or a kill, other output appended by hand) are passed over."""
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("event"), str):
            out.append(rec)
    return out
