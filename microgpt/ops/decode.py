"""The decode step's position-dependent ops (model.gpt_decode), forward only, NumPy reference.

A decode step runs b rows, one new token each: row i sits at position positions[i] of KV-cache row slots[i]
(positions, slots (b,) int32). On the GPU both live in device memory, so that one captured CUDA graph serves every
step of a batch size whatever the rows' positions (microgpt/engine/infer.py InferState.decode). Shapes: tokens (b,), the
caches (B, T, C) (one layer's keys or values: memory.inference_plan's kv[l, 0] and kv[l, 1]), q, k, v, out (b, C)
with the heads interleaved as (b, NH, hs).

    decode_embedding   out[i] = wte[tokens[i]] + wpe[positions[i]]        (wpe None: wte[tokens[i]])
    decode_kv_write    k_cache[slots[i], positions[i]] = k[i] ; v_cache[slots[i], positions[i]] = v[i]
    decode_attention   per head: out[i] = softmax(q[i] . K_i^T / sqrt(hs)) V_i, with K_i, V_i the keys and values
                       of positions 0 .. positions[i] of cache row slots[i] (the one just written included)
    decode_qkrope      q[i], k[i] = rope(rmsnorm_head(.)) at positions[i], in place (the modern block's, before
                       the cache write; ops/qkrope.py)
    decode_doc_starts  tok_cache[slots[i], positions[i]] = tokens[i], then doc[i] = the last position p <=
                       positions[i] of cache row slots[i] whose token is eot (0 where none): where row i's document
                       starts (model.doc_mask; ops/attention.py doc_starts over the cache row's tokens)

decode_attention takes attention's narrower mask as its keywords (ops/attention.py): window (1,) int32, and
doc_start (b,) int32, each row's document start (decode_doc_starts): row i sees the keys of positions j with
max(positions[i] - window + 1, doc_start[i]) <= j <= positions[i].

Nothing is saved (there is no backward), and nothing past positions[i] is read: the cache there holds noise or a
sequence that held the slot before. No two rows of one step write one position of one cache row, which
InferState.decode checks on the host; rows of one cache row at different positions (a prompt's tokens fed in one step,
serve's scheduler) each read the keys and values the others wrote, since every row's write precedes every row's
attention. For one row at position pos these are gpt_infer's embedding at pos, its copy
into the cache and attention_forward_cached for t = 1 (tests/test_decode.py compares the steps).
On the GPU (kernels/decode.py) the attention is split over the keys (flash-decoding) and the splits combined in a
fixed order; here one pass per row computes the same function.
"""

import math

import numpy as np
from numpy.typing import NDArray

from microgpt.ops import qkrope


def decode_embedding(
    out: NDArray, tokens: NDArray, positions: NDArray, wte: NDArray, wpe: NDArray | None = None
) -> None:
    """out (b,C) = wte[tokens] + wpe[positions] (wpe None: wte[tokens], the modern block's)."""
    np.take(wte, tokens, axis=0, out=out)
    if wpe is not None:
        out += wpe[positions]


def decode_kv_write(
    k_cache: NDArray, v_cache: NDArray, k: NDArray, v: NDArray, positions: NDArray, slots: NDArray
) -> None:
    """k_cache, v_cache (B,T,C)[slots[i], positions[i]] = k[i], v[i] (b,C)."""
    k_cache[slots, positions] = k
    v_cache[slots, positions] = v


def decode_attention(
    out: NDArray,
    q: NDArray,
    k_cache: NDArray,
    v_cache: NDArray,
    positions: NDArray,
    slots: NDArray,
    n_head: int,
    *,
    window: NDArray | None = None,
    doc_start: NDArray | None = None,
) -> None:
    """out (b,C) = attention of each row's query q[i] (C,) over positions 0 .. positions[i] of cache row slots[i]
    (from max(positions[i] - window + 1, doc_start[i]) where given)."""
    b, C = q.shape
    hs = C // n_head
    for i in range(b):
        n, s = int(positions[i]) + 1, int(slots[i])
        lo = 0 if window is None else max(0, n - int(window[0]))
        lo = lo if doc_start is None else max(lo, int(doc_start[i]))
        qh = q[i].reshape(n_head, 1, hs)
        kh = np.ascontiguousarray(k_cache[s, lo:n].reshape(n - lo, n_head, hs).transpose(1, 2, 0))  # (NH, hs, n)
        vh = np.ascontiguousarray(v_cache[s, lo:n].reshape(n - lo, n_head, hs).transpose(1, 0, 2))  # (NH, n, hs)
        p = qh @ kh  # (NH, 1, n)
        p *= 1.0 / math.sqrt(hs)
        p -= p.max(axis=2, keepdims=True)
        np.exp(p, out=p)
        p /= p.sum(axis=2, keepdims=True)
        out[i] = (p @ vh).reshape(C)


def decode_qkrope(q: NDArray, k: NDArray, positions: NDArray, rope: NDArray, *, n_head: int) -> None:
    """q, k (b,C) <- rope(rmsnorm_head(.)) in place, row i at position positions[i] (the modern block's; rope
    (2, T, D/2) as ops/qkrope.py's). The forward's row function on rows gathered at their own positions, so one row
    here is qkrope_forward at its position bit for bit; nothing saved."""
    b, C = q.shape
    rstd = np.empty((b, n_head), q.dtype)  # the forward's statistics, which no backward reads here
    for x in (q, k):
        qkrope.norm_rotate(qkrope.heads(x, n_head), rstd, rope[0, positions], rope[1, positions])


def decode_doc_starts(
    doc: NDArray, tok_cache: NDArray, tokens: NDArray, positions: NDArray, slots: NDArray, eot: int
) -> None:
    """tok_cache (B,T)[slots[i], positions[i]] = tokens[i] for every row first (rows of one cache row read each
    other's), then doc (b,) = each row's document start over positions 0 .. positions[i] of its cache row."""
    tok_cache[slots, positions] = tokens
    for i in range(tokens.shape[0]):
        eots = np.flatnonzero(tok_cache[int(slots[i]), : int(positions[i]) + 1] == eot)
        doc[i] = eots[-1] if eots.size else 0
