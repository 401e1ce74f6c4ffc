"""The decode step in three calls (InferState.stage_decode, carry, launch_decode: serve's pipelined steps) on the
triton backend: the staged steps with tokens carried on the device give the NumPy backend's greedy tokens, and
copy_rows and window_logits agree with it. In CI on the interpreter (copy_in_async and fetch are copies then); on the
GPU machine (MICROGPT_TEST_GPU=1) with the next step staged and launched while the one before runs, the host reading
each step's tokens only after the next is queued, as serve's scheduler does."""

from __future__ import annotations

import numpy as np

from microgpt.config import ModelConfig
from microgpt.engine import params
from microgpt.engine.backend import numpy_backend, triton_backend
from microgpt.engine.infer import InferState, make_infer_state

from ._kutil import check

M = ModelConfig(vocab_size=96, d_model=32, n_layer=2, n_head=4, seq_len=24)


def states() -> list[InferState]:
    w = params.init_weights(M, 0)
    w += np.random.default_rng(0).standard_normal(w.shape).astype(np.float32) * 0.05
    return [make_infer_state(M, K, 4, w) for K in (numpy_backend(), triton_backend("fp32"))]


def prefill(S: InferState, ids: np.ndarray, slots: list[int]) -> None:
    tokens, _ = S.inputs(*ids.shape)
    S.K.copy_in(tokens, ids)
    S.run(tokens, [0] * len(slots), slots=slots)


def test_pipelined_steps_match_numpy() -> None:
    ids = np.random.default_rng(1).integers(0, M.vocab_size, (3, 6)).astype(np.int32)
    got = []
    for S in states():
        prefill(S, ids[:, :5], [3, 0, 2])
        rows = np.concatenate([ids[:, 5], [5, 5, 5], [3, 0, 2]]).astype(np.int32)
        S.stage_decode(rows)
        wait, out = S.launch_decode(3), []
        for _ in range(8):
            rows[3:6] += 1
            S.stage_decode(rows)
            S.carry(0, 0, 3)
            nxt = S.launch_decode(3)
            out.append(wait().tolist())
            wait = nxt
        out.append(wait().tolist())
        got.append(out)
    assert got[1] == got[0]


def test_copy_rows_and_window_logits_match_numpy() -> None:
    ids = np.random.default_rng(2).integers(0, M.vocab_size, (2, 7)).astype(np.int32)
    got = []
    for S in states():
        prefill(S, ids, [1, 3])
        window = np.concatenate([S.K.to_numpy(S.window_logits(lo, lo + 2)).copy() for lo in range(0, 14, 2)])
        S.copy_rows(0, 3, 7)
        logits = S.K.to_numpy(S.decode(np.array([5, 5]), np.array([7, 7]), np.array([0, 3]))).copy()
        got.append((window, logits))
    check("window logits", got[1][0], got[0][0], 1e-4)
    check("decode after copy_rows", got[1][1], got[0][1], 1e-4)
    assert np.array_equal(got[1][1][0], got[1][1][1]), "a copied row decodes as its source, bit for bit"


def test_a_prompt_fed_in_one_step_matches_numpy() -> None:
    """Rows of one cache row at distinct positions in one step (serve's short prompts): the triton kernels' writes of
    a layer precede its attention, as the NumPy reference's."""
    ids = np.random.default_rng(3).integers(0, M.vocab_size, 4).astype(np.int32)
    got = [S.K.to_numpy(S.decode(ids, np.arange(4), np.full(4, 1))).copy() for S in states()]
    check("a prompt in one step", got[1], got[0], 1e-4)


def test_a_window_of_rows_in_cache_rows_apart_matches_numpy() -> None:
    """serve's prefill window on the modern block with its window and document masks: two rows from position 0 in
    cache rows apart (one position group, decode_kv_write putting their keys, values and tokens), a row further on in
    its own cache row; the next-token logits and the decode step after them agree with the NumPy reference's."""
    import dataclasses

    m = dataclasses.replace(M, block="modern", n_head=2, softcap=5.0, attn_window=6, doc_mask=7)
    w = params.init_weights(m, 4) + np.random.default_rng(4).standard_normal(params.n_params(m)).astype(np.float32)
    ids = np.random.default_rng(5).integers(0, m.vocab_size, (3, 9)).astype(np.int32)
    ids[0, 2] = 7
    got = []
    for K in (numpy_backend(), triton_backend("fp32")):
        S = make_infer_state(m, K, 4, w * 0.5)
        prefill(S, ids[2:3, :3], [1])
        tokens, _ = S.inputs(3, 5)
        S.K.copy_in(tokens, np.stack([ids[0, :5], ids[1, :5], ids[2, 3:8]]))
        S.run(tokens, [0, 0, 3], slots=[3, 0, 1])
        window = S.K.to_numpy(S.arena["next_logits"][:3]).copy()
        step = S.K.to_numpy(S.decode(np.array([ids[0, 5], ids[1, 5], ids[2, 8]]), [5, 5, 8], [3, 0, 1])).copy()
        got.append((window, step))
    check("window logits", got[1][0], got[0][0], 1e-4)
    check("the decode step after", got[1][1], got[0][1], 1e-4)
