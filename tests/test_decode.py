"""The decode step (model.gpt_decode, InferState.decode) on the NumPy backend: at equal positions it is gpt_infer's
decode of one token, and rows at different positions of different cache rows each give their own sequence's
logits, as a prefill of that sequence alone does; bad rows are refused before anything runs."""

from __future__ import annotations

import numpy as np
import pytest

from microgpt.config import ModelConfig
from microgpt.engine import model, params
from microgpt.engine.backend import numpy_backend
from microgpt.engine.infer import InferState, make_infer_state
from tests.ops._util import check

M = ModelConfig(vocab_size=96, d_model=32, n_layer=2, n_head=4, seq_len=24)


def weights(seed: int = 0) -> np.ndarray:
    """The init moved off it (LayerNorms off 1/0, larger logits), as a trained model's."""
    w = params.init_weights(M, seed)
    return w + np.random.default_rng(seed).standard_normal(w.shape).astype(np.float32) * 0.05


def prefill(S: InferState, ids: np.ndarray) -> np.ndarray:
    """gpt_infer from position 0 over ids (b, t) into cache rows 0 .. b-1; the next-token logits (b, V)."""
    tokens, _ = S.inputs(*ids.shape)
    S.K.copy_in(tokens, ids)
    S.run(tokens, 0)
    return S.K.to_numpy(S.arena["next_logits"][: ids.shape[0]]).copy()


def noisy_cache(S: InferState, seed: int) -> None:
    """Noise in the whole cache: a step must read only what it and the steps before it wrote."""
    kv = S.arena["kv"]
    S.K.copy_in(kv, np.random.default_rng(seed).standard_normal(kv.shape).astype(np.float32) * 30)


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_at_equal_positions_it_is_gpt_infers_decode(precision: str) -> None:
    """b rows after a prefill of p tokens each: gpt_decode (positions all p, slots 0 .. b-1) gives gpt_infer's
    logits of a one-token window at p, to 1e-5, and writes the same keys and values into the cache."""
    b, p = 3, 7
    w = weights(1)
    rng = np.random.default_rng(2)
    ids = rng.integers(0, M.vocab_size, (b, p + 1)).astype(np.int32)
    got = {}
    for way in ("infer", "decode"):
        S = make_infer_state(M, numpy_backend(precision_name=precision), 4, w)
        prefill(S, ids[:, :p])
        if way == "infer":
            window, _ = S.inputs(b, 1)
            S.K.copy_in(window, ids[:, p:])
            S.run(window, p)
            logits = S.arena["next_logits"][:b]
        else:
            logits = S.decode(ids[:, p], np.full(b, p), np.arange(b))
        got[way] = (logits.copy(), S.arena["kv"][:, :, :b, : p + 1].copy())
    check("logits", got["decode"][0], got["infer"][0], 1e-5)
    check("kv cache", got["decode"][1], got["infer"][1], 1e-6)


def test_rows_at_different_positions_each_give_their_own_sequence() -> None:
    """Three sequences of different lengths, fed one token a step through the decode step into cache rows 2, 0 and
    3 of a four-row plan full of noise, each row joining when the step reaches its own start and at its own
    position: every step's logits of every row equal a prefill of that sequence alone (a fresh one-row state), and
    greedy continuations from the same last step are those of the single rows."""
    w = weights(3)
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, M.vocab_size, n).tolist() for n in (9, 4, 14)]
    slots = [2, 0, 3]
    S = make_infer_state(M, numpy_backend(), 4, w)
    noisy_cache(S, 5)
    starts = [0, 5, 2]  # the step at which each row first feeds a token
    fed = [0, 0, 0]
    for step in range(max(s + len(q) for s, q in zip(starts, seqs))):
        rows = [i for i in range(3) if starts[i] <= step < starts[i] + len(seqs[i])]
        logits = S.decode([seqs[i][fed[i]] for i in rows], [fed[i] for i in rows], [slots[i] for i in rows])
        for r, i in enumerate(rows):
            fed[i] += 1
            alone = prefill(make_infer_state(M, numpy_backend(), 1, w), np.array([seqs[i][: fed[i]]], np.int32))
            check(f"step {step} row {i}", logits[r], alone[0], 1e-5)


def test_greedy_decoding_in_a_batch_is_each_sequences_own() -> None:
    """Two prompts of different lengths decoded greedily together (one step per token, ragged positions) give the
    tokens each one's own greedy decoding gives."""
    w = weights(6)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, M.vocab_size, n).tolist() for n in (3, 8)]

    def greedy(rows: list[list[int]], slots: list[int], n: int) -> list[list[int]]:
        S = make_infer_state(M, numpy_backend(), 2, w)
        seqs = [list(p) for p in rows]
        for i, p in enumerate(rows):  # the prompts one token a step, each into its own cache row
            for t, tok in enumerate(p[:-1]):
                S.decode([tok], [t], [slots[i]])
        for _ in range(n):
            logits = S.decode([s[-1] for s in seqs], [len(s) - 1 for s in seqs], slots)
            for s, z in zip(seqs, logits):
                s.append(int(np.argmax(z)))
        return [s[len(p) :] for s, p in zip(seqs, rows)]

    together = greedy(prompts, [1, 0], 8)
    assert together == [greedy([p], [0], 8)[0] for p in prompts]


@pytest.mark.parametrize(
    "tokens, positions, slots, match",
    [
        ([1, 2], [1, 1], [0, 0], "write one position of one cache row"),
        ([1], [M.seq_len], [0], r"positions must be integers in \[0, 24\)"),
        ([1], [0], [2], r"slots must be integers in \[0, 2\)"),
        ([96], [0], [0], r"tokens must be integers in \[0, 96\)"),
        ([1, 2, 3], [0, 0, 0], [0, 1, 0], "1 to 2 rows"),
        ([1, 2], [0], [0, 1], "one entry a row"),
        ([], [], [], "1 to 2 rows"),
    ],
)
def test_bad_rows_are_refused_before_anything_runs(tokens, positions, slots, match) -> None:
    S = make_infer_state(M, numpy_backend(), 2, weights())
    before = S.arena.pool.copy()
    with pytest.raises(ValueError, match=match):
        S.decode(np.array(tokens, np.int64), np.array(positions, np.int64), np.array(slots, np.int64))
    np.testing.assert_array_equal(S.arena.pool, before)
    assert S.decoders == {}


def test_a_plan_without_a_cache_has_no_decode_step() -> None:
    S = make_infer_state(M, numpy_backend(), 2, weights(), cache=False)
    assert "decode_rows" not in S.arena and "next_ids" not in S.arena
    with pytest.raises(ValueError, match="no KV cache"):
        S.decode([1], [0], [0])


def test_gpt_decode_is_the_step_the_state_runs() -> None:
    """InferState.decode is model.gpt_decode on its planned inputs (the same bits)."""
    w = weights(8)
    S = make_infer_state(M, numpy_backend(), 3, w)
    noisy_cache(S, 9)
    kv = S.arena["kv"].copy()
    got = S.decode([5, 6], [3, 0], [2, 1]).copy()
    S.arena["kv"][...] = kv
    tokens, positions, slots = S.decode_inputs(2)
    model.gpt_decode(S.K, M, S.P_compute, S.arena, tokens, positions, slots)
    np.testing.assert_array_equal(S.arena["next_logits"][:2], got)
