"""The engine process (scheduler.py) as serve's HTTP side sees it: started, sent each request's rows and cancels over
the wire (wire.py), and its tokens decoded into each request's events on the event loop.

A request is a Job of Choices. The engine sends ids only; here each touched choice is decoded once per message
(chat.Stream: only the ids past the last clean point, the text held back where a character or a stop string may be
incomplete), its stop strings found (then the engine is told to drop the row, and usage counts the tokens up to the
one that completed the string), and an Event (its new text, its finish, its logprobs) handed to the job's reader,
which `ready` wakes. The rows a job holds count from submit() to release() (the answer sent, or its client gone):
past max_batch + queue of them, Busy (429).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from microgpt.errors import InputError
from microgpt.use.chat import Stream
from microgpt.use.oai import Spec
from microgpt.use.sample import side_tokenizer
from microgpt.use.wire import FINISH, Channel, RowSpec

START_TIMEOUT_S = 600.0  # the engine's load (a GPU's first compiles are not here: they come with the first steps)
STOPPING = "the server is shutting down"


class EngineError(InputError):
    """The engine process did not start (its reason: a flag the backend refuses, a checkpoint, a device)."""


class Busy(Exception):
    """More rows than the batch and the queue hold (HTTP 429)."""


@dataclass
class Event:
    """What a job's reader takes: a choice's new text, its finish reason once it ended ("stop", "length"; "error"
    with the message as text), and the logprobs of the tokens behind the text where asked."""

    index: int
    text: str
    finish: str | None = None
    logprobs: list[tuple[int, float | None, dict[int, float] | None]] | None = None


@dataclass(eq=False)
class Choice:
    """One choice of a request, on this side: the tokens the engine drew for it, decoded as they come."""

    index: int
    prompt: list[int]
    stream: Stream  # the text so far, cut at the request's stop strings
    ids: list[int] = field(default_factory=list)  # its text's tokens (a stop token is no text)
    drawn: int = 0  # tokens drawn, for usage
    code: int = 0  # the engine's finish code (wire.FINISH) of its last token
    pushed: int = 0  # ids decoded by the last push
    finish: str | None = None
    lps: list[tuple[int, float | None, dict[int, float] | None]] = field(default_factory=list)  # (token, lp, top)
    sent_lps: int = 0  # lps already in an event
    echo: list[tuple[int, float | None, dict[int, float] | None]] | None = None  # the prompt's, where asked


class Job:
    """One request: its choices and the Events this side sends its reader, which `ready` wakes."""

    def __init__(self, spec: Spec, choices: list[Choice]) -> None:
        self.spec, self.choices = spec, choices
        self.rid = -1
        self.events: deque[Event] = deque()
        self.ready = asyncio.Event()  # set on the event loop when events came
        self.released = False  # the answer is over (sent, or its client gone)
        self.left = len(choices)  # choices not finished

    def send(self, event: Event) -> None:
        self.left -= event.finish is not None and event.index >= 0
        self.events.append(event)
        self.ready.set()

    def take(self) -> list[Event]:
        out = list(self.events)
        self.events.clear()
        self.ready.clear()
        return out


class Engine:
    """The engine process (scheduler.py), seen from here: started, sent rows and cancels, its tokens decoded into
    each job's events on the event loop. `held` rows count from submit() to release(): at most max_batch + queue."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.max_batch, self.queue = args.max_batch, args.queue
        ours, theirs = socket.socketpair()
        cmd = [
            sys.executable,
            "-m",
            "microgpt.use.scheduler",
            str(theirs.fileno()),
            args.checkpoint,  # as the user named it: the engine process is the one reader of the checkpoint
            "--max-batch",
            str(args.max_batch),
            "--backend",
            args.backend,
            *(["--precision", args.precision] if args.precision else []),
            *(["--no-prefix-reuse"] if args.no_prefix_reuse else []),
        ]
        self.proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.chan = Channel(ours)
        self.lock = threading.Lock()
        self.jobs: dict[int, Job] = {}
        self.ids = itertools.count()
        self.held = 0
        self.info: dict[str, Any] = {}  # the engine's device, its backend and precision (wait_ready)
        self.loaded: dict[str, Any] = {}  # the checkpoint it read: {"path", "step", "side"} (wait_ready)
        self.tok: Any = None  # the tokenizer of that checkpoint's sidecar (wait_ready)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stats: deque[asyncio.Future] = deque()
        self.gone = ""  # why the engine cannot take requests any more

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until the engine has loaded the model (then `info`, `loaded` and `tok` are its); EngineError with its
        reason where it could not (a bad checkpoint: the engine's one line naming the file)."""
        for _ in range(int(timeout * 10)):
            self.chan.wait(0.1)
            for msg in self.chan.receive():
                if msg[0] == "ready":
                    self.info, self.loaded = msg[1], msg[2]
                    self.tok = side_tokenizer(self.loaded["side"], self.loaded["path"])
                    return
                if msg[0] == "fail":
                    self.proc.wait()
                    raise EngineError(msg[1])
            if self.chan.closed or self.proc.poll() is not None:
                raise EngineError(
                    f"the engine process exited ({self.proc.wait()}) before it was ready; its stderr says why"
                )
        self.proc.kill()
        raise EngineError(f"the engine did not load the model within {timeout:g} s")

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the event loop: the engine's messages are read there, as they come."""
        self.loop = loop
        loop.add_reader(self.chan.fileno(), self._readable)
        self._flush()

    def send(self, *msg: Any) -> None:
        """From any thread: queued and written without blocking (the loop writes the rest when it can)."""
        with self.lock:
            self.chan.send(*msg)
            left = bool(self.chan.outbox)
        if left and self.loop is not None:
            self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self.lock:
            done = self.chan.flush()
        if done:
            self.loop.remove_writer(self.chan.fileno())
        else:
            self.loop.add_writer(self.chan.fileno(), self._flush)

    def submit(self, job: Job, rows: list[RowSpec]) -> None:
        """Queue a job's rows; Busy when they do not fit beside those in flight, RuntimeError once stopping."""
        with self.lock:
            if self.gone:
                raise RuntimeError(self.gone)
            limit = self.max_batch + self.queue
            if self.held + len(rows) > limit:
                raise Busy(f"the server is busy: {self.held} of its {limit} rows are in flight")
            self.held += len(rows)
            job.rid = next(self.ids)
            self.jobs[job.rid] = job
        self.send("submit", job.rid, rows)

    def release(self, job: Job) -> None:
        """The answer is over: the job's rows no longer count, and unfinished choices leave the batch."""
        with self.lock:
            if job.released:
                return
            job.released = True
            self.held -= len(job.choices)
            self.jobs.pop(job.rid, None)
        if job.left and not self.gone:
            self.send("cancel", job.rid, -1)

    def start(self) -> None:
        self.send("start")

    def stop(self) -> None:
        """Refuse new jobs, fail those in flight (STOPPING), and end the engine process."""
        with self.lock:
            self.gone = STOPPING
        self.send("stop")
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self._fail_all, STOPPING)
            except RuntimeError:  # the loop has closed
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    async def counters(self) -> dict[str, Any]:
        """The engine's counters (scheduler.py), asked for now."""
        fut = asyncio.get_running_loop().create_future()
        self.stats.append(fut)
        self.send("stats")
        return await asyncio.wait_for(fut, 30)

    # --- on the event loop -----------------------------------------------------------------------------------
    def _readable(self) -> None:
        """What the engine sent since the last read. The tokens of several passes in a row (this side fell behind)
        are taken as one pass's: each touched choice is decoded and handed to its reader once a read, not once a
        pass, so the work per token falls as the engine outpaces this side, and it never falls further behind."""
        run: list[tuple] = []  # consecutive "tokens" messages, taken together
        for msg in self.chan.receive():
            kind = msg[0]
            if kind == "tokens":
                run.append(msg[1:])
                continue
            if run:
                self._tokens(run)
                run = []
            if kind == "echo":
                job = self.jobs.get(msg[1])
                if job is not None:
                    c = job.choices[msg[2]]
                    c.echo = [(int(t), None, None) for t in c.prompt[:1]]
                    c.echo += [(int(t), lp, top) for t, (lp, top) in zip(c.prompt[1:], msg[3])]
                    job.ready.set()  # a stream waits for it before its first chunk
            elif kind == "error":
                job = self.jobs.get(msg[1])
                if job is not None:
                    job.send(Event(-1, msg[2], "error"))
            elif kind == "stats" and self.stats:
                self.stats.popleft().set_result(msg[1])
        if run:
            self._tokens(run)
        if self.chan.closed:
            self.loop.remove_reader(self.chan.fileno())
            with self.lock:
                self.gone = self.gone or "the engine process has stopped (see the server's stderr)"
            self._fail_all(self.gone)

    def _fail_all(self, message: str) -> None:
        for job in list(self.jobs.values()):
            if job.left:
                job.send(Event(-1, message, "error"))

    def _tokens(self, passes: list[tuple[bytes, bytes, bytes, bytes, list[tuple]]]) -> None:
        """The tokens of one or more passes, in order ((rids, indices, tokens, codes, lps) each, as wire.py sends
        them): each choice's new ones appended, then each touched choice decoded once; a choice whose logprobs are
        asked once a pass (its chunks, and which of them carries which token's logprobs, are the same however far
        behind this side is)."""
        touched, scored = [], False
        for rid, index, drawn, ids, code in by_choice(passes):
            job = self.jobs.get(rid)
            if job is None or job.choices[index].finish is not None:
                continue  # released, or ended here (a stop string) before the engine heard of it
            if job.spec.logprobs is not None:
                scored = True
                continue
            c = job.choices[index]
            c.drawn += drawn
            c.ids += ids
            c.code = code
            touched.append((job, c))
        if scored:
            self._scored(passes)
        for job, c in touched:
            self._update(job, c)

    def _scored(self, passes: list[tuple[bytes, bytes, bytes, bytes, list[tuple]]]) -> None:
        """The tokens of the choices whose logprobs are asked, with their logprobs, decoded once a pass."""
        for rids, indices, tokens, codes, lps in passes:
            scored: dict[tuple[int, int], tuple[Job, Choice]] = {}
            arrays = (np.frombuffer(a, np.int32).tolist() for a in (rids, indices, tokens, codes))
            for rid, index, token, code in zip(*arrays):
                job = self.jobs.get(rid)
                if job is None or job.spec.logprobs is None or job.choices[index].finish is not None:
                    continue
                c = job.choices[index]
                if token >= 0:
                    c.drawn += 1
                    if code != 1:
                        c.ids.append(token)
                c.code = code
                scored[rid, index] = job, c
            for rid, index, token, lp, top in lps:
                if (rid, index) in scored:
                    scored[rid, index][1].lps.append((token, lp, top))
            for job, c in scored.values():
                self._update(job, c)

    def _update(self, job: Job, c: Choice) -> None:
        """The choice's new text (Stream: held back where a character or a stop string may be incomplete), its
        finish (the engine's, or a stop string found here: then the engine is told to drop its row, and usage counts
        the tokens up to the one that completed it, whatever the engine drew after it)."""
        lo, c.pushed = c.pushed, len(c.ids)
        text, stopped = c.stream.push(c.ids, last=c.code == 1)
        finish = "stop" if stopped or c.code == 1 else FINISH[c.code]
        if stopped:
            c.drawn = first_stop(self.tok.decode, c.ids, c.stream.stops, lo)
            del c.lps[c.drawn :]
            if c.code == 0:
                self.send("cancel", job.rid, c.index)
        elif finish == "length":
            text += c.stream.push(c.ids, last=True)[0]
        if text or finish:
            c.finish = finish
            lps = c.lps[c.sent_lps :] if job.spec.logprobs is not None else None
            c.sent_lps = len(c.lps)
            job.send(Event(c.index, text, finish, lps))


def by_choice(
    passes: list[tuple[bytes, bytes, bytes, bytes, list[tuple]]],
) -> Iterator[tuple[int, int, int, list, int]]:
    """Each choice's tokens in passes (as Engine._tokens takes them), in pass order: (rid, index, tokens drawn, the
    ids of its text, its last finish code); a stop token (code 1) is drawn but no text, a token of -1 (a row of
    max_tokens 0) neither. Several passes (a read behind the engine) are grouped by choice as arrays, so the Python
    is per choice, not per token; in one pass a choice comes once at most."""
    cols = [np.frombuffer(b"".join(p[k] for p in passes), np.int32) for k in range(4)]
    if len(passes) == 1:
        for rid, index, token, code in zip(*(a.tolist() for a in cols)):
            yield rid, index, int(token >= 0), [token] if token >= 0 and code != 1 else [], code
        return
    rid, index, token, code = cols
    key = (rid.astype(np.int64) << 32) | index
    order = np.argsort(key, kind="stable")  # by choice, each choice's tokens in pass order
    key, token, code = key[order], token[order], code[order]
    first = np.empty(key.size, bool)
    first[:1], first[1:] = True, key[1:] != key[:-1]
    starts = np.flatnonzero(first)
    text = (token >= 0) & (code != 1)
    drawn = np.add.reduceat(token >= 0, starts, dtype=np.int64).tolist()
    ends = np.cumsum(np.add.reduceat(text, starts, dtype=np.int64)).tolist()  # each choice's end in `kept`
    lasts = np.append(starts[1:], key.size) - 1
    kept, heads, at = token[text].tolist(), key[starts], 0
    for r, i, d, end, c in zip(
        (heads >> 32).tolist(), (heads & 0xFFFFFFFF).tolist(), drawn, ends, code[lasts].tolist()
    ):
        yield r, i, d, kept[at:end], c
        at = end


def first_stop(decode: Any, ids: list[int], stops: Sequence[str], lo: int) -> int:
    """How many of ids a stop string needed: the fewest, more than the `lo` of the push before (which found none),
    whose text holds one. Usage counts the tokens drawn up to the one that completed it, however many tokens one
    push brought."""
    for k in range(lo + 1, len(ids) + 1):
        text = decode(ids[:k])
        if any(s in text for s in stops):
            return k
    return len(ids)
