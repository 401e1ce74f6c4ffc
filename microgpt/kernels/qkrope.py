"""QK-norm per head then rotary embedding, on q and k in place (ops/qkrope.py specifies the pair and its math).

q, k: (b, t, C) views with any batch and row strides (the last stride 1), heads interleaved as (b, t, H, D); rstd
(2, b*t, H) fp32 written by the forward; rope (2, T, D/2) fp32 (cos, sin). One program a token row does q's and
k's heads of that row: each row is read once and written once in place, D/2-lane halves of the H heads as two
(H, D/2) tiles, so that the rotation pairs lane i with lane i + D/2 in registers and no lane is loaded twice.
Sums over a head and the rotation run in fp32; the result is rounded once, to q's dtype, when stored.

Backward recomputes xhat from the forward's output by the inverse rotation (R^T y / (cos^2 + sin^2), exact for the
fp32 tables) rather than storing the input: two (N, C) activations a layer saved, for a few FMAs a lane.

decode_qkrope (kernels/decode.py) runs the same row functions (`row_offsets`, `rope_row`, `norm_rotate_row`) with
the same tile and warps, so a decode row is this forward at its position bit for bit. The launch configuration is
fixed by (H, D), not tuned: tuning it per shape would give the decode step a configuration of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

EPS = 1e-6


@triton.jit
def norm_rotate_row(x1, x2, c, s, D, eps):
    # x1, x2: (BH, BD2) fp32, the heads' halves (0 where masked); c, s: (BD2,) fp32, the row's cos and sin
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
    x1 = x1 * rstd[:, None]
    x2 = x2 * rstd[:, None]
    y1 = x1 * c[None, :] - x2 * s[None, :]
    y2 = x2 * c[None, :] + x1 * s[None, :]
    return y1, y2, rstd


@triton.jit
def norm_rotate_row_bwd(g1, g2, y1, y2, rstd, c, s, D):
    # g: the gradient reaching y; y: the forward's output, both (R, BD2) fp32 halves of R heads (or R rows of one
    # head); rstd (R,); c, s: cos and sin broadcast against them ((1, BD2): one row's, or (R, BD2): each row its own
    # position, as attention's backward epilogue has them); returns the gradient reaching x
    w = 1.0 / (c * c + s * s)  # the fp32 tables' cos^2 + sin^2, 1 to within rounding: R^-1 = R^T / w
    x1 = (y1 * c + y2 * s) * w
    x2 = (y2 * c - y1 * s) * w
    h1 = g1 * c + g2 * s
    h2 = g2 * c - g1 * s
    m = (tl.sum(h1 * x1, axis=1) + tl.sum(h2 * x2, axis=1)) / D
    return (h1 - x1 * m[:, None]) * rstd[:, None], (h2 - x2 * m[:, None]) * rstd[:, None]


@triton.jit
def row_offsets(H, D, BH: tl.constexpr, BD2: tl.constexpr):
    # (BH, BD2) offsets of the first halves within a row, and their mask; the second halves are D/2 further
    heads = tl.arange(0, BH)
    lanes = tl.arange(0, BD2)
    off = heads[:, None] * D + lanes[None, :]
    return off, (heads < H)[:, None] & (lanes < D // 2)[None, :]


@triton.jit
def rope_row(rope_ptr, p, D, T, BD2: tl.constexpr):
    # (BD2,) fp32 cos and sin of position p from rope (2, T, D/2) (p (R, 1): (R, BD2), a position a row); masked
    # lanes: no rotation (cos^2 + sin^2 = 1)
    half = D // 2
    lanes = tl.arange(0, BD2)
    tab = rope_ptr + p * half + lanes
    c = tl.load(tab, mask=lanes < half, other=1.0)
    s = tl.load(tab + T * half, mask=lanes < half, other=0.0)
    return c, s


@triton.jit
def k_qkrope_fwd(
    q_ptr, k_ptr, rstd_ptr, rope_ptr, t, pos, sqb, sqt, skb, skt, N, H, D, T, eps, BH: tl.constexpr, BD2: tl.constexpr
):
    # q, k: (b, t, C) of strides (sqb, sqt, 1), (skb, skt, 1), rewritten; rstd: (2, N, H) fp32, N = b*t;
    # rope: (2, T, D/2) fp32; program n does row n = (n // t, n % t) at position pos + n % t
    n = tl.program_id(0).to(tl.int64)
    bi, ti = n // t, n % t
    off, mask = row_offsets(H, D, BH, BD2)
    half = D // 2
    c, s = rope_row(rope_ptr, pos + ti, D, T, BD2)
    heads = tl.arange(0, BH)
    for which in tl.static_range(2):
        if which == 0:
            row = q_ptr + bi * sqb + ti * sqt
        else:
            row = k_ptr + bi * skb + ti * skt
        x1 = tl.load(row + off, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(row + half + off, mask=mask, other=0.0).to(tl.float32)
        y1, y2, rstd = norm_rotate_row(x1, x2, c, s, D, eps)
        tl.store(row + off, y1.to(row.dtype.element_ty), mask=mask)
        tl.store(row + half + off, y2.to(row.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + (which * N + n) * H + heads, rstd, mask=heads < H)


@triton.jit
def k_qkrope_bwd(
    dq_ptr,
    dk_ptr,
    q_ptr,
    k_ptr,
    rstd_ptr,
    rope_ptr,
    t,
    sqb,
    sqt,
    skb,
    skt,
    sdqb,
    sdqt,
    sdkb,
    sdkt,
    N,
    H,
    D,
    T,
    BH: tl.constexpr,
    BD2: tl.constexpr,
):
    # dq, dk: (b, t, C) of strides (sdqb, sdqt, 1), (sdkb, sdkt, 1), rewritten; q, k: the forward's outputs, of
    # strides (sqb, sqt, 1), (skb, skt, 1); rstd: (2, N, H) fp32; rope: (2, T, D/2) fp32, row n at position n % t
    n = tl.program_id(0).to(tl.int64)
    bi, ti = n // t, n % t
    off, mask = row_offsets(H, D, BH, BD2)
    half = D // 2
    c, s = rope_row(rope_ptr, ti, D, T, BD2)
    heads = tl.arange(0, BH)
    for which in tl.static_range(2):
        if which == 0:
            y_row = q_ptr + bi * sqb + ti * sqt
            g_row = dq_ptr + bi * sdqb + ti * sdqt
        else:
            y_row = k_ptr + bi * skb + ti * skt
            g_row = dk_ptr + bi * sdkb + ti * sdkt
        y1 = tl.load(y_row + off, mask=mask, other=0.0).to(tl.float32)
        y2 = tl.load(y_row + half + off, mask=mask, other=0.0).to(tl.float32)
        g1 = tl.load(g_row + off, mask=mask, other=0.0).to(tl.float32)
        g2 = tl.load(g_row + half + off, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + (which * N + n) * H + heads, mask=heads < H, other=0.0)
        d1, d2 = norm_rotate_row_bwd(g1, g2, y1, y2, rstd, c[None, :], s[None, :], D)
        tl.store(g_row + off, d1.to(g_row.dtype.element_ty), mask=mask)
        tl.store(g_row + half + off, d2.to(g_row.dtype.element_ty), mask=mask)


def launch_config(n_head: int, D: int) -> dict[str, int]:
    """The tile (BH heads, BD2 lanes a half) and warps of a row of n_head heads of D: one lane a warp's thread per
    element of the (BH, BD2) tile up to 4 warps (ANDREA-120M modern, H 6 and D 128: an (8, 64) tile on 4 warps).
    The forward, the backward and the decode step's decode_qkrope all take it."""
    BH, BD2 = triton.next_power_of_2(n_head), triton.next_power_of_2(D // 2)
    return {"BH": BH, "BD2": BD2, "num_warps": max(1, min(4, BH * BD2 // 128))}


def check_views(n_head: int, *xs: torch.Tensor) -> int:
    """D, the head size of the (.., C) views xs: C a multiple of n_head, D even, the last stride 1."""
    C = xs[0].shape[-1]
    if C % n_head or (C // n_head) % 2 or any(x.stride(-1) != 1 for x in xs):
        raise ValueError(f"qkrope: C ({C}) must split into {n_head} heads of an even size, with unit column stride")
    return C // n_head


def qkrope_forward(
    q: torch.Tensor, k: torch.Tensor, rstd: torch.Tensor, rope: torch.Tensor, *, n_head: int, pos: int = 0
) -> None:
    """q, k (b,t,C) <- rope(rmsnorm_head(.)) at positions pos .. pos + t - 1, in place; rstd (2, b*t, H) fp32 written;
    rope (2, T, D/2) fp32, T >= pos + t."""
    b, t, _ = q.shape
    D = check_views(n_head, q, k)
    if pos + t > rope.shape[1]:
        raise ValueError(f"qkrope: positions {pos} .. {pos + t - 1} are past the rope table's {rope.shape[1]}")
    k_qkrope_fwd[(b * t,)](
        q,
        k,
        rstd,
        rope,
        t,
        pos,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        b * t,
        n_head,
        D,
        rope.shape[1],
        EPS,
        **launch_config(n_head, D),
    )


def qkrope_backward(
    dq: torch.Tensor,
    dk: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    rstd: torch.Tensor,
    rope: torch.Tensor,
    *,
    n_head: int,
) -> None:
    """dq, dk (b,t,C): the gradient w.r.t. the op's output, rewritten in place into the gradient w.r.t. its input;
    q, k the forward's outputs (positions 0 .. t - 1); rstd (2, b*t, H) fp32; rope (2, T, D/2) fp32."""
    b, t, _ = q.shape
    D = check_views(n_head, q, k, dq, dk)
    k_qkrope_bwd[(b * t,)](
        dq,
        dk,
        q,
        k,
        rstd,
        rope,
        t,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        dq.stride(0),
        dq.stride(1),
        dk.stride(0),
        dk.stride(1),
        b * t,
        n_head,
        D,
        rope.shape[1],
        **launch_config(n_head, D),
    )
