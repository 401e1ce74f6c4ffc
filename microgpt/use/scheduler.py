"""Continuous batching for `microgpt serve`: the requests in flight decoded together, one position a pass.

One thread owns the model (a sample.Generator over an inference plan of B rows, B = --max-batch) and loops:

    admit     the waiting jobs, first come first served, while the batch has free cache rows for all of a job's
              choices (a job of n choices takes n rows at once; a later job never overtakes a waiting one)
    prefill   each admitted choice's prompt, alone, into its own cache row from position 0; its first token
    decode    one position for every row in the batch, each at its own position, in one decode step
              (InferState.decode: model.gpt_decode, on a GPU one CUDA graph per batch size), then each row's token:
              a greedy row's is the step's own argmax (b ints leave the device), a sampling row draws from its
              logits with its own sampling and seed; a row that stops (a stop string, a stop token, max_tokens,
              the context full) leaves the batch at once and its cache row takes the next waiting choice

so a request arriving while others decode waits at most one pass to start, and a long request never holds a short
one behind it. Rows are independent: a row's tokens are those it would get decoded alone (sample.py says where the
GEMM over several rows rounds otherwise). The thread never waits on a client: a row's text goes into its job's
events, and once a pass is done each job that got some is woken (Job.wake, the HTTP side's: serve.py's streams are
read on the transport's event loop, so a token costs no hand-off between threads beyond that one wake a pass).

The bound: a job holds its rows from submit() until its answer is done (release(), by the HTTP side), so at most
B + Q rows are in flight (decoding, waiting, or being sent); one more is refused (Busy: HTTP 429). A job whose
client has gone (released before it finished) leaves the batch at the next pass. stop() ends the loop and sends
every unfinished job an error.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from microgpt.use.chat import Stream
from microgpt.use.sample import Generator, Sampling, pick

STOPPING = "the server is shutting down"


class Busy(Exception):
    """More rows than the batch and the queue hold (HTTP 429)."""


@dataclass(eq=False)
class Choice:
    """One sequence to decode: a row of the batch while it is admitted."""

    index: int  # the choice's index in its request
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    rng: np.random.Generator
    stream: Stream  # the text so far, cut at the request's stop strings
    stop_ids: frozenset[int]  # tokens that end the choice (the tokenizer's end of document)
    ids: list[int] = field(default_factory=list)  # the tokens drawn
    slot: int = -1  # its cache row while admitted
    pos: int = 0  # positions of its cache row filled


@dataclass
class Event:
    """What a job's queue carries: a choice's new text, and its finish reason once it ended ("stop", "length";
    "error" with the message as text)."""

    index: int
    text: str
    finish: str | None = None


class Job:
    """One request: its choices and their Events, which the decode thread sends and the HTTP side takes, woken by
    `wake` (set by the HTTP side before it first takes) once a pass has sent it some."""

    def __init__(self, choices: list[Choice]) -> None:
        self.choices = choices
        self.events: deque[Event] = deque()  # appended by the decode thread, taken by the HTTP side
        self.wake: Callable[[], None] = lambda: None
        self.released = False  # the HTTP side is done with it (answered, or its client went away)
        self.left = len(choices)  # choices not finished

    def send(self, event: Event) -> None:
        self.left -= event.finish is not None
        self.events.append(event)

    def take(self) -> list[Event]:
        """The events sent since the last take, in order (one reader)."""
        out = []
        while self.events:
            out.append(self.events.popleft())
        return out


class Scheduler:
    """The decode loop over gen's B rows, in a thread of its own from start() to stop(); `queue` more rows may wait."""

    def __init__(self, gen: Generator, queue: int) -> None:
        self.gen = gen
        self.capacity = gen.S.B + queue
        self.free = list(range(gen.S.B))  # cache rows no choice holds
        self.waiting: deque[Job] = deque()
        self.active: list[tuple[Job, Choice]] = []  # the batch, in the loop thread only
        self.sent: dict[int, Job] = {}  # the jobs this pass sent events to, woken at its end
        self.held = 0  # rows of the jobs submitted and not released
        self.stopping = False
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="serve-decode", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; Busy when its rows do not fit beside those in flight, RuntimeError once stopping."""
        with self.cv:
            if self.stopping:
                raise RuntimeError(STOPPING)
            if self.held + len(job.choices) > self.capacity:
                raise Busy(f"the server is busy: {self.held} of its {self.capacity} rows are in flight")
            self.held += len(job.choices)
            self.waiting.append(job)
            self.cv.notify()

    def release(self, job: Job) -> None:
        """The HTTP side is done with the job: its rows no longer count, and unfinished choices leave the batch."""
        with self.cv:
            if not job.released:
                job.released = True
                self.held -= len(job.choices)
                self.cv.notify()

    def stop(self) -> None:
        """End the loop (after the pass under way; never started: none) and send every job still in flight an
        error."""
        with self.cv:
            self.stopping = True
            self.cv.notify()
        if self.thread.ident is not None:
            self.thread.join()
        for job in {id(j): j for j in [*self.waiting, *(j for j, _ in self.active)]}.values():
            self._fail(job, STOPPING)

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.stopping and not self.active and not self.waiting:
                    self.cv.wait()
                if self.stopping:
                    return
                admitted = self._admit()
            try:
                for job, c in admitted:
                    logits = self.gen.run(np.asarray(c.prompt, np.int32)[None], 0, [c.slot])[0]
                    c.pos = len(c.prompt)
                    self._advance(job, c, pick(logits, c.sampling, c.rng))
                if self.active:
                    self._decode()
            except Exception:  # a bug or a failing device: its rows get the error, the server goes on
                traceback.print_exc(file=sys.stderr)
                for job in {id(j): j for j, _ in self.active}.values():
                    self._fail(job, "internal error (see the server's stderr)")
            for job in self.sent.values():
                job.wake()
            self.sent.clear()

    def _admit(self) -> list[tuple[Job, Choice]]:
        """Under the lock: drop the batch's released jobs, then admit waiting jobs in order while their rows fit."""
        for job, c in [(j, c) for j, c in self.active if j.released]:
            self._leave(job, c)
        while self.waiting and self.waiting[0].released:
            self.waiting.popleft()
        admitted = []
        while self.waiting and len(self.waiting[0].choices) <= len(self.free):
            job = self.waiting.popleft()
            for c in job.choices:
                c.slot = self.free.pop()
                self.active.append((job, c))
                admitted.append((job, c))
        return admitted

    def _decode(self) -> None:
        """One position for every row of the batch, each at its own, in one decode step. A greedy row's token is the
        step's own argmax (b ints leave the device, not b x V logits); a row that samples reads its logits and
        draws with `pick`, as sample.py does."""
        rows = list(self.active)
        greedy = self.gen.decode([c.ids[-1] for _, c in rows], [c.pos for _, c in rows], [c.slot for _, c in rows])
        for i, ((job, c), token) in enumerate(zip(rows, greedy)):
            c.pos += 1
            if c.sampling.temperature > 0:
                token = pick(self.gen.logits(i), c.sampling, c.rng)
            self._advance(job, c, token)

    def _advance(self, job: Job, c: Choice, token: int) -> None:
        """Take the choice's next token; send its new text; end it where it stops."""
        if token in c.stop_ids:
            text, finish = c.stream.push(c.ids, last=True)[0], "stop"
            c.ids.append(token)
        else:
            c.ids.append(token)
            text, stopped = c.stream.push(c.ids)
            full = len(c.ids) == c.max_tokens or c.pos == self.gen.m.seq_len
            finish = "stop" if stopped else "length" if full else None
            if finish == "length":
                text += c.stream.push(c.ids, last=True)[0]
        if text or finish:
            job.send(Event(c.index, text, finish))
            self.sent[id(job)] = job
        if finish:
            self._leave(job, c)

    def _leave(self, job: Job, c: Choice) -> None:
        self.active.remove((job, c))
        self.free.append(c.slot)

    def _fail(self, job: Job, message: str) -> None:
        """End every unfinished choice of job with an error (its rows leave the batch)."""
        for c in job.choices:
            if (job, c) in self.active:
                self._leave(job, c)
        if job.left:
            job.send(Event(-1, message, "error"))
            job.wake()
