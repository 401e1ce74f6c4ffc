"""QK-norm then rotary position embedding, on q and k in place (the modern block; RoPE as Hugging Face's Llama).

For each token row, each head h and each of q and k, with x the head's vector of D = C / H and p the row's position:

    rstd = 1 / sqrt(mean(x^2) + EPS)                    one float a (row, head)
    xhat = x * rstd                                     RMSNorm over the head, no weight
    x1, x2 = xhat[:D/2], xhat[D/2:]                     the "rotate half" pairing (Hugging Face / Llama)
    y1 = x1 * cos(a) - x2 * sin(a)                      a_i = p * base^(-2i/D), i in 0 .. D/2 - 1
    y2 = x2 * cos(a) + x1 * sin(a)

Shapes: q, k (b, t, C) views (the model hands in q and k of the (3, N, C) projection buffer as (b, t, C)), heads
interleaved as (b, t, H, D); rows at positions pos .. pos + t - 1 (the training forward: pos = 0); rstd (2, b*t, H),
row-major over (b, t): [0] q's, [1] k's; rope (2, T, D/2) float32, rope_tables' (cos, sin), T >= pos + t.
Forward rewrites q and k with y and saves rstd (one float a head and row).

Backward, with g the gradient reaching y (dq or dk as attention's backward wrote it):

    xhat   = R^-1 y = R^T y / w     (x1 = (y1 cos + y2 sin) / w, x2 = (y2 cos - y1 sin) / w)   recomputed
    ghat   = R^T g                  (R's Jacobian is R: the transpose, rotation by -a)
    dx     = rstd * (ghat - xhat * mean(ghat * xhat))                      RMSNorm's backward, per head

where w = cos^2 + sin^2 of the float32 tables: 1 in exact arithmetic, off by float32's rounding in the tables, so
the inverse divides by it (R is a rotation times sqrt(w), and R^T / w its exact inverse; w is computed in the
compute dtype). dq, dk are rewritten in place with dx: this op is their last writer before the QKV linear's
backward, so the buffer that held the gradient of the output holds the gradient of the input afterwards.
Backward recomputes xhat by the inverse rotation of the output (which attention keeps anyway, as its own input)
rather than storing x or xhat: either would cost two (N, C) activations a layer (q's and k's), against 2 * H floats
a row for rstd.

The passes are independent row by row (every reduction runs over one head of one row), so they run over ranges of
rows (ops/rows.py), one range a thread as LayerNorm's: short rows, whose reductions cost more in NumPy's fixed part
than in cache misses. The decode step's decode_qkrope (ops/decode.py) runs the same row function on rows at their
own positions, so one row there is this forward at its position bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.lib.stride_tricks import as_strided
from numpy.typing import NDArray

from microgpt.ops.rows import SERIAL, Rows

EPS = 1e-6
BASE = 10000.0


def rope_tables(T: int, D: int, base: float = BASE) -> NDArray[np.float32]:
    """(2, T, D/2) float32: cos and sin of a[p, i] = p * base^(-2i/D), positions p in 0 .. T - 1. The angles and
    their cos and sin are computed in float64 and rounded once (p * inverse frequency is exact there to T ~ 2^40)."""
    if D % 2 or D <= 0:
        raise ValueError(f"rope_tables: the head size D ({D}) must be even and positive")
    inv = base ** (-np.arange(0, D, 2, dtype=np.float64) / D)  # (D/2,)
    a = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]  # (T, D/2)
    return np.stack([np.cos(a), np.sin(a)]).astype(np.float32)


def qkrope_forward(
    q: NDArray, k: NDArray, rstd: NDArray, rope: NDArray, *, n_head: int, pos: int = 0, rows: Rows = SERIAL
) -> None:
    """q, k (b,t,C) <- rope(rmsnorm_head(.)) at positions pos .. pos + t - 1, in place; rstd (2, b*t, H) written."""
    b, t, _ = q.shape
    if pos + t > rope.shape[1]:
        raise ValueError(f"qkrope: positions {pos} .. {pos + t - 1} are past the rope table's {rope.shape[1]}")

    def one(x: NDArray, r: NDArray, p0: int, p1: int) -> None:
        norm_rotate(heads(x, n_head), r, rope[0, p0:p1], rope[1, p0:p1])

    def piece(bi: int, lo: int, hi: int) -> None:
        n0 = bi * t
        one(q[bi, lo:hi], rstd[0, n0 + lo : n0 + hi], pos + lo, pos + hi)
        one(k[bi, lo:hi], rstd[1, n0 + lo : n0 + hi], pos + lo, pos + hi)

    _over_rows(rows, b, t, q.shape[2], piece)


def qkrope_backward(
    dq: NDArray, dk: NDArray, q: NDArray, k: NDArray, rstd: NDArray, rope: NDArray, *, n_head: int, rows: Rows = SERIAL
) -> None:
    """dq, dk (b,t,C): the gradient w.r.t. the op's output, rewritten in place into the gradient w.r.t. its input;
    q, k (b,t,C) the forward's outputs (positions 0 .. t - 1), rstd (2, b*t, H) its saved statistics."""
    b, t, _ = q.shape

    def one(g: NDArray, y: NDArray, r: NDArray, lo: int, hi: int) -> None:
        norm_rotate_backward(heads(g, n_head), heads(y, n_head), r, rope[0, lo:hi], rope[1, lo:hi])

    def piece(bi: int, lo: int, hi: int) -> None:
        n0 = bi * t
        one(dq[bi, lo:hi], q[bi, lo:hi], rstd[0, n0 + lo : n0 + hi], lo, hi)
        one(dk[bi, lo:hi], k[bi, lo:hi], rstd[1, n0 + lo : n0 + hi], lo, hi)

    _over_rows(rows, b, t, q.shape[2], piece)


def norm_rotate(x: NDArray, rstd: NDArray, cos: NDArray, sin: NDArray) -> None:
    """x (n,H,D) <- rotate(x * rstd) in place, rstd (n,H) written; cos, sin (n, D/2): each row's angles."""
    D = x.shape[2]
    ss = np.einsum("nhd,nhd->nh", x, x)  # sums of squares, then rstd in place
    ss /= D
    ss += EPS
    np.sqrt(ss, out=ss)
    np.reciprocal(ss, out=ss)
    rstd[...] = ss  # what backward reads: the forward scales by the same (stored) value
    x *= rstd[:, :, None]  # x = xhat
    _rotate(x, cos[:, None, :], sin[:, None, :])


def norm_rotate_backward(g: NDArray, y: NDArray, rstd: NDArray, cos: NDArray, sin: NDArray) -> None:
    """g (n,H,D) <- the gradient w.r.t. the input of norm_rotate, from the gradient w.r.t. its output y (n,H,D)."""
    D = y.shape[2]
    c, s = cos[:, None, :].astype(y.dtype), -sin[:, None, :].astype(y.dtype)  # the transposed rotation: by -a
    xhat = y.copy()
    _rotate(xhat, c, s)
    w = c * c + s * s  # the rounded tables' cos^2 + sin^2, 1 to within float32's rounding: R^-1 = R^T / w
    xhat[..., : D // 2] /= w
    xhat[..., D // 2 :] /= w
    _rotate(g, c, s)  # g = ghat
    m = np.einsum("nhd,nhd->nh", g, xhat)
    m /= D
    xhat *= m[:, :, None]
    g -= xhat
    g *= rstd[:, :, None]


def _rotate(x: NDArray, c: NDArray, s: NDArray) -> None:
    """(x1, x2) <- (x1 c - x2 s, x2 c + x1 s) over the halves of x's last axis, in place."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x1s, x2s = x1 * s, x2 * s
    x1 *= c
    x1 -= x2s
    x2 *= c
    x2 += x1s


def heads(x: NDArray, n_head: int) -> NDArray:
    """(n, C) -> (n, H, D) view, whatever x's row stride; writes through it reach x (a reshape could copy)."""
    (n, C), (sn, sc) = x.shape, x.strides
    return as_strided(x, (n, n_head, C // n_head), (sn, sc * (C // n_head), sc))


def _over_rows(rows: Rows, b: int, t: int, C: int, piece: Callable[[int, int, int], None]) -> None:
    """piece(bi, lo, hi) over the b*t rows of a (b, t, C) array, rows lo .. hi - 1 of batch element bi, one range of
    the flattened rows a thread (a range crossing a batch element is cut there)."""

    def span(i: int, j: int) -> None:
        while i < j:
            bi, lo = divmod(i, t)
            hi = min(t, lo + j - i)
            piece(bi, lo, hi)
            i += hi - lo

    rows.run(span, b * t, C, per_thread=True)
