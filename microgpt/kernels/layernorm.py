"""LayerNorm over the last axis (eps 1e-5, biased variance, as torch.nn.LayerNorm). x:(N,C), w,b:(C,).

Forward saves mean and rstd (N,) in fp32: two floats a row make the backward one pass over x and dout.
Backward: dx += ..., and dw, db accumulate deterministically: each program sums its rows' contributions into
its own row of `partials` (P, 2, C) fp32, and a second kernel adds the P rows in a fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microgpt.kernels import tuning

EPS = 1e-5
PARTS = 16 if tuning.INTERPRET else 528  # programs of the backward (4 per H200 SM); rows of `partials`


@triton.jit
def k_layernorm_fwd(out_ptr, mean_ptr, rstd_ptr, x_ptr, w_ptr, b_ptr, N, C, eps, ROWS: tl.constexpr,
                    BLOCK_C: tl.constexpr):  # fmt: skip
    # out, x: (N, C); mean, rstd: (N,) fp32; w, b: (C,); ROWS rows per program
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < N)[:, None] & (cols < C)[None, :]
    off = rows[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / C
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / C + eps)
    w = tl.load(w_ptr + cols, mask=cols < C).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cols < C).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(out_ptr + off, y.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=rows < N)
    tl.store(rstd_ptr + rows, rstd, mask=rows < N)


@triton.jit
def k_layernorm_bwd(dx_ptr, part_ptr, dout_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, N, C, rows_per_prog,
                    ROWS: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    # dx, dout, x: (N, C); part: (P, 2, C) fp32, this program's row of dw and db partial sums
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    w = tl.load(w_ptr + cols, mask=cmask).to(tl.float32)
    dw = tl.zeros((BLOCK_C,), dtype=tl.float32)
    db = tl.zeros((BLOCK_C,), dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, N)
    for i in range(0, rows_per_prog, ROWS):
        rows = start + i + tl.arange(0, ROWS)
        rmask = rows < end
        mask = rmask[:, None] & cmask[None, :]
        off = rows[:, None] * C + cols[None, :]
        # every load of the tile first, so they are in flight together (the loop is latency-bound)
        x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dout_ptr + off, mask=mask, other=0.0).to(tl.float32)
        dx_old = tl.load(dx_ptr + off, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = (x - tl.load(mean_ptr + rows, mask=rmask, other=0.0)[:, None]) * rstd[:, None]
        wdy = w[None, :] * dy
        c1 = tl.sum(xhat * wdy, axis=1) / C
        c2 = tl.sum(wdy, axis=1) / C
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None] + dx_old
        tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(part_ptr + pid * 2 * C + cols, dw, mask=cmask)
    tl.store(part_ptr + pid * 2 * C + C + cols, db, mask=cmask)


@triton.jit
def k_layernorm_bwd_dwdb(dw_ptr, db_ptr, part_ptr, P, C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    # dw, db: (C,) += sum over the P partial rows, in a fixed order
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = tl.arange(0, BLOCK_P)
    acc_w = tl.zeros((BLOCK_C,), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        m = ((p0 + rows) < P)[:, None] & (cols < C)[None, :]
        ptr = part_ptr + (p0 + rows)[:, None] * 2 * C + cols[None, :]
        acc_w += tl.sum(tl.load(ptr, mask=m, other=0.0), axis=0)
        acc_b += tl.sum(tl.load(ptr + C, mask=m, other=0.0), axis=0)
    cm = cols < C
    tl.store(
        dw_ptr + cols, (tl.load(dw_ptr + cols, mask=cm).to(tl.float32) + acc_w).to(dw_ptr.dtype.element_ty), mask=cm
    )
    tl.store(
        db_ptr + cols, (tl.load(db_ptr + cols, mask=cm).to(tl.float32) + acc_b).to(db_ptr.dtype.element_ty), mask=cm
    )


ROWS = 16 if tuning.INTERPRET else 4  # rows per tile: the interpreter pays per program, the GPU per launch wave


def _warps(C: int) -> int:
    return 1 if tuning.INTERPRET else min(16, max(4, ROWS * triton.next_power_of_2(C) // 1024))


def layernorm_forward(out: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor,
                      w: torch.Tensor, b: torch.Tensor) -> None:  # fmt: skip
    C = w.shape[0]
    N = x.numel() // C
    k_layernorm_fwd[(triton.cdiv(N, ROWS),)](out, mean, rstd, x, w, b, N, C, EPS, ROWS=ROWS,
                                             BLOCK_C=triton.next_power_of_2(C), num_warps=_warps(C))  # fmt: skip


def scratch_numel(C: int) -> int:
    """fp32 elements of the backward's `partials` scratch."""
    return PARTS * 2 * C


def layernorm_backward(
    dx: torch.Tensor,
    dw: torch.Tensor,
    db: torch.Tensor,
    dout: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    *,
    partials: torch.Tensor,
) -> None:
    """partials: fp32 scratch of at least scratch_numel(C) elements."""
    C = w.shape[0]
    N = x.numel() // C
    rows = triton.cdiv(N, PARTS)
    P = triton.cdiv(N, rows)
    BC = triton.next_power_of_2(C)
    k_layernorm_bwd[(P,)](dx, partials, dout, x, w, mean, rstd, N, C, rows, ROWS=ROWS, BLOCK_C=BC, num_warps=_warps(C))
    BCR = min(BC, 128 if tuning.INTERPRET else 32)  # 24 programs for C=768: the reduction is latency-bound
    k_layernorm_bwd_dwdb[(triton.cdiv(C, BCR),)](dw, db, partials, P, C, BLOCK_P=128, BLOCK_C=BCR)
