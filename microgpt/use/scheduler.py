"""The engine of `microgpt serve`: continuous batching over one inference plan of max_batch cache rows, in a process
of its own (serve.py starts it: `python -m microgpt.use.scheduler FD CHECKPOINT ...`), which never waits on HTTP.

Why a process: the HTTP side's work per token (an SSE event written, the text decoded, the stop strings sought) is
tens of microseconds of Python, and the engine's a few per row; in one process they share one interpreter lock, so
the host's work is their sum, and a GPU decode step of 1-3 ms leaves room for only a few dozen rows of it (docs/SERVE.md
has the measurements). Apart, they run on two cores at once, the engine's loop holds the lock alone, and what the
HTTP side does per token no longer delays a step. The wire (wire.py) carries ids, never text: the prompt's ids in,
each step's new tokens out, one message a step.

One pass of the loop (`step`):

    commands   what the HTTP side sent (wire.py), read without waiting while there is work
    admit      waiting rows, first come first served, get a free cache row: the one whose cached tokens share the
               longest prefix with the prompt (a chat's history from its last turn: prefix reuse), or, where a
               busier row holds a longer one, the least recently used free row with that prefix copied into it
               (cache_rows.py keeps what each cache row holds; InferState.copy_rows)
    prefill    rows with more than SHORT prompt tokens not in the cache yet (and, in a burst, shorter ones past
               what the decode step's spare rows hold), batched into one window of the inference step
               (model.gpt_infer, each row at its own position and cache row; the rows from position 0 first, which
               it runs as one group whatever their cache rows: model.windows), at most PREFILL_TOKENS of window a
               pass and CHUNK a row, so a long prompt is prefilled over several passes while the batch decodes; a
               row's last prompt token is left for the decode step, which draws the first token from it
    launch     the decode step of every row with a token to feed, and in its spare rows (up to max_batch) the
               prompt tokens of rows with at most SHORT left, one row each: a cache row's tokens at distinct
               positions of one step, each reading the keys the others wrote (ops/decode.py), the last one drawing
               the first token; so the short prompts that wait are prefilled together in the batch's own step (one
               graph replay, not a launch per row and layer) and join the batch at once. The inputs are patched from
               the host's arrays (InferState.stage_decode, launch_decode), not rebuilt per row; on a GPU the step's
               CUDA graph is replayed without waiting, while the host goes on. A step of b rows runs at the least
               of the decode sizes (`decode_sizes`) that holds them, its last rows padding (the padding row's
               positions, which nothing reads): every size's step is prepared before the engine says it is ready
               (on a GPU a warm-up that times its choices, then its graph captured: far longer than a step), so no
               request ever waits for one, and the sizes are few (35 for 256 rows, not 256 graphs)
    finish     the tokens of the step launched in the pass before, read only now: the GPU runs one step while the
               host reads the last one's tokens, sends them, and finds the rows that end. A greedy row's next token
               is carried into the next step on the device (InferState.carry), so the host is one step behind; a row
               that ended runs one step more, whose token is dropped. A row that samples, or whose logprobs are
               asked, needs its logits on the host before its next token: a step holding one is finished before the
               next is launched (no overlap, the same tokens).

Rows are independent: a row's tokens are those it would get decoded alone (sample.py says where a GEMM over several
rows rounds otherwise); greedy rows draw the step's own argmax (b ints leave the device), sampling rows `pick` from
their logits with their own seed, as `microgpt sample --seed S` draws. A row ends at one of its stop tokens, at its
max_tokens, or where the context is full (no sliding window); a cancel (the client went, or the HTTP side found a stop
string) drops it from the next step. The HTTP side bounds what is submitted (429 beyond max_batch + queue), so the
engine's queue is never longer than that.

The plan holds max_batch + 1 cache rows: the last is the padding row's, which no request is given.
"""

from __future__ import annotations

import argparse
import bisect
import os
import signal
import socket
import sys
import time
import traceback
from collections import defaultdict, deque

import numpy as np

from microgpt.engine.trained import load_trained
from microgpt.errors import InputError
from microgpt.use import sample
from microgpt.use.batch import FIXED, Batch, Row, Step
from microgpt.use.cache_rows import CacheRows
from microgpt.use.sample import Generator, pick
from microgpt.use.wire import Channel

PREFILL_TOKENS = 4096  # window tokens (rows x the longest row's chunk) prefilled in one pass at most
CHUNK = 512  # prompt tokens of one row prefilled in one pass at most
SHORT = 64  # a prompt with at most this many tokens left is fed through the decode step's spare rows instead
PAD_STEP = 8  # decode sizes: 1, 2, 4, then every PAD_STEP-th up to max_batch (a step pads at most PAD_STEP - 1 rows)
# the prefill windows run once at start on a GPU (Scheduler.warm_windows): rows, tokens a row and a row's first
# position of each kind Triton compiles a kernel of its own for (an integer argument of 1, a multiple of 16, neither)
WARM_SIZES = (1, 2, 16, 17)
IDLE_WAIT_S = 0.5  # with nothing to do, the loop sleeps on the socket this long at most
INTERNAL = "internal error (see the server's stderr)"


def decode_sizes(max_batch: int, T: int) -> list[int]:
    """The batch sizes the decode step runs at: 1, 2, 4, every PAD_STEP-th and max_batch (every size where the
    context T is too short for PAD_STEP - 1 padding positions). Padding a step to the next costs a GPU's decode
    step next to nothing (it reads the weights once, however many rows), and bounds the steps to prepare."""
    step = PAD_STEP if T > PAD_STEP else 1
    sizes = {s for s in (1, 2, 4) if s < min(step, max_batch)} | set(range(step, max_batch, step))
    return sorted(sizes | {max_batch})


class Scheduler:
    """The loop over max_batch cache rows of gen's max_batch + 1 (the last the padding row's; the module
    docstring), talking to the HTTP side over chan. Every decode size's step is prepared at construction."""

    def __init__(self, gen: Generator, chan: Channel, reuse: bool = True) -> None:
        self.gen, self.S, self.chan = gen, gen.S, chan
        self.max_batch, self.T = gen.S.B - 1, gen.m.seq_len
        self.pad_slot = gen.S.B - 1  # the padding row: its positions are written by padding, read by none
        self.sizes = decode_sizes(self.max_batch, self.T)
        self.cache = CacheRows(gen.S, self.T, reuse, self.max_batch)  # what each cache row holds, which are free
        self.rows: dict[int, list[Row]] = {}  # rid -> its rows not done
        self.waiting: deque[Row] = deque()
        self.prefilling: list[Row] = []
        self.batch = Batch(self.max_batch)  # rows with a token to feed: the next decode step's
        self.pending: Step | None = None
        self.started = self.stopping = False
        self.out: list[tuple[np.ndarray, ...]] = []  # (rid, index, token, code) arrays of this pass
        self.out_lps: list[tuple] = []  # (rid, index, token, logprob, top) of the tokens whose logprobs are asked
        self.counts: dict[str, float] = defaultdict(float)  # steps, rows, prefill and reused tokens, seconds a phase
        self.prepare()

    def prepare(self) -> None:
        """Each decode size's step run once now (on a GPU: its warm-up and graph capture, InferState's decoders), on
        rows that write where nothing is held yet (position i % T of cache row i // T: every row is empty); then, on
        a backend that compiles its kernels (Backend.compiles: Triton on a GPU), the prefill windows
        (`warm_windows`)."""
        t0 = time.perf_counter()
        for n in self.sizes:
            i = np.arange(n)
            self.S.stage_decode(np.concatenate([np.zeros(n, np.int64), i % self.T, i // self.T]).astype(np.int32))
            self.S.launch_decode(n)()
        if self.S.K.compiles:
            self.warm_windows()
        self._time("prepare", t0)

    def warm_windows(self) -> None:
        """A prefill window of each kind the inference step compiles a kernel for, run once now (its tokens 0, its
        keys and values where no cache row holds anything yet: cache.fed is 0 everywhere), so that no request pays
        for a compile. On a GPU, Triton compiles a kernel again for each new kind of integer argument (1, a multiple
        of 16, neither: WARM_SIZES), and the window's rows, tokens a row and first position are such arguments. On
        one H100 (bench/RESULTS.md, twenty-sixth session) the first window of several rows held every first token of
        64 prompts of 512 tokens ~0.7 s, where 256 such prompts later took 266 ms (median) over 24 windows: a compile
        fits that, the windows' own work does not (not yet measured apart). The windows: b rows from position 0 in
        cache rows apart and in a run (model.windows: one position group either way, the keys and values put by
        decode_kv_write or by a copy), and one row at position p after a prefix (attention over the cache), for
        every b, t and p of WARM_SIZES that the plan holds."""
        for t in WARM_SIZES:
            if t >= self.T:
                continue
            for b in WARM_SIZES:
                if b <= self.max_batch:
                    for slots in [list(range(b))[::-1]] + [list(range(b))] * (b > 1):
                        self._window([0] * b, slots, t)
            for p in WARM_SIZES:
                if p + t <= self.T:
                    self._window([p], [0], t)

    def _window(self, pos: list[int], slots: list[int], t: int) -> None:
        tokens, _ = self.S.inputs(len(pos), t)
        self.S.K.copy_in(tokens, np.zeros((len(pos), t), np.int32))
        self.S.run(tokens, pos, slots=slots)

    # --- the loop ----------------------------------------------------------------------------------------------
    def run(self) -> None:
        while not self.stopping and not self.chan.closed:
            busy = self.started and bool(self.pending or len(self.batch) or self.prefilling or self.waiting)
            if not busy:
                self.chan.wait(IDLE_WAIT_S)
            t0 = time.perf_counter()
            for msg in self.chan.receive():
                self.command(msg)
            self._time("commands", t0)
            if self.started and not self.stopping:
                try:
                    self.step()
                except Exception:  # a bug or a failing device: the rows in flight get the error, the server goes on
                    traceback.print_exc(file=sys.stderr)
                    self.fail_all(INTERNAL)
            self.send()

    def command(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "submit":
            rid, specs = msg[1], msg[2]
            rows = [Row.of(rid, spec) for spec in specs]
            self.rows[rid] = rows
            self.waiting.extend(rows)
        elif kind == "cancel":
            for row in list(self.rows.get(msg[1], ())):
                if msg[2] < 0 or row.spec.index == msg[2]:
                    self.end(row)
        elif kind == "start":
            self.started = True
        elif kind == "stats":
            counts = {**self.counts, "active": len(self.batch), "waiting": len(self.waiting)}
            self.chan.send("stats", counts | {"prepared": len(self.S.decoders)})
        elif kind == "stop":
            self.stopping = True

    def step(self) -> None:
        """One pass: admit, prefill, launch the next decode step, then finish the one before (the docstring)."""
        prev = self.pending
        if prev is not None and prev.host:
            self.finish(prev, host=True)
            prev = None
        t0 = time.perf_counter()
        self.admit()
        t1 = self._time("admit", t0)
        self.prefill()
        t2 = self._time("prefill", t1)
        model = self.counts["model_s"]
        self.pending = self.launch(prev)
        self._time("launch", t2)
        self.counts["launch_s"] -= self.counts["model_s"] - model  # the host's part of the launch
        if prev is not None:
            self.finish(prev, host=False)

    def _time(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.counts[phase + "_s"] += now - since
        return now

    # --- rows in and out -------------------------------------------------------------------------------------
    def admit(self) -> None:
        while self.waiting and self.cache.free:
            row = self.waiting.popleft()
            if row.done:
                continue
            self.place(row)
            if row.fed < row.prompt.size - 1:
                self.prefilling.append(row)
            else:
                self.joined(row)

    def place(self, row: Row) -> None:
        """A free cache row for `row`, with the longest prefix of its prompt that any cache row holds (prefix reuse;
        none for a prompt whose every logprob is asked: echo)."""
        nb = len(self.batch)
        self.cache.fed[self.batch.slot[:nb]] = self.batch.pos[:nb]  # the decoding rows' positions so far
        row.slot, row.fed, copied = self.cache.take(row.prompt, reuse=not row.spec.echo)
        self.counts["reused_tokens"] += row.fed
        self.counts["copied_tokens"] += copied

    def joined(self, row: Row) -> None:
        """row's prompt is in the cache but for its last token, which its first decode step feeds."""
        if row.spec.echo:
            self.chan.send("echo", row.rid, row.spec.index, row.echo)
        if row.spec.max_tokens == 0:
            self.end(row)
            self.out.append(tuple(np.array([v]) for v in (row.rid, row.spec.index, -1, 2)))
            return
        self.batch.add(row, row.prompt.size - 1, int(row.prompt[-1]), -1)
        self.counts["prefill_tokens"] += 1  # every prompt token fed counts, the last one's in the decode step too

    def end(self, row: Row) -> None:
        """row leaves: its cache row is free (its tokens kept for reuse), it is in no later step."""
        if row.done:
            return
        row.done = True
        rows = self.rows.get(row.rid, [])
        if row in rows:
            rows.remove(row)
        if not rows:
            self.rows.pop(row.rid, None)
        if row.at >= 0:
            self.cache.fed[row.slot] = self.batch.remove(row)
        if row.slot >= 0:
            self.cache.release(row.slot)

    def fail_all(self, message: str) -> None:
        """Every row admitted gets the error (its request fails); the cache rows are free and hold nothing."""
        rows = [*self.batch.rows, *self.prefilling, *(self.pending.rows if self.pending else [])]
        rids = {r.rid for r in rows if r is not None}
        for rid in rids:
            for row in list(self.rows.get(rid, ())):
                self.end(row)
            self.chan.send("error", rid, message)
        for row in list(self.batch.rows):  # a row of no request (none: every row has one), to be sure
            self.batch.remove(row)
        self.cache.fed[:] = 0  # nothing a cache row holds is reused after a failed step
        self.prefilling, self.pending = [], None

    # --- the model ---------------------------------------------------------------------------------------------
    def prefill(self) -> None:
        """One window of the inference step over the rows being prefilled (the docstring): rows in order while the
        window (rows x its longest chunk) stays within PREFILL_TOKENS and every row's padded chunk within the context
        (the padding's keys and values land past the row's prompt, where its own steps write before they read). A
        row with at most SHORT left is the decode step's (launch), unless short prompts of more tokens than a step
        has rows wait (a burst: a chat's later turns, the cache holding their history, or many new requests at
        once): then those past what the step's spare rows hold join the window, prefilled in one pass, not fed a
        spare row at a time over many steps. The window's rows from position 0 (new requests) go first, next to each
        other: the inference step runs them as one position group (model.windows), each row further on as a group of
        its own. One prompt arriving at a busy batch is still fed through the spare rows: a window pass for it would
        cost every row's next step its time."""
        self.prefilling = [r for r in self.prefilling if not r.done]
        short = [r.prompt.size - r.fed for r in self.prefilling if r.prompt.size - r.fed <= SHORT and not r.spec.echo]
        burst = sum(short) > self.max_batch
        spare = self.max_batch - len(self.batch)  # the rows the next decode step has for prompt tokens (launch)
        rows, t, last = [], 0, 0  # last: the furthest position a row of the window starts at
        for row in self.prefilling:
            left = row.prompt.size - row.fed
            if left <= SHORT and not row.spec.echo and (left <= spare or left < 2 or not burst):
                spare -= min(left, spare)
                continue  # the decode step feeds it (launch)
            w = min(left - 1, CHUNK)
            tt = max(t, w)
            if (len(rows) + 1) * tt > PREFILL_TOKENS or max(last, row.fed) + tt > self.T:
                break
            rows.append(row)
            t, last = tt, max(last, row.fed)
        if not rows:
            return
        rows.sort(key=lambda r: r.fed > 0)  # those from position 0 first, next to each other: one position group
        x = np.zeros((len(rows), t), np.int32)
        for k, row in enumerate(rows):
            chunk = row.prompt[row.fed : min(row.fed + t, row.prompt.size - 1)]
            x[k, : chunk.size] = chunk
        tokens, _ = self.S.inputs(len(rows), t)
        self.S.K.copy_in_async(tokens, x)
        self.S.run(tokens, [r.fed for r in rows], slots=[r.slot for r in rows])
        for k, row in enumerate(rows):
            w = min(row.prompt.size - 1 - row.fed, t)
            if row.spec.echo:
                self.echo_logprobs(row, k * t, w)
            row.fed += w
            self.cache.fed[row.slot] = row.fed
            self.counts["prefill_tokens"] += w
        self.counts["prefill_windows"] += 1
        self.counts["prefill_padded"] += len(rows) * t
        for row in rows:
            if row.fed == row.prompt.size - 1:
                self.prefilling.remove(row)
                self.joined(row)

    def echo_logprobs(self, row: Row, lo: int, w: int) -> None:
        """The logprobs of the tokens after window rows lo .. lo + w - 1 (each predicts the next prompt token), and
        the spec's number of likeliest, from the window's logits (InferState.window_logits, B rows at a time)."""
        for a in range(lo, lo + w, self.max_batch):
            b = min(a + self.max_batch, lo + w)
            logits = self.S.K.to_numpy(self.S.window_logits(a, b))
            for j in range(b - a):
                nxt = int(row.prompt[row.fed + (a - lo) + j + 1])
                row.echo.append(logprob(logits[j], nxt, row.spec.logprobs))

    def launch(self, prev: Step | None) -> Step | None:
        """The next decode step: the batch's rows, one token each, then the rows left of it filled with the prompt
        tokens of rows being prefilled that have at most SHORT left (a short prompt fed in one step, its last token's
        row drawing its first token; a cache row's tokens at distinct positions in one step read each other's keys).
        A row whose token the host does not know yet has it carried from prev's greedy tokens on the device."""
        B = self.batch
        for row in [B.rows[j] for j in np.flatnonzero(B.pos[: len(B)] >= self.T)]:
            self.cache.fed[row.slot] = B.remove(row)  # its last position is fed: its last token is still to be read
        nb = len(B)
        spare, feeding = self.max_batch - nb, []
        for row in self.prefilling:
            left = row.prompt.size - row.fed
            if spare and not row.done and not row.spec.echo and left <= SHORT:
                feeding.append((row, row.fed, min(left, spare)))
                spare -= feeding[-1][2]
        b = self.max_batch - spare
        if not b:
            return None
        n = self.sizes[bisect.bisect_left(self.sizes, b)]  # the step's size: rows b .. n - 1 pad it
        inputs, runs = B.inputs(n)
        cols = {name: np.full(b, -1, np.int64) for name in FIXED}
        for name, col in cols.items():
            col[:nb] = getattr(B, name)[:nb]
        rows: list[Row | None] = list(B.rows)
        j, joins = nb, []
        for row, start, k in feeding:
            inputs[j : j + k] = row.prompt[start : start + k]
            inputs[n + j : n + j + k] = np.arange(start, start + k)
            inputs[2 * n + j : 2 * n + j + k] = row.slot
            rows += [None] * k
            if start + k == row.prompt.size:  # its last prompt token's place draws its first token
                rows[-1] = row
                joins.append((row, j + k - 1))
                for name, value in zip(FIXED, row.fixed):
                    cols[name][j + k - 1] = value
            j += k
        inputs[b:n], inputs[n + b : 2 * n], inputs[2 * n + b :] = 0, np.arange(n - b), self.pad_slot
        self.S.stage_decode(inputs)
        for dst, src, count in runs:
            self.S.carry(dst, src, count)
        t0 = time.perf_counter()
        wait = self.S.launch_decode(n)  # on a GPU a graph's launch; on the CPU the whole step
        self._time("model", t0)
        cols |= {"pos": inputs[n : n + b].astype(np.int64), "slot": inputs[2 * n : 2 * n + b].astype(np.int64)}
        step = Step(rows, cols, wait, bool(B.host) or any(r.host_draws for r, _, _ in feeding))
        B.launched()
        for row, start, k in feeding:
            row.fed += k
            self.cache.fed[row.slot] = row.fed
            self.counts["prefill_tokens"] += k
        for row, at in joins:  # rows of the batch now, their next token drawn at their place in this step
            self.prefilling.remove(row)
            B.add(row, row.fed, 0, at)
        self.counts["steps"] += 1
        self.counts["rows"] += b
        self.counts["padded_rows"] += n - b
        return step

    def finish(self, step: Step, host: bool) -> None:
        """The step's tokens, on the host: each drawing row's token sent (a row that ended at the step before draws
        nothing here), the rows that end ended; with `host`, the next step is not launched yet and its rows feed
        these tokens from the host (else they were carried on the device)."""
        t0 = time.perf_counter()
        tokens = step.wait()[: len(step.rows)].astype(np.int64)  # the padding's dropped
        t1 = self._time("wait", t0)
        live = np.array([r is not None and not r.done for r in step.rows])
        if step.host:
            for i in np.flatnonzero(live):
                row = step.rows[i]
                if row.host_draws:
                    logits = self.gen.logits(int(i))
                    tokens[i] = pick(logits, row.sampling, row.rng)
                    if row.spec.logprobs >= 0:
                        lp = logprob(logits, int(tokens[i]), row.spec.logprobs)
                        self.out_lps.append((row.rid, row.spec.index, int(tokens[i]), *lp))
        c, T = step.cols, self.T
        p = c["pos"]
        drawn = p - c["plen"] + 2  # the first token is drawn where the prompt's last is fed
        code = np.where(tokens == c["stop"], 1, np.where((drawn == c["max_tokens"]) | (p + 1 == T), 2, 0))
        known = live & (p + 1 < T)  # the token of position p + 1 of its cache row
        self.cache.drawn(c["slot"][known], p[known], tokens[known])
        sel = np.flatnonzero(live)
        self.out.append((c["rid"][sel], c["index"][sel], tokens[sel], code[sel]))
        if host:
            for i in sel:
                row = step.rows[i]
                if row.at >= 0:
                    self.batch.tok[row.at], self.batch.src[row.at] = tokens[i], -1
        for i in np.flatnonzero(live & (code != 0)):
            self.end(step.rows[i])
        self._time("finish", t1)

    def send(self) -> None:
        """This pass's tokens to the HTTP side, one message, and whatever the socket did not take before."""
        t0 = time.perf_counter()
        if self.out:
            rid, index, token, code = (np.concatenate(c).astype(np.int32).tobytes() for c in zip(*self.out))
            self.chan.send("tokens", rid, index, token, code, self.out_lps)
            self.out, self.out_lps = [], []
        self.chan.flush()
        self._time("send", t0)


def logprob(logits: np.ndarray, token: int, top: int) -> tuple[float, dict[int, float]]:
    """token's log-probability under logits (V,) and the `top` likeliest tokens' ({id: logprob}), in float64."""
    z = logits.astype(np.float64)
    z -= z.max()
    z -= np.log(np.exp(z).sum())
    best = np.argpartition(-z, top)[:top] if 0 < top < z.size else np.arange(z.size) if top > 0 else []
    return float(z[token]), {int(i): float(z[i]) for i in sorted(best, key=lambda i: -z[i])}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m microgpt.use.scheduler", description="serve's engine process")
    p.add_argument("fd", type=int, help="this process's end of the socket pair")
    p.add_argument("checkpoint", help="a step-*.bin or a run folder, as serve's user named it")
    p.add_argument("--max-batch", type=int, required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--precision")
    p.add_argument("--no-prefix-reuse", action="store_true")
    return p


def main(argv: list[str]) -> int:
    """The engine process: read the checkpoint (serve's one reader of it: a step-*.bin or a run folder, as the user
    named it) onto a plan of --max-batch rows and the padding row, prepare every decode size's step, say ready with
    what it loaded (the path, the step and the sidecar, from which the HTTP side builds the tokenizer and the model's
    card) or why not, then run until told to stop or the HTTP side has gone. Ctrl-C reaches the whole process group:
    the HTTP side stops this one."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = parser().parse_args(argv)
    chan = Channel(socket.socket(fileno=args.fd))
    try:
        ld = load_trained(args.checkpoint)
        gen, _ = sample.open_trained(ld, args.max_batch + 1, args.backend, args.precision)
        sched = Scheduler(gen, chan, reuse=not args.no_prefix_reuse)
    except InputError as e:
        chan.send("fail", str(e))
    except Exception as e:  # a failing device: the HTTP side prints one line, the traceback is here
        traceback.print_exc(file=sys.stderr)
        chan.send("fail", f"the engine did not start: {type(e).__name__}: {e}")
    else:
        chan.send(
            "ready",
            {
                "max_batch": sched.max_batch,
                "decode_sizes": sched.sizes,
                "backend": gen.S.K.name,
                "precision": gen.S.K.precision.name,
                "device": gen.S.K.device,
                "engine_pid": os.getpid(),
            },
            {"path": str(ld.path), "step": ld.step, "side": ld.side},
        )
        sched.run()
    while chan.outbox and not chan.closed:
        chan.wait(1.0)
        chan.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
