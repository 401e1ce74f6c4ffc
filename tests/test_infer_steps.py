"""The inference state's calls for serving (engine/infer.py): the decode step in three calls (stage, carry, launch)
gives decode()'s tokens, a KV-cache row copied to another decodes as the original, and window_logits are the
logits whose log-softmax at the targets is the per-token loss of the scoring forward. NumPy backend."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from microgpt.engine import params
from microgpt.engine.backend import numpy_backend
from microgpt.engine.infer import InferState, make_infer_state
from tests.ops._util import check
from tests.test_decode import M, noisy_cache, prefill, weights


def state(B: int = 4) -> InferState:
    S = make_infer_state(M, numpy_backend(), B, weights(3))
    noisy_cache(S, 5)
    return S


def test_staged_steps_with_carried_tokens_are_decodes_steps() -> None:
    """Three rows at different positions and cache rows, greedy for 6 steps: each step staged with its tokens carried
    from the step before (the host never reads them in between) gives the tokens of decode() step by step; the
    carried rows may move (row 2 of a step is row 0 of the next)."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, M.vocab_size, (3, 5)).astype(np.int32)
    want, got = [], []
    for way in ("decode", "staged"):
        S = state()
        prefill(S, ids[:, :4])  # rows 0 .. 2 at position 4 next
        slots, pos, tok = np.array([0, 1, 2]), np.array([4, 4, 4]), ids[:, 4]
        order = np.array([2, 0, 1])  # the staged way feeds the rows in this order, then keeps it
        out = want if way == "decode" else got
        if way == "decode":
            for _ in range(6):
                S.decode(tok, pos, slots)
                tok, pos = np.array(S.greedy(3)), pos + 1
                out.append(tok.tolist())
        else:
            rows = np.concatenate([tok[order], pos[order], slots[order]]).astype(np.int32)
            S.stage_decode(rows)
            wait = S.launch_decode(3)
            for _ in range(6):
                rows[3:6] += 1
                S.stage_decode(rows)
                S.carry(0, 0, 3)  # launched before the host has the tokens of the step before
                nxt = S.launch_decode(3)
                out.append(wait()[np.argsort(order)].tolist())
                wait = nxt
    assert got == want


def test_a_copied_cache_row_decodes_as_its_source() -> None:
    S = state()
    ids = np.random.default_rng(2).integers(0, M.vocab_size, (1, 9)).astype(np.int32)
    prefill(S, ids[:, :8])  # row 0
    S.copy_rows(3, 0, 8)
    logits = S.decode(np.array([ids[0, 8]] * 2), np.array([8, 8]), np.array([0, 3]))
    check("row 3 (copied) against row 0", logits[1], logits[0], 1e-6)


@pytest.mark.parametrize("block", ["gpt2", "modern", "modern-skips"])
@pytest.mark.parametrize("b, t", [(1, 7), (3, 5)])
def test_window_logits_are_the_scoring_forwards_logits(b: int, t: int, block: str) -> None:
    """After a window with targets, -log_softmax(window_logits)[target] is the per-token loss the step wrote: the
    same head (the modern block's untied one) and the same soft-cap; with skips (model.skips) too, whose kept
    streams the inference plan holds (tests/test_modern.py checks these losses against the training forward's)."""
    if block == "gpt2":
        S = state()
    else:
        skips = 1 if block == "modern-skips" else 0  # n_layer 2: layer 1 adds its own input times skip_w[0]
        m = dataclasses.replace(M, block="modern", n_head=2, softcap=5.0, skips=skips)
        w = params.init_weights(m, 3) + np.random.default_rng(3).standard_normal(params.n_params(m)).astype(np.float32)
        S = make_infer_state(m, numpy_backend(), 4, w * 0.5)
    rng = np.random.default_rng(b)
    x = rng.integers(0, M.vocab_size, (b, t)).astype(np.int32)
    y = rng.integers(0, M.vocab_size, (b, t)).astype(np.int32)
    tokens, targets = S.inputs(b, t)
    S.K.copy_in(tokens, x)
    S.K.copy_in(targets, y)
    S.run(tokens, [0] * b, targets, slots=list(range(b)))
    losses = S.K.to_numpy(S.arena["losses"][: b * t]).copy()
    z = np.concatenate([S.window_logits(lo, min(lo + S.B, b * t)).astype(np.float64) for lo in range(0, b * t, S.B)])
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    check("losses", lse - z[np.arange(b * t), y.reshape(-1)], losses, 1e-5)


def test_a_prompt_fed_in_one_step_is_the_prompt_fed_a_token_a_step() -> None:
    """Rows of one cache row at distinct positions in one decode step (serve feeds a short prompt so): every row's
    write precedes every row's attention, so each row's logits are those of feeding the tokens one step each; a
    second row of another cache row decodes beside them."""
    ids = np.random.default_rng(4).integers(0, M.vocab_size, 7).astype(np.int32)
    one = state(8)
    want = [one.K.to_numpy(one.decode([t], [p], [2]))[0].copy() for p, t in enumerate(ids)]
    S = state(8)
    prefill(S, ids[None, :2])  # row 0 holds positions 0, 1
    got = S.K.to_numpy(S.decode(np.concatenate([[ids[2]], ids]), [2, *range(7)], [0] + [2] * 7)).copy()
    check("a prompt in one step", got[1:], np.array(want), 1e-5)
    check("the other row beside it", got[0], want[2], 1e-5)


# the modern block with a window and document masking (issue 55): <|endoftext|> is id 0
MW = dataclasses.replace(M, block="modern", n_head=2, softcap=5.0, attn_window=5, doc_mask=0)


def window_weights() -> np.ndarray:
    w = params.init_weights(MW, 3) + np.random.default_rng(3).standard_normal(params.n_params(MW)).astype(np.float32)
    return w * 0.5


def window_state(B: int) -> InferState:
    S = make_infer_state(MW, numpy_backend(), B, window_weights())
    noisy_cache(S, 5)
    S.K.copy_in(S.arena["kv_tokens"], np.zeros(S.arena["kv_tokens"].shape, np.int32))  # every stale token eot
    return S


def test_with_documents_a_copied_row_and_a_prompt_in_one_step_decode_as_their_sources() -> None:
    """With model.doc_mask the cache holds each position's token: a copied row copies them (its next token sees the
    source's document start), and rows of one cache row fed in one decode step find the <|endoftext|> another of
    them wrote (every row's token precedes every row's document start, as its key precedes every attention)."""
    ids = np.array([5, 9, 0, 7, 3, 8, 0, 4, 6], np.int32)
    S = window_state(4)
    prefill(S, ids[None, :8])  # row 0
    S.copy_rows(3, 0, 8)
    logits = S.decode(np.array([ids[8]] * 2), np.array([8, 8]), np.array([0, 3]))
    check("row 3 (copied) against row 0", logits[1], logits[0], 1e-6)

    one = window_state(9)
    want = [one.K.to_numpy(one.decode([t], [p], [2]))[0].copy() for p, t in enumerate(ids)]
    again = window_state(9)
    got = again.K.to_numpy(again.decode(ids, list(range(9)), [2] * 9)).copy()
    check("a prompt in one step", got, np.array(want), 1e-5)
    # the document that starts at 6 decoded alone from position 0: positions 6 .. 8 see it alone, and rotary
    # attention depends on the distance between positions only, so they score as its positions 0 .. 2
    alone = window_state(9)
    tail = [alone.K.to_numpy(alone.decode([t], [p], [1]))[0].copy() for p, t in enumerate(ids[6:])]
    check("a document alone", np.array(want[6:]), np.array(tail), 1e-5)
    across = make_infer_state(dataclasses.replace(MW, doc_mask=-1), numpy_backend(), 1, window_weights())
    seen = [across.K.to_numpy(across.decode([t], [p], [0]))[0].copy() for p, t in enumerate(ids)]
    assert not np.allclose(seen[6:], tail, atol=1e-3)  # without the mask they see the document before too


def test_windows_groups_the_rows_from_position_0_whatever_their_cache_rows() -> None:
    """Rows next to each other at position 0 are one position group, their cache rows a slice where they follow
    each other and a tuple where not; a row at another position is a group of its own."""
    from microgpt.engine.model import windows

    assert windows(3, 4) == [(slice(0, 3), 4, slice(0, 3))]
    assert windows(5, [0, 0, 3, 0, 0], [5, 2, 1, 6, 7]) == [
        (slice(0, 2), 0, (5, 2)),
        (slice(2, 3), 3, slice(1, 2)),
        (slice(3, 5), 0, slice(6, 8)),
    ]
    with pytest.raises(ValueError, match="3 rows need 3 positions"):
        windows(3, [0, 0], [0, 1, 2])


@pytest.mark.parametrize("block", ["gpt2", "modern"])
def test_a_window_of_rows_in_cache_rows_apart_is_each_row_alone(block: str) -> None:
    """serve's prefill window: rows from position 0 in cache rows apart (one position group, their keys and values
    put by decode_kv_write), beside a row further on in its own cache row; each row's next-token logits and the cache
    rows it wrote are those of the row prefilled alone, and the decode step after them reads them so too. The modern
    block with its window and document masks (an <|endoftext|> inside a prompt)."""
    if block == "gpt2":
        m, w = M, weights(5)
    else:
        m = dataclasses.replace(M, block="modern", n_head=2, softcap=5.0, attn_window=6, doc_mask=7)
        w = params.init_weights(m, 5) + np.random.default_rng(5).standard_normal(params.n_params(m)).astype(np.float32)
        w *= 0.5
    rng = np.random.default_rng(6)
    t = 5
    ids = rng.integers(0, m.vocab_size, (4, t + 4)).astype(np.int32)
    ids[1, 2] = 7  # a document starts inside row 1's prompt
    slots, pos = [5, 2, 1, 6], [0, 0, 3, 0]

    def fresh() -> InferState:
        S = make_infer_state(m, numpy_backend(), 8, w)
        noisy_cache(S, 7)
        tokens, _ = S.inputs(1, 3)
        S.K.copy_in(tokens, ids[2:3, :3])
        S.run(tokens, [0], slots=[1])  # row 2's cache row holds its first 3 tokens
        return S

    def window(S: InferState, rows: list[int]) -> np.ndarray:
        x = np.stack([ids[r, pos[r] : pos[r] + t] for r in rows])
        tokens, _ = S.inputs(len(rows), t)
        S.K.copy_in(tokens, x)
        S.run(tokens, [pos[r] for r in rows], slots=[slots[r] for r in rows])
        return S.K.to_numpy(S.arena["next_logits"][: len(rows)]).copy()

    together = fresh()
    got = window(together, [0, 1, 2, 3])
    for r in range(4):
        alone = fresh()
        want = window(alone, [r])[0]
        check(f"row {r}'s logits", got[r], want, 1e-6)
        s, n = slots[r], pos[r] + t
        check(f"row {r}'s cache", together.arena["kv"][:, :, s, :n], alone.arena["kv"][:, :, s, :n], 1e-6)
        if m.doc_mask >= 0:
            assert (together.arena["kv_tokens"][s, :n] == ids[r, :n]).all()
    nxt = ids[np.arange(4), np.array(pos) + t]
    step = together.K.to_numpy(together.decode(nxt, np.array(pos) + t, np.array(slots))).copy()
    for r in range(4):
        alone = fresh()
        window(alone, [r])
        one = alone.K.to_numpy(alone.decode(nxt[r : r + 1], [pos[r] + t], [slots[r]]))[0]
        check(f"row {r}'s decode step after", step[r], one, 1e-6)


def test_a_plan_without_a_cache_scores_rows_named_by_any_cache_rows() -> None:
    """A scoring plan (no KV cache) given rows from position 0 in cache rows apart has nowhere to put their keys and
    values: it scores the window, the losses those of the rows in order."""
    x = np.random.default_rng(8).integers(0, M.vocab_size, (3, 6)).astype(np.int32)
    got = []
    for slots in ([0, 1, 2], [2, 0, 1]):
        S = make_infer_state(M, numpy_backend(), 4, weights(3), cache=False)
        tokens, targets = S.inputs(3, 6)
        S.K.copy_in(tokens, x)
        S.K.copy_in(targets, np.roll(x, -1, 1))
        S.run(tokens, [0, 0, 0], targets, slots=slots)
        got.append(S.K.to_numpy(S.arena["losses"][:18]).copy())
    np.testing.assert_array_equal(got[1], got[0])
