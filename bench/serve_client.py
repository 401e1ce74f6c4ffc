"""bench/serve.py's clients, standard library only: a streamed request read event by event, many at once from threads
of one process, and many from several processes (forked, 16 streams each) released at one instant. Times are
time.perf_counter, one clock for every process of the machine.

Every wait is bounded, and one that runs out is a BenchError that names what it waited for: a stream's connection,
its answer's head and each next line within `timeout` seconds; a client process's runs until it exits without them
or neither reads a line nor sends them for twice `timeout` (its own reads time out after one); its exit after it
sent them. The client processes are plain forked processes, each with a pipe for its runs and SIGTERM's default
action (bench/serve.py's handler turns SIGTERM into an exception), and any of them left when fleet() stops waiting is
killed (SIGKILL) and reaped. Not multiprocessing.Pool: leaving its `with` block calls terminate(), which takes the
task queue's read lock and then SIGTERMs the workers still alive, counting on SIGTERM to end them. A worker that had
inherited a Python handler and was just about to wait for that lock when the signal came ran no handler (the
signal only sets a flag, looked at once the wait returns) and waited for the lock forever, and the bench with it in
terminate()'s join: the hang of 40 streams after every stream had been read."""

from __future__ import annotations

import http.client
import json
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

HOST = "127.0.0.1"
CLIENTS_PER_PROC = 16  # one process of threads reads 22-37K events/s (a 2-core CPU, one token an event)
EXIT_WAIT_S = 30.0  # a client process's exit once it has sent its runs


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
    port: int,
    path: str,
    body: dict[str, Any],
    key: int,
    timeout: float,
    first: threading.Event | None = None,
    beat: Callable[[], None] | None = None,
) -> Run:
    """One streamed request, read event by event as the server sends them; `first` is set at its first event, `beat`
    called at each line read. BenchError where the server sends nothing for `timeout` seconds (the connection, the
    answer's head, the next line)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        run = Run(key, time.perf_counter())
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        res = conn.getresponse()
        if res.status != 200:
            raise BenchError(f"POST {path}: HTTP {res.status} {res.read(400).decode(errors='replace')}")
        for line in res:  # close-delimited HTTP/1.0 body: lines as they arrive
            if beat is not None:
                beat()
            if line.startswith(b"data: ") and not run.event(line[6:].strip(), time.perf_counter()):
                break
            if first is not None and run.events:
                first.set()
        run.end = time.perf_counter()
    except TimeoutError:
        raise BenchError(f"stream {key} (POST {path}): the server sent nothing for {timeout:g} s") from None
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
    beat: Callable[[], None] | None = None,
) -> list[Run]:
    """Every (key, body) streamed at once from this process, a thread each, released together at `at` (perf_counter;
    0: now); with ramp, each once the one before has had its first event, so the batch grows one row at a time.
    `beat`: stream()'s, for every stream."""
    runs: list[Run | Exception | None] = [None] * len(bodies)
    answered = [threading.Event() for _ in bodies]

    def one(i: int) -> None:
        if ramp and i:
            answered[i - 1].wait()
        elif at:
            time.sleep(max(0.0, at - time.perf_counter()))
        try:
            key, body = bodies[i]
            runs[i] = stream(port, path, body, key, timeout, answered[i], beat)
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


def _client(k: int, conn: Any, port: int, bodies: list[tuple[int, dict]], timeout: float, path: str, last: Any) -> None:
    """Client process k (forked): its streams released at the instant the parent sends, their runs sent back, or the
    error that ended them as ("error", one line); each line read stamps last[k] (perf_counter)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a SIGTERM ends it, whatever handler the parent had
    if not conn.poll(timeout):  # the parent gave no start: it has gone
        return
    at = conn.recv()

    def beat() -> None:
        last[k] = time.perf_counter()

    try:
        out: tuple[str, Any] = ("runs", threads(port, bodies, timeout, at, path=path, beat=beat))
    except BenchError as e:
        out = ("error", str(e))
    except Exception as e:  # one line for the parent's BenchError
        out = ("error", f"{type(e).__name__}: {e}")
    conn.send(out)


def fleet(port: int, bodies: list[tuple[int, dict]], timeout: float, path: str = "/v1/completions") -> list[Run]:
    """The bodies streamed at once from as many client processes as CLIENTS_PER_PROC asks, released at one instant;
    their runs in order. BenchError, the processes killed, where one fails, exits or goes silent (the module
    docstring)."""
    chunks = [bodies[i : i + CLIENTS_PER_PROC] for i in range(0, len(bodies), CLIENTS_PER_PROC)]
    if len(chunks) == 1:
        return threads(port, bodies, timeout, path=path)
    # fork: a client process starts at once with what this one imported, and touches no GPU (this one may have)
    ctx = multiprocessing.get_context("fork")
    last = ctx.RawArray("d", len(chunks))  # shared: each process's last line read, perf_counter
    procs, conns = [], []
    try:
        for k, chunk in enumerate(chunks):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_client, args=(k, theirs, port, chunk, timeout, path, last), daemon=True)
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(ours)
        at = time.perf_counter() + 0.5  # every process's threads started and waiting by then
        for k, conn in enumerate(conns):
            last[k] = at
            conn.send(at)
        parts = _collect(procs, conns, last, 2 * timeout)
        for k, proc in enumerate(procs):
            proc.join(EXIT_WAIT_S)
            if proc.exitcode is None:
                raise BenchError(f"client process {k} did not exit within {EXIT_WAIT_S:g} s of sending its runs")
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        for conn in conns:
            conn.close()
    return [r for part in parts for r in part]


def _collect(procs: list, conns: list, last: Any, silent: float) -> list[list[Run]]:
    """Each client process's runs, as they come; BenchError at the first error one sends, at one that exits without
    sending, or at one that has read nothing and sent nothing for `silent` seconds."""
    parts: list[list[Run] | None] = [None] * len(procs)
    while None in parts:
        left = [k for k, part in enumerate(parts) if part is None]
        wait([conns[k] for k in left] + [procs[k].sentinel for k in left], timeout=1.0)
        for k in left:
            if conns[k].poll():  # its runs, its error, or the end of a process that exited without either
                try:
                    kind, value = conns[k].recv()
                except (EOFError, OSError):
                    procs[k].join(EXIT_WAIT_S)
                    raise BenchError(
                        f"client process {k} exited with status {procs[k].exitcode} before sending its runs"
                    ) from None
                if kind == "error":
                    raise BenchError(value)
                parts[k] = value
            elif time.perf_counter() - last[k] > silent:
                raise BenchError(f"client process {k} read nothing and sent no runs for {silent:g} s")
    return parts
