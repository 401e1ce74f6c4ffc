"""serve's engine loop (microgpt/use/scheduler.py) driven pass by pass in this process, over a real socket pair, on
the NumPy backend: rows that wait, join, are prefilled in batched and chunked windows and decode with their tokens
carried one step behind give each its own sequence's tokens (sample.generate's, alone); a cancelled row is in no
step after the next pass; prefixes are reused from a free cache row and copied from a busy one, with the same
tokens; echo's logprobs are the scoring forward's."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from microgpt.config import ModelConfig
from microgpt.engine import params
from microgpt.engine.backend import numpy_backend
from microgpt.engine.infer import make_infer_state
from microgpt.use import scheduler
from microgpt.use.sample import Generator, Sampling, generate
from microgpt.use.scheduler import Scheduler
from microgpt.use.wire import Channel, RowSpec
from tests.ops._util import check

M = ModelConfig(vocab_size=96, d_model=32, n_layer=2, n_head=4, seq_len=40)
EOT = 95  # a stop token no row here draws before its max_tokens, mostly


def weights() -> np.ndarray:
    w = params.init_weights(M, 0)
    return w + np.random.default_rng(0).standard_normal(w.shape).astype(np.float32) * 0.3


class Harness:
    """A Scheduler of max_batch rows and the HTTP side's end of its socket pair."""

    def __init__(self, max_batch: int) -> None:
        a, b = socket.socketpair()
        self.front = Channel(b)
        S = make_infer_state(M, numpy_backend(), max_batch + 1, weights())  # and the padding row
        self.sched = Scheduler(Generator(S), Channel(a))
        self.sched.started = True
        self.tokens: dict[tuple[int, int], list[int]] = {}
        self.finish: dict[tuple[int, int], int] = {}
        self.echo: dict[tuple[int, int], list] = {}
        self.launched: list[list[tuple[int, int]]] = []  # each pass's decode step: its rows' (rid, index)

    def submit(
        self,
        rid: int,
        prompt: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        logprobs: int = -1,
        echo: bool = False,
    ) -> None:
        spec = RowSpec(
            0, np.asarray(prompt, np.int32).tobytes(), max_tokens, temperature, 0, 1.0, seed, (EOT,), logprobs, echo
        )
        self.front.send("submit", rid, [spec])

    def one_pass(self) -> None:
        self.sched.chan.wait(0.01)
        for msg in self.sched.chan.receive():
            self.sched.command(msg)
        self.sched.step()
        step = self.sched.pending
        self.launched.append([(r.rid, r.spec.index) for r in step.rows if r is not None] if step else [])
        self.sched.send()
        self.front.wait(0.01)
        for msg in self.front.receive():
            if msg[0] == "tokens":
                arrays = [np.frombuffer(a, np.int32).tolist() for a in msg[1:5]]
                for rid, index, token, code in zip(*arrays):
                    if token >= 0:
                        self.tokens.setdefault((rid, index), []).append(token)
                    if code:
                        self.finish[rid, index] = code
            elif msg[0] == "echo":
                self.echo[msg[1], msg[2]] = msg[3]

    def until_done(self, rids: list[int], passes: int = 500) -> None:
        for _ in range(passes):
            if all((rid, 0) in self.finish for rid in rids) and self.sched.pending is None:
                return
            self.one_pass()
        raise AssertionError(f"rows not finished after {passes} passes: {self.finish}")


def alone(prompt: list[int], n: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
    """The tokens `microgpt sample` draws for prompt: generate() on a plan of one row, cut at the stop token."""
    gen = Generator(make_infer_state(M, numpy_backend(), 1, weights()))
    out = generate(gen, prompt, n, Sampling(temperature), [seed])[0]
    return out[: out.index(EOT) + 1] if EOT in out else out


PROMPTS = [[5], [7, 8, 9], list(range(10, 30)), [40, 41], list(range(3, 15)), [60] * 9, [2, 4, 6, 8, 10]]


@pytest.mark.parametrize("max_batch", [1, 3, 8])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("short", [0, 5, 64])
def test_rows_decode_as_each_alone(
    max_batch: int, temperature: float, short: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seven prompts (1 to 20 tokens) at once: with fewer cache rows than prompts they wait, join as rows end, are
    prefilled in windows of several rows, chunked at 4 tokens a row (so the 20-token prompt takes five passes), or
    fed through the decode step's spare rows where SHORT or fewer tokens are left and the spare rows hold them (at
    64 those that fit, the rest in windows; none at 0), and each row's tokens are its own prompt's alone; greedy rows
    carried one step behind, sampling ones not."""
    monkeypatch.setattr(scheduler, "CHUNK", 4)
    monkeypatch.setattr(scheduler, "PREFILL_TOKENS", 12)
    monkeypatch.setattr(scheduler, "SHORT", short)
    h = Harness(max_batch)
    for rid, prompt in enumerate(PROMPTS):
        h.submit(rid, prompt, 6 + rid, temperature, seed=rid)
    h.until_done(list(range(len(PROMPTS))))
    for rid, prompt in enumerate(PROMPTS):
        assert h.tokens[rid, 0] == alone(prompt, 6 + rid, temperature, rid), rid
    widest = max(map(len, h.launched))  # rows drawing at once (prompt tokens take rows of a step too)
    assert widest == min(max_batch, len(PROMPTS)) if short == 0 else 1 <= widest <= max_batch
    windows = h.sched.counts["prefill_windows"]
    chunks = sum(-(-(len(p) - 1) // 4) for p in PROMPTS)
    if short == 0:
        assert windows == chunks if max_batch == 1 else windows < chunks  # batched
    elif short == 64:  # the decode step's spare rows take the prompts they hold, windows the rest
        assert windows < chunks or max_batch == 1
        assert h.sched.counts["prefill_tokens"] == sum(map(len, PROMPTS))  # every prompt token fed once
    assert not h.sched.rows and len(h.sched.cache.free) == max_batch


def test_short_prompts_past_the_decode_steps_spare_rows_are_prefilled_in_one_window() -> None:
    """Eight new prompts of 10 tokens at once and 8 rows: the decode step's 8 spare rows hold none of them whole, so
    all are prefilled in one window (one position group: all from position 0), every row draws its first token in
    the step of the pass after, and each row's tokens are its prompt's alone. (Fed a spare row at a time they took a
    decode step for every 8 prompt tokens: 10 steps before the last row drew.)"""
    h = Harness(8)
    prompts = [list(range(3 + k, 13 + k)) for k in range(8)]
    for rid, prompt in enumerate(prompts):
        h.submit(rid, prompt, 4)
    h.one_pass()  # the rows are admitted and prefilled in one window; the decode step feeds each last token
    assert h.sched.counts["prefill_windows"] == 1 and len(h.sched.batch) == 8
    h.one_pass()
    assert all(len(h.tokens.get((rid, 0), [])) == 1 for rid in range(8))  # each row's first token, read back
    h.until_done(list(range(8)))
    for rid, prompt in enumerate(prompts):
        assert h.tokens[rid, 0] == alone(prompt, 4), rid


def test_the_start_runs_a_prefill_window_of_each_kind_and_leaves_the_cache_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """warm_windows (run before the engine is ready where the backend compiles its kernels: not NumPy's, here called
    by hand) runs a window of every kind a compile may depend on (rows, tokens a row, first position: 1, 2, 16, 17,
    as far as the plan holds them; rows from position 0 in cache rows apart and in a run), counts none of them, and
    holds nothing a prompt could reuse; a prompt then decodes as alone."""
    from microgpt.engine.infer import InferState

    ran = []
    run = InferState.run

    def record(S, tokens, pos, targets=None, slots=None):
        ran.append((tokens.shape, tuple(np.atleast_1d(pos)), None if slots is None else tuple(slots)))
        run(S, tokens, pos, targets, slots)

    monkeypatch.setattr(InferState, "run", record)
    h = Harness(16)
    assert ran == []  # NumPy compiles nothing: no window at the start
    h.sched.warm_windows()
    start = list(ran)
    sizes = (1, 2, 16, 17)
    want = {
        ((b, t), (0,) * b, order)
        for t in sizes
        for b in sizes
        if b <= 16
        for order in (tuple(range(b))[::-1], tuple(range(b)))
    }
    want |= {((1, t), (p,), (0,)) for t in sizes for p in sizes if p + t <= M.seq_len}
    assert set(start) == want and len(start) == len(want)
    assert h.sched.counts["prefill_windows"] == 0 and not h.sched.cache.fed.any()
    prompt = list(range(3, 12))
    h.submit(0, prompt, 5)
    h.until_done([0])
    assert h.sched.counts["reused_tokens"] == 0 and h.tokens[0, 0] == alone(prompt, 5)


def test_one_short_prompt_joining_a_busy_batch_is_fed_through_its_spare_rows() -> None:
    """Seven rows decoding and one more prompt of 6 tokens: fewer short prompt tokens wait than a step has rows, so
    the decode step feeds it through its one spare row, a token a step, with no window pass (which would cost the
    seven rows' next step its time); its tokens are its prompt's alone."""
    h = Harness(8)
    for rid in range(7):
        h.submit(rid, [5 + rid], 30)
    for _ in range(3):
        h.one_pass()
    prompt = list(range(20, 26))
    h.submit(7, prompt, 4)
    h.until_done(list(range(8)))
    assert h.sched.counts["prefill_windows"] == 0
    assert h.tokens[7, 0] == alone(prompt, 4)


def test_a_row_at_the_context_end_stops_with_length() -> None:
    """A prompt of seq_len - 2 tokens draws 3 tokens at most (the last for position seq_len), then "length"."""
    h = Harness(2)
    prompt = list(range(1, M.seq_len - 1))
    h.submit(0, prompt, 100)
    h.until_done([0])
    assert h.tokens[0, 0] == alone(prompt, 3) and h.finish[0, 0] == 2


def test_a_cancelled_row_is_in_no_step_after_the_next_pass() -> None:
    h = Harness(4)
    for rid in range(3):
        h.submit(rid, [10 + rid, 11], 30)
    for _ in range(4):
        h.one_pass()
    assert sorted(h.launched[-1]) == [(0, 0), (1, 0), (2, 0)]
    h.front.send("cancel", 1, -1)
    h.one_pass()
    assert sorted(h.launched[-1]) == [(0, 0), (2, 0)] and (1, 0) not in h.finish
    assert len(h.sched.cache.free) == 2  # its cache row is free at once


def test_a_prefix_is_reused_from_a_free_row_and_copied_from_a_busy_one() -> None:
    """A second turn (the first's prompt, its reply, more) reuses the first's cache row; two rows sharing a long
    system prefix, the second while the first decodes: the second copies the prefix from the first's row. Every
    row's tokens are its prompt's alone."""
    h = Harness(3)
    first = list(range(20, 32))
    h.submit(0, first, 8)
    h.until_done([0])
    second = first + h.tokens[0, 0] + [50, 51, 52]
    h.submit(1, second, 8)
    h.until_done([1])
    assert h.sched.counts["reused_tokens"] >= len(first) + 7 and h.sched.counts["copied_tokens"] == 0
    system = list(range(60, 80))
    h.submit(2, system + [1, 2], 15)
    while (2, 0) not in h.tokens:  # its prompt all in its cache row: it decodes
        h.one_pass()
    h.submit(3, system + [3], 8)
    h.until_done([2, 3])
    assert h.sched.counts["copied_tokens"] >= len(system)
    for rid, prompt, n in ((0, first, 8), (1, second, 8), (2, system + [1, 2], 15), (3, system + [3], 8)):
        assert h.tokens[rid, 0] == alone(prompt, n), rid


def test_echo_logprobs_are_the_scoring_forwards() -> None:
    """echo with logprobs 2: each prompt token after the first gets -loss of the scoring forward (InferState.score,
    as `microgpt eval`) and its two likeliest alternatives; max_tokens 0 draws nothing and ends with "length"."""
    prompt = list(range(30, 41))
    h = Harness(2)
    h.submit(0, prompt, 0, logprobs=2, echo=True)
    h.until_done([0])
    assert (0, 0) not in h.tokens and h.finish[0, 0] == 2
    lps = h.echo[0, 0]
    S = make_infer_state(M, numpy_backend(), 1, weights(), cache=False)
    _, _, losses = S.score(np.array([prompt[:-1]], np.int32), np.array([prompt[1:]], np.int32))
    check("echo logprobs", np.array([lp for lp, _ in lps]), -losses[0].astype(np.float64), 1e-5)
    assert all(len(top) == 2 and max(top.values()) >= lp - 1e-6 for lp, top in lps)


def test_every_decode_size_is_prepared_before_any_request_and_padding_changes_no_row() -> None:
    """The decode step runs at a few sizes (1, 2, 4, every 8th, max_batch), each prepared when the scheduler is made
    (on a GPU its warm-up and graph capture, which a request would otherwise wait for the first time its batch size
    came); steps of other sizes are padded up to the next, in the padding row, and every row's tokens are still its
    prompt's alone."""
    h = Harness(20)
    assert sorted(h.sched.S.decoders) == h.sched.sizes == [1, 2, 4, 8, 16, 20]
    for rid, prompt in enumerate(PROMPTS * 2):
        h.submit(rid, prompt, 5 + rid % 4)
    h.until_done(list(range(2 * len(PROMPTS))))
    assert sorted(h.sched.S.decoders) == h.sched.sizes  # none prepared while rows waited
    assert h.sched.counts["padded_rows"] > 0
    for rid, prompt in enumerate(PROMPTS * 2):
        assert h.tokens[rid, 0] == alone(prompt, 5 + rid % 4), rid
    assert len(h.sched.cache.free) == 20 and h.sched.pad_slot not in h.sched.cache.free
