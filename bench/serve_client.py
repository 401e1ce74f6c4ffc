"""bench/serve.py's clients, standard library only: a streamed request read event by event, many at once from threads
of one process, and many from several processes (forked, 32 streams each) released at one instant. Times are
time.perf_counter, one clock for every process of the machine."""

from __future__ import annotations

import http.client
import json
import multiprocessing
import threading
import time
from dataclasses import dataclass, field
from typing import Any

HOST = "127.0.0.1"
CLIENTS_PER_PROC = 32


class BenchError(Exception):
    """The server did not come up, or a request failed: one line, the bench exits 1."""


@dataclass
class Run:
    """One streamed completion as the client saw it; times are time.perf_counter()."""

    key: int
    sent: float
    events: list[float] = field(default_factory=list)  # arrival of each event with text
    end: float = 0.0
    text: str = ""
    finish: str | None = None
    usage: dict[str, int] | None = None
    done: bool = False  # data: [DONE] came

    def event(self, data: bytes, now: float) -> bool:
        """Take one event's data; False at [DONE]."""
        if data == b"[DONE]":
            self.done = True
            return False
        obj = json.loads(data)
        if "error" in obj:
            raise BenchError(f"a stream ended with the server's error: {obj['error'].get('message')}")
        for choice in obj["choices"]:
            text = choice["text"] if "text" in choice else choice["delta"].get("content") or ""  # completions; chat
            if text:
                self.events.append(now)
            self.text += text
            self.finish = choice["finish_reason"] or self.finish
        self.usage = obj.get("usage") or self.usage
        return True

    @property
    def tokens(self) -> int:
        return self.usage["completion_tokens"]


def stream(
    port: int, path: str, body: dict[str, Any], key: int, timeout: float, first: threading.Event | None = None
) -> Run:
    """One streamed request, read event by event as the server sends them; `first` is set at its first event."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        run = Run(key, time.perf_counter())
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        res = conn.getresponse()
        if res.status != 200:
            raise BenchError(f"POST {path}: HTTP {res.status} {res.read(400).decode(errors='replace')}")
        for line in res:  # close-delimited HTTP/1.0 body: lines as they arrive
            if line.startswith(b"data: ") and not run.event(line[6:].strip(), time.perf_counter()):
                break
            if first is not None and run.events:
                first.set()
        run.end = time.perf_counter()
    finally:
        conn.close()
    if not (run.done and run.usage and run.finish):
        raise BenchError(f"a stream ended without its finish reason, usage or [DONE]: {run}"[:500])
    return run


def threads(
    port: int,
    bodies: list[tuple[int, dict]],
    timeout: float,
    at: float = 0.0,
    ramp: bool = False,
    path: str = "/v1/completions",
) -> list[Run]:
    """Every (key, body) streamed at once from this process, a thread each, released together at `at` (perf_counter;
    0: now); with ramp, each once the one before has had its first event, so the batch grows one row at a time."""
    runs: list[Run | Exception | None] = [None] * len(bodies)
    answered = [threading.Event() for _ in bodies]

    def one(i: int) -> None:
        if ramp and i:
            answered[i - 1].wait()
        elif at:
            time.sleep(max(0.0, at - time.perf_counter()))
        try:
            key, body = bodies[i]
            runs[i] = stream(port, path, body, key, timeout, answered[i])
        except Exception as e:  # raised in the caller below
            runs[i] = e
        finally:
            answered[i].set()

    pool = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    for r in runs:
        if isinstance(r, Exception):
            raise r
    return runs


def _client_process(args: tuple) -> list[Run]:
    return threads(*args)


def fleet(port: int, bodies: list[tuple[int, dict]], timeout: float, path: str = "/v1/completions") -> list[Run]:
    """The bodies streamed at once from as many client processes as CLIENTS_PER_PROC asks, released at one instant;
    their runs in order."""
    chunks = [bodies[i : i + CLIENTS_PER_PROC] for i in range(0, len(bodies), CLIENTS_PER_PROC)]
    if len(chunks) == 1:
        return threads(port, bodies, timeout, path=path)
    # fork: a client process starts at once with what this one imported, and touches no GPU (this one may have)
    with multiprocessing.get_context("fork").Pool(len(chunks)) as pool:
        at = time.perf_counter() + 0.5  # every process's threads started and waiting by then
        parts = pool.map(_client_process, [(port, c, timeout, at, False, path) for c in chunks], chunksize=1)
    return [r for part in parts for r in part]
