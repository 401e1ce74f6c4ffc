"""The engine's events: one JSON object per line on stdout (emit), and the heartbeat among them.

Everything the engine tells the world is an event line (DESIGN.md section 4: the proxy reads nothing else). emit()
writes each line whole: one os.write, retried after a short write, under STDOUT_LOCK, so a line of the heartbeat's
thread never lands inside a long line of the main thread (a pipe keeps writes whole only up to PIPE_BUF bytes).
The lock is reentrant: a signal handler that checkpoints inside an emit (and emits) does not deadlock.

The heartbeat is a daemon thread that emits {"event": "heartbeat", "uptime_s": ...} every `every` seconds for as
long as `microgpt train` runs: during the warm-up before the first step (data, compilation, autotuning), a long
evaluation or a checkpoint, the proxy still hears from the engine, so it can tell "busy" from "stopped or frozen"
(SIGSTOP, a machine swapping to death: the thread stops with the process) within minutes
(proxy.silence_timeout_s) instead of after the whole start-up limit. A deadlock that leaves the thread beating is
still found by the progress limits (proxy.startup_timeout_s, hang_timeout_s), which heartbeats do not reset.
The proxy asks for an interval through MICROGPT_HEARTBEAT_S (a tenth of its silence limit); HEARTBEAT_S otherwise.
"""

from __future__ import annotations

import json
import os
import threading
import time
from types import TracebackType
from typing import Any

from microgpt.errors import parse_number

STDOUT_FD = 1
# The process's one stdout, shared by the main thread and the heartbeat's: a lock with nothing else to own it.
STDOUT_LOCK = threading.RLock()
HEARTBEAT_S = 10.0
HEARTBEAT_ENV = "MICROGPT_HEARTBEAT_S"


def write_line(line: bytes) -> None:
    """One line on stdout, written whole and flushed at once (os.write: safe from a signal handler)."""
    with STDOUT_LOCK:
        while line:
            line = line[os.write(STDOUT_FD, line) :]


def emit(obj: dict[str, Any]) -> None:
    """One JSON object as a line on stdout (write_line)."""
    write_line((json.dumps(obj, separators=(",", ":")) + "\n").encode())


class Heartbeat:
    """`with Heartbeat(on):` a heartbeat line every `every` seconds (MICROGPT_HEARTBEAT_S, else HEARTBEAT_S) until
    the block ends; `on` False (a launcher whose rank 0 beats, a rank whose stdout goes nowhere): nothing."""

    def __init__(self, on: bool = True):
        value = os.environ.get(HEARTBEAT_ENV)
        self.every = HEARTBEAT_S if value is None else parse_number(value, HEARTBEAT_ENV, 0.01, 3600.0)
        self.on, self.stop, self.t0 = on, threading.Event(), time.monotonic()

    def _beat(self) -> None:
        while not self.stop.wait(self.every):
            emit({"event": "heartbeat", "uptime_s": round(time.monotonic() - self.t0, 1)})

    def __enter__(self) -> Heartbeat:
        if self.on:
            threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()
        return self

    def __exit__(self, kind: type | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.stop.set()
