"""Causal multi-head self-attention (the core only: the q, k, v and output projections are linear pairs).

Per batch element and head h, with Q, K, V the (T,hs) slices of q, k, v for that head:

    S   = Q @ K.T / sqrt(hs)                 (T,T), entries with key > query set to -inf (causal mask)
    lse = logsumexp(S, axis=1)               (T,)
    P   = exp(S - lse[:, None])              (T,T), the softmax, each row sums to 1
    O   = P @ V                              (T,hs)

Shapes: q, k, v, out (B,T,C) with the heads interleaved as (B,T,NH,hs), hs = C / NH; lse (B,NH,T).
Forward saves only out and the row log-sum-exp: keeping P would cost B*NH*T*T floats per layer,
quadratic in T, while recomputing it from S and lse is one matmul and one exp (as FlashAttention).

Backward, with dO the head's slice of dout:

    P   = exp(S - lse[:, None])              recomputed
    dV  = P.T @ dO
    dP  = dO @ V.T
    D   = (dO * O).sum(1)                    (T,) equals (dP * P).sum(1), the softmax's row term
    dS  = P * (dP - D[:, None])
    dQ  = dS @ K / sqrt(hs) ;  dK  = dS.T @ Q / sqrt(hs)

dq, dk and dv are written, not added: attention is their one writer (the q, k, v projections read them), so
nobody has to zero them first.

The reference loops over the batch and keeps the heads as a leading axis: memory is NH*T*T per
batch element, not B*NH*T*T. Batch elements are independent, so the loop runs over ranges of them (ops/rows.py),
on several threads where the backend has them.

attention_forward_cached is the inference step's (microgpt/engine/model.py gpt_infer): queries at positions pos .. pos +
t - 1 of each sequence against the keys and values of positions 0 .. pos + t - 1 held in the KV cache (the same
function as attention_forward over the whole sequence, for those t rows); forward only, nothing saved.
"""

import math

import numpy as np
from numpy.typing import NDArray

from microgpt.ops.rows import SERIAL, Rows


def _heads(x: NDArray, n_head: int) -> NDArray:
    """(T,C) -> (NH,T,hs) view of one batch element; writes through it reach x."""
    T, C = x.shape
    return x.reshape(T, n_head, C // n_head).transpose(1, 0, 2)


def _heads_t(x: NDArray, n_head: int) -> NDArray:
    """(T,C) -> contiguous (NH,hs,T), each head's slice transposed (K^T, V^T): BLAS takes the strided head views
    and transposed views as they are (the same products, bit for bit), but multiplies by this right operand faster
    as a contiguous copy."""
    return np.ascontiguousarray(_heads(x, n_head).transpose(0, 2, 1))


def _mT(x: NDArray) -> NDArray:
    """The transpose of the last two axes, a view."""
    return x.transpose(0, 2, 1)


def _causal_mask(T: int, dtype: np.dtype) -> NDArray:
    """(T,T): 0 where query t may see key u (u <= t), -inf above the diagonal."""
    return np.triu(np.full((T, T), -np.inf, dtype=dtype), k=1)


def _scores(qh: NDArray, kt: NDArray, mask: NDArray) -> NDArray:
    """Masked, scaled scores S (NH,T,T) for one batch element from Q (NH,T,hs) and K^T (NH,hs,T)."""
    s = qh @ kt
    s *= 1.0 / math.sqrt(qh.shape[2])
    s += mask  # query t sees keys 0..t only
    return s


def attention_forward(
    out: NDArray, lse: NDArray, q: NDArray, k: NDArray, v: NDArray, n_head: int, *, rows: Rows = SERIAL
) -> None:
    """out (B,T,C) = causal softmax(q k^T / sqrt(hs)) v per head; lse (B,NH,T) saved for backward."""
    mask = _causal_mask(q.shape[1], q.dtype)

    def one(b: int) -> None:
        s = _scores(_heads(q[b], n_head), _heads_t(k[b], n_head), mask)
        m = s.max(axis=2, keepdims=True)  # subtract the row max so exp cannot overflow
        s -= m
        np.exp(s, out=s)
        row_sum = s.sum(axis=2, keepdims=True)
        np.add(np.log(row_sum[..., 0]), m[..., 0], out=lse[b])
        s /= row_sum  # s = P
        _heads(out[b], n_head)[...] = s @ _heads(v[b], n_head)

    _each(rows, one, q)


def _each(rows: Rows, one, q: NDArray) -> None:
    """one(b) for every batch element b of q (B,T,C), over ranges of them."""

    def batch_range(i: int, j: int) -> None:
        for b in range(i, j):
            one(b)

    rows.run(batch_range, q.shape[0], q[0].size)


def attention_backward(
    dq: NDArray,
    dk: NDArray,
    dv: NDArray,
    dout: NDArray,
    q: NDArray,
    k: NDArray,
    v: NDArray,
    out: NDArray,
    lse: NDArray,
    n_head: int,
    *,
    rows: Rows = SERIAL,
) -> None:
    """dq, dk, dv (B,T,C) = gradients of attention (written), given dout (B,T,C); P is recomputed from lse."""
    hs = q.shape[2] // n_head
    scale = 1.0 / math.sqrt(hs)
    mask = _causal_mask(q.shape[1], q.dtype)

    def one(b: int) -> None:
        qh, kh, doh, oh = (_heads(x[b], n_head) for x in (q, k, dout, out))
        p = _scores(qh, _heads_t(k[b], n_head), mask)
        p -= lse[b][:, :, None]
        np.exp(p, out=p)  # masked entries: exp(-inf) = 0
        _heads(dv[b], n_head)[...] = _mT(p) @ doh
        dp = doh @ _heads_t(v[b], n_head)  # (NH,T,T)
        D = np.einsum("htd,htd->ht", doh, oh)  # (NH,T)
        dp -= D[:, :, None]
        dp *= p  # dp = dS
        dp *= scale  # fold the score scale in once for both dq and dk
        _heads(dq[b], n_head)[...] = dp @ kh
        _heads(dk[b], n_head)[...] = _mT(dp) @ qh

    _each(rows, one, q)


def attention_forward_cached(
    out: NDArray, q: NDArray, k_cache: NDArray, v_cache: NDArray, pos: int, n_head: int
) -> None:
    """out (B,t,C) = causal attention of q (B,t,C), the queries at positions pos .. pos + t - 1, over the cached keys
    and values k_cache, v_cache (B,Tmax,C) of positions 0 .. pos + t - 1: query i sees keys 0 .. pos + i."""
    B, t, C = q.shape
    n = pos + t
    hs = C // n_head
    mask = np.triu(np.full((t, n), -np.inf, dtype=q.dtype), k=pos + 1)  # query i: keys j <= pos + i
    for b in range(B):
        s = _heads(q[b], n_head) @ _heads_t(k_cache[b, :n], n_head)  # (NH, t, n)
        s *= 1.0 / math.sqrt(hs)
        s += mask
        s -= s.max(axis=2, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=2, keepdims=True)
        _heads(out[b], n_head)[...] = s @ _heads(v_cache[b, :n], n_head)
