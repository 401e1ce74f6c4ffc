"""The decode step's ops (ops/decode.py) against torch: rows at ragged positions of permuted cache rows, the cache
past each row's position (and the rows no step uses) full of noise that must not be read."""

import math

import numpy as np
import pytest
import torch

from microgpt.ops.decode import (
    decode_attention,
    decode_doc_starts,
    decode_embedding,
    decode_kv_write,
    decode_qkrope,
)
from microgpt.ops.qkrope import qkrope_forward, rope_tables

from ._util import F32_TOL, F64_TOL, check

# (B, T, C, NH, positions, slots): one row at position 0; ragged rows, one at the cache's last position; hs = 1
CASES = [(1, 5, 8, 2, [0], [0]), (4, 9, 12, 3, [3, 8, 0], [2, 0, 3]), (3, 6, 5, 5, [5, 1], [1, 2])]


def torch_attention(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, positions, slots, n_head: int, first=None
) -> np.ndarray:
    """Each row's query over its cache row's positions 0 .. positions[i] (keys before first[i] masked, where given),
    by torch's softmax, float64."""
    C = q.shape[1]
    hs = C // n_head
    rows = []
    for i, (pos, slot) in enumerate(zip(positions, slots)):
        kh = torch.from_numpy(k_cache[slot, : pos + 1]).view(pos + 1, n_head, hs).transpose(0, 1)  # (NH, n, hs)
        vh = torch.from_numpy(v_cache[slot, : pos + 1]).view(pos + 1, n_head, hs).transpose(0, 1)
        qh = torch.from_numpy(q[i]).view(n_head, 1, hs)
        scores = qh @ kh.transpose(1, 2) / math.sqrt(hs)
        if first is not None:
            scores[..., : first[i]] = float("-inf")
        att = torch.softmax(scores, dim=-1)  # (NH, 1, n)
        rows.append((att @ vh).reshape(C))
    return torch.stack(rows).numpy()


@pytest.mark.parametrize("B,T,C,NH,positions,slots", CASES)
@pytest.mark.parametrize("dtype, tol", [(np.float64, F64_TOL), (np.float32, F32_TOL)])
def test_decode_attention_reads_each_rows_own_positions(B, T, C, NH, positions, slots, dtype, tol) -> None:
    rng = np.random.default_rng(sum(positions) * 7 + B)
    b = len(positions)
    q = rng.standard_normal((b, C))
    kc, vc = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    ref = torch_attention(q, kc, vc, positions, slots, NH)
    for i, (pos, slot) in enumerate(zip(positions, slots)):  # noise past each row's position: never read
        kc[slot, pos + 1 :], vc[slot, pos + 1 :] = 1e3, -1e3
    out = np.full((b, C), np.nan, dtype)
    pos, sl = np.array(positions, np.int32), np.array(slots, np.int32)
    decode_attention(out, q.astype(dtype), kc.astype(dtype), vc.astype(dtype), pos, sl, NH)
    check("out", out, ref, tol)


@pytest.mark.parametrize("B,T,C,NH,positions,slots", CASES)
def test_decode_kv_write_and_embedding(B, T, C, NH, positions, slots) -> None:
    """Each row's key and value land at (its slot, its position) and nowhere else; its embedding is its token's row
    plus its own position's."""
    rng = np.random.default_rng(len(positions) + T)
    b, V = len(positions), 11
    kc, vc = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    k, v = rng.standard_normal((b, C)), rng.standard_normal((b, C))
    pos, sl = np.array(positions, np.int32), np.array(slots, np.int32)
    want_k, want_v = kc.copy(), vc.copy()
    for i in range(b):
        want_k[slots[i], positions[i]], want_v[slots[i], positions[i]] = k[i], v[i]
    decode_kv_write(kc, vc, k, v, pos, sl)
    np.testing.assert_array_equal(kc, want_k)
    np.testing.assert_array_equal(vc, want_v)
    wte, wpe = rng.standard_normal((V, C)), rng.standard_normal((T, C))
    tokens = rng.integers(0, V, b).astype(np.int32)
    out = np.full((b, C), np.nan)
    decode_embedding(out, tokens, pos, wte, wpe)
    rows = torch.from_numpy(wte)[torch.from_numpy(tokens).long()]
    check("embedding", out, (rows + torch.from_numpy(wpe)[pos.tolist()]).numpy(), F64_TOL)
    out = np.full((b, C), np.nan)
    decode_embedding(out, tokens, pos, wte)  # no position table (the modern block's): the token's row alone
    np.testing.assert_array_equal(out, rows.numpy())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("H,D", [(1, 2), (3, 8), (2, 128)])
def test_decode_qkrope_is_the_forward_at_each_rows_position(H: int, D: int, dtype) -> None:
    """Rows of the decode step's (3, b, C) projection at ragged positions: each row's q and k are qkrope_forward's of
    a one-row window at that position, bit for bit (the forward itself is checked against torch in
    tests/ops/test_qkrope.py); v is untouched."""
    rng = np.random.default_rng(H * D)
    positions = np.array([5, 0, 12, 5], np.int32)
    b, C = len(positions), H * D
    rope = rope_tables(16, D)
    qkv = (rng.standard_normal((3, b, C)) * 1.3 - 0.2).astype(dtype)
    want = qkv.copy()
    rstd = np.empty((2, 1, H), dtype)
    for i, p in enumerate(positions):
        qkrope_forward(want[0, i : i + 1, None], want[1, i : i + 1, None], rstd, rope, n_head=H, pos=int(p))
    decode_qkrope(qkv[0], qkv[1], positions, rope, n_head=H)
    np.testing.assert_array_equal(qkv, want)


@pytest.mark.parametrize("window", [None, 1, 3, 50])
@pytest.mark.parametrize("docs", [False, True])
def test_decode_attention_window_and_documents(window, docs) -> None:
    """Rows see their cache row's keys from max(position - window + 1, their document start) to their position, against
    torch's masked softmax."""
    rng = np.random.default_rng((window or 0) + docs)
    B, T, C, NH = 4, 12, 8, 2
    positions, slots = [11, 4, 0, 7], [2, 0, 3, 1]
    q = rng.standard_normal((4, C))
    kc, vc = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    doc = np.array([6, 2, 0, 7], np.int32) if docs else None  # each <= its row's position
    first = [
        max(p - (window or T) + 1, 0 if doc is None else int(d)) for p, d in zip(positions, doc if docs else positions)
    ]
    want = torch_attention(q, kc, vc, positions, slots, NH, first)
    out = np.full((4, C), np.nan)
    w = None if window is None else np.array([window], np.int32)
    decode_attention(
        out, q, kc, vc, np.array(positions, np.int32), np.array(slots, np.int32), NH, window=w, doc_start=doc
    )
    check("out", out, want, F64_TOL)


def test_decode_doc_starts_reads_what_the_steps_rows_wrote() -> None:
    """Every row's token lands at (its slot, its position) before any row looks for its document's start, so rows of
    one cache row in one step see each other's <|endoftext|> (eot 0); past a row's position the cache is not read."""
    tc = np.array([[5, 0, 5, 5, 0, 9], [5, 5, 5, 5, 5, 5], [0, 0, 0, 0, 0, 0]], np.int32)
    tokens, positions, slots = (np.array(a, np.int32) for a in ([7, 0, 3, 4], [3, 2, 1, 4], [0, 1, 1, 2]))
    doc = np.full(4, -1, np.int32)
    decode_doc_starts(doc, tc, tokens, positions, slots, 0)
    assert tc.tolist() == [[5, 0, 5, 7, 0, 9], [5, 3, 0, 5, 5, 5], [0, 0, 0, 0, 4, 0]]
    assert doc.tolist() == [1, 2, 0, 3]  # row 3 at position 4 of cache row 2: its own token is no longer eot
