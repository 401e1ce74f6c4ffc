"""LayerNorm over the last axis (eps 1e-5, biased variance, as torch.nn.LayerNorm). x:(N,C), w,b:(C,).

Forward saves mean and rstd (N,) in fp32: two floats a row make the backward one pass over x and dout. In precision
"fp8", where its output is a block linear's input, the forward writes that linear's E4M3 operand instead of the
output (kernels/fp8.py): no bf16 copy is written and read again by a cast.
Backward: dx += ..., and dw, db accumulate deterministically: each program sums its rows' contributions into
its own row of `partials` (P, 2, C) fp32, and a second kernel adds the P rows in a fixed order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from microgpt.fp8 import HISTORY, Fp8Weight
from microgpt.kernels import fp8, tuning

EPS = 1e-5
PARTS = 16 if tuning.INTERPRET else 528  # programs of the backward (4 per H200 SM); rows of `partials`


@triton.jit
def k_layernorm_fwd(out_ptr, mean_ptr, rstd_ptr, x_ptr, w_ptr, b_ptr, N, C, eps, slot_ptr, rows8_ptr, t8_ptr,
                    ROWS: tl.constexpr, BLOCK_C: tl.constexpr, F8: tl.constexpr = False, HIST: tl.constexpr = 0,
                    PACK: tl.constexpr = 1, HW: tl.constexpr = False):  # fmt: skip
    # out, x: (N, C); mean, rstd: (N,) fp32; w, b: (C,); ROWS rows per program. F8 (precision "fp8", the input of a
    # block linear): out is not written; its values, rounded to out's dtype, are cast to E4M3 by the slot (as
    # kernels/fp8.k_cast casts out) into rows8 (N, C) and t8 (C, N), PACK-byte words down a column (N % PACK == 0)
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < N)[:, None] & (cols < C)[None, :]
    off = rows[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / C
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / C + eps)
    w = tl.load(w_ptr + cols, mask=cols < C).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cols < C).to(tl.float32)
    y = (xc * rstd[:, None] * w[None, :] + b[None, :]).to(out_ptr.dtype.element_ty)
    if F8:
        s, inv = fp8.slot_scale(slot_ptr, HIST)
        if pid == 0:
            tl.store(slot_ptr, inv)
        q = fp8.quantize(tl.where(mask, y.to(tl.float32), 0.0), s, slot_ptr, HW)
        fp8.store_e4m3(q, rows8_ptr, t8_ptr, pid * ROWS, cols, N, C, C, PACK > 1, PACK)
    else:
        tl.store(out_ptr + off, y, mask=mask)
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
                      w: torch.Tensor, b: torch.Tensor, site: Fp8Weight | None = None,
                      q: fp8.Scratch | None = None) -> None:  # fmt: skip
    """site (precision "fp8"): the block linear whose input out is (ops/layernorm.py). Its E4M3 operand is written
    here, out is not: the rows into the scratch q.x8, the transpose into site.xt. While the histories are being
    primed, out is written and then cast (the cast takes its own amax first)."""
    C = w.shape[0]
    N = x.numel() // C
    BC = triton.next_power_of_2(C)
    if site is None:
        k_layernorm_fwd[(triton.cdiv(N, ROWS),)](out, mean, rstd, x, w, b, N, C, EPS, None, None, None, ROWS=ROWS,
                                                 BLOCK_C=BC, num_warps=_warps(C))  # fmt: skip
        return
    x8, xt = q.view(q.x8, N, C), site.xt.view(C, N)
    if site.priming.on:
        layernorm_forward(out, mean, rstd, x, w, b)
        fp8.cast(out, site.xslot, x8, xt, prime=True)
        return

    def make(rows: int, warps: int, pack: int) -> Callable[[], None]:
        return lambda: k_layernorm_fwd[(triton.cdiv(N, rows),)](
            out, mean, rstd, x, w, b, N, C, EPS, site.xslot, x8.view(torch.uint8), xt.view(torch.uint8), ROWS=rows,
            BLOCK_C=BC, F8=True, HIST=HISTORY, PACK=pack if N % pack == 0 else 1, HW=fp8.HW_CVT, num_warps=warps)

    fp8.run_tuned(make, F8_CONFIGS, "layernorm_fp8", f"{N}x{C}:{x.dtype}")


# Launch configurations of the fp8 forward (rows a program, warps, PACK), timed once per GPU and shape in the
# warm-up: 32 elements of a 1,024-wide tile a thread, as the plain forward (ptxas: 79-96 registers, no spills; 16
# rows on 4 warps took 254 and 64 rows on 16 warps spilled), with 4 or 8 rows' bytes of a column in a word.
F8_CONFIGS = {"4r4w4": (4, 4, 4), "8r8w8": (8, 8, 8), "8r8w4": (8, 8, 4), "16r16w8": (16, 16, 8)}  # fmt: skip


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
