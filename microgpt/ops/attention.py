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

The modern block's q and k are the qkrope op's outputs (ops/qkrope.py), and its backward is attention's composed
with qkrope's: attention_backward with `qkrope=(rstd, rope)` (that op's saved statistics and its tables) returns in
dq, dk the gradients w.r.t. qkrope's input, i.e. attention's dq, dk (as above) then qkrope_backward on them in place.
One op, so that the GPU kernel may apply qkrope's per-row backward to each dq and dk tile while the tile is in its
registers (kernels/attention.py) instead of a pass that reads y and g back and rewrites g.

The reference loops over the batch and keeps the heads as a leading axis: memory is NH*T*T per
batch element, not B*NH*T*T. Batch elements are independent, so the loop runs over ranges of them (ops/rows.py),
on several threads where the backend has them.

attention_forward_cached is the inference step's (microgpt/engine/model.py gpt_infer): queries at positions pos .. pos +
t - 1 of each sequence against the keys and values of positions 0 .. pos + t - 1 held in the KV cache (the same
function as attention_forward over the whole sequence, for those t rows); forward only, nothing saved.

The window and the documents (model.attn_window, model.doc_mask: the modern block's levers, issue 55). Every function
here takes two optional keywords that narrow the causal mask; without them it is the causal mask above, bit for bit:

    window     (1,) int32, w >= 1: query i sees no key j with i - j >= w (the last w positions, itself included)
    doc_start  (B, T) int32 (attention_forward_cached: (B, t), its queries' rows): the position where query i's
               document starts; query i sees no key j < doc_start[i]

so query i attends key j iff j <= i, i - j < w and j >= doc_start[i] (positions are the sequence's own: pos + i in
the cache). Key i itself always qualifies, so no row is empty. The window is a buffer, not a number, so that a window
that widens during training changes what the kernels read, not what they are compiled for (or what a CUDA graph holds).
`doc_starts` makes doc_start from the tokens: a document begins at its <|endoftext|> (the tokenizer's eot id,
model.doc_mask), which belongs to the document it begins; a row whose first token is mid-document starts at 0.
It is non-decreasing along a row, which the kernels use to skip whole tiles.
"""

import math

import numpy as np
from numpy.typing import NDArray

from microgpt.ops.qkrope import qkrope_backward
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


def _bounded_mask(q_pos: NDArray, n_keys: int, window: NDArray | None, doc_start: NDArray | None, dtype) -> NDArray:
    """(n, n_keys): 0 where the query at position q_pos[r] may see key j (j <= q_pos[r], q_pos[r] - j < window,
    j >= doc_start[r]), -inf elsewhere; doc_start (n,) this sequence's row of it, or None."""
    j = np.arange(n_keys)[None, :]
    i = q_pos[:, None]
    seen = j <= i
    if window is not None:
        seen &= i - j < int(window[0])
    if doc_start is not None:
        seen &= j >= doc_start[:, None]
    return np.where(seen, 0.0, -np.inf).astype(dtype)


def _masks(T: int, dtype: np.dtype, window: NDArray | None, doc_start: NDArray | None):
    """The mask of batch element b, as a function of b: the causal one for all, or the bounded one of its row."""
    if window is None and doc_start is None:
        causal = _causal_mask(T, dtype)
        return lambda b: causal
    if doc_start is None:
        one = _bounded_mask(np.arange(T), T, window, None, dtype)
        return lambda b: one
    return lambda b: _bounded_mask(np.arange(T), T, window, doc_start[b], dtype)


def doc_starts(out: NDArray, tokens: NDArray, eot: int) -> None:
    """out (B, n) int32 = per row, the position of the last token == eot at or before each position (0 where none):
    where each query's document starts."""
    pos = np.where(tokens == eot, np.arange(tokens.shape[1], dtype=np.int32), 0)
    np.maximum.accumulate(pos, axis=1, out=out)


def _scores(qh: NDArray, kt: NDArray, mask: NDArray) -> NDArray:
    """Masked, scaled scores S (NH,T,T) for one batch element from Q (NH,T,hs) and K^T (NH,hs,T)."""
    s = qh @ kt
    s *= 1.0 / math.sqrt(qh.shape[2])
    s += mask  # query t sees keys 0..t only
    return s


def attention_forward(
    out: NDArray,
    lse: NDArray,
    q: NDArray,
    k: NDArray,
    v: NDArray,
    n_head: int,
    *,
    rows: Rows = SERIAL,
    window: NDArray | None = None,
    doc_start: NDArray | None = None,
) -> None:
    """out (B,T,C) = causal softmax(q k^T / sqrt(hs)) v per head; lse (B,NH,T) saved for backward. window (1,),
    doc_start (B,T) int32: the narrower mask (module docstring)."""
    mask = _masks(q.shape[1], q.dtype, window, doc_start)

    def one(b: int) -> None:
        s = _scores(_heads(q[b], n_head), _heads_t(k[b], n_head), mask(b))
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
    window: NDArray | None = None,
    doc_start: NDArray | None = None,
    qkrope: tuple[NDArray, NDArray] | None = None,
) -> None:
    """dq, dk, dv (B,T,C) = gradients of attention (written), given dout (B,T,C); P is recomputed from lse. window,
    doc_start: the forward's. qkrope (rstd (2,B*T,NH), rope (2,T',D/2)): q, k are the qkrope op's outputs, and dq, dk
    the gradients w.r.t. its input (module docstring)."""
    hs = q.shape[2] // n_head
    scale = 1.0 / math.sqrt(hs)
    mask = _masks(q.shape[1], q.dtype, window, doc_start)

    def one(b: int) -> None:
        qh, kh, doh, oh = (_heads(x[b], n_head) for x in (q, k, dout, out))
        p = _scores(qh, _heads_t(k[b], n_head), mask(b))
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
    if qkrope is not None:
        qkrope_backward(dq, dk, q, k, *qkrope, n_head=n_head, rows=rows)


def attention_forward_cached(
    out: NDArray,
    q: NDArray,
    k_cache: NDArray,
    v_cache: NDArray,
    pos: int,
    n_head: int,
    *,
    window: NDArray | None = None,
    doc_start: NDArray | None = None,
) -> None:
    """out (B,t,C) = causal attention of q (B,t,C), the queries at positions pos .. pos + t - 1, over the cached keys
    and values k_cache, v_cache (B,Tmax,C) of positions 0 .. pos + t - 1: query i sees keys 0 .. pos + i (with
    window (1,) and doc_start (B,t), the queries' document starts, the narrower mask of the module docstring)."""
    B, t, C = q.shape
    n = pos + t
    hs = C // n_head
    mask = np.triu(np.full((t, n), -np.inf, dtype=q.dtype), k=pos + 1)  # query i: keys j <= pos + i
    for b in range(B):
        s = _heads(q[b], n_head) @ _heads_t(k_cache[b, :n], n_head)  # (NH, t, n)
        s *= 1.0 / math.sqrt(hs)
        if window is not None or doc_start is not None:
            mask = _bounded_mask(pos + np.arange(t), n, window, None if doc_start is None else doc_start[b], q.dtype)
        s += mask
        s -= s.max(axis=2, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=2, keepdims=True)
        _heads(out[b], n_head)[...] = s @ _heads(v_cache[b, :n], n_head)
