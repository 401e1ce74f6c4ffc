"""LayerNorm over the last axis (eps 1e-5, biased variance, as torch.nn.LayerNorm). x:(N,C), w,b:(C,).

Forward saves mean and rstd (N,) in fp32: two floats a row make the backward one pass over x and dout.
residual_layernorm_forward is the residual add fused into the LayerNorm that reads the sum: s = x + y is stored
(rounded to s's type) and normalized as stored, so it equals residual_forward then layernorm_forward bit for bit,
one pass over the rows instead of two (the sum is not read back).
Backward: dx += ..., and dw, db accumulate deterministically: each program sums its rows' contributions into
its own row of `partials` (P, 2, C) fp32, and a second kernel adds the P rows in a fixed order. The runtime sizes
`partials` by the device (PARTS_PER_SM programs an SM, kernels/runtime.py), and the backward's grid follows it.
Launch configurations are the runtime's tuner's choices (`tuner`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microgpt.kernels.tuning import INTERPRET, Tuner

EPS = 1e-5
PARTS_PER_SM = 4  # programs of the backward a streaming multiprocessor: rows of `partials`


@triton.jit
def k_layernorm_fwd(
    out_ptr,
    mean_ptr,
    rstd_ptr,
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    s_ptr,
    N,
    C,
    eps,
    RESID: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # out, x: (N, C); mean, rstd: (N,) fp32; w, b: (C,); ROWS rows per program
    # RESID: y, s (N, C); the rows normalized are s = x + y, stored first (y, s unused otherwise)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < N)[:, None] & (cols < C)[None, :]
    off = rows[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if RESID:
        x = (x + tl.load(y_ptr + off, mask=mask, other=0.0).to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + off, x, mask=mask)
        x = x.to(tl.float32)  # the sum as stored: what layernorm_forward would read back
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
def k_layernorm_bwd(
    dx_ptr,
    part_ptr,
    dout_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    N,
    C,
    rows_per_prog,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    STAGES: tl.constexpr,
):
    # dx, dout, x: (N, C); part: (P, 2, C) fp32, this program's row of dw and db partial sums. STAGES > 1: the
    # loop's loads run that many tiles ahead (Triton's loop pipelining), so a program's loads overlap its sums
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    w = tl.load(w_ptr + cols, mask=cmask).to(tl.float32)
    dw = tl.zeros((BLOCK_C,), dtype=tl.float32)
    db = tl.zeros((BLOCK_C,), dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, N)
    for i in tl.range(0, rows_per_prog, ROWS, num_stages=STAGES):
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


# Launch configurations, timed once per GPU and shape in the warm-up (tuning.launch); the first is the default
# outside it. Forward: (rows a tile, warps); backward: (rows a tile, warps, stages of its loop's loads); the
# weight-gradient reduction: (columns a program, warps). The interpreter pays per program, so it takes 16 rows on
# one warp.
if INTERPRET:
    FWD_CONFIGS = {"r16w1": (16, 1)}
    BWD_CONFIGS = {"r16w1": (16, 1, 1)}
    DWDB_CONFIGS = {"c128w1": (128, 1)}
else:
    FWD_CONFIGS = {
        "r4w4": (4, 4),
        "r1w2": (1, 2),
        "r1w4": (1, 4),
        "r2w4": (2, 4),
        "r2w8": (2, 8),
        "r4w8": (4, 8),
        "r8w8": (8, 8),
    }
    BWD_CONFIGS = {name: (rows, warps, 1) for name, (rows, warps) in FWD_CONFIGS.items()}
    BWD_CONFIGS |= {
        "r4w4s2": (4, 4, 2),
        "r4w4s3": (4, 4, 3),
        "r2w4s3": (2, 4, 3),
        "r4w8s2": (4, 8, 2),
        "r8w8s2": (8, 8, 2),
        "r1w2s4": (1, 2, 4),
    }
    DWDB_CONFIGS = {
        "c32w4": (32, 4),
        "c8w1": (8, 1),
        "c8w2": (8, 2),
        "c16w1": (16, 1),
        "c16w2": (16, 2),
        "c16w4": (16, 4),
        "c64w4": (64, 4),
    }


def layernorm_forward(
    out: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    *,
    tuner: Tuner,
) -> None:
    _forward(out, mean, rstd, x, w, b, None, None, tuner)


def residual_layernorm_forward(
    s: torch.Tensor,
    out: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    *,
    tuner: Tuner,
) -> None:
    """s = x + y (the residual stream's next value), then out = layernorm(s), in one pass."""
    _forward(out, mean, rstd, x, w, b, y, s, tuner)


def _forward(
    out: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor | None,
    s: torch.Tensor | None,
    tuner: Tuner,
) -> None:
    C = w.shape[0]
    N = x.numel() // C
    resid = y is not None

    def make(rows: int, warps: int):
        return lambda: k_layernorm_fwd[(triton.cdiv(N, rows),)](
            out,
            mean,
            rstd,
            x,
            w,
            b,
            y if resid else x,
            s if resid else x,
            N,
            C,
            EPS,
            RESID=resid,
            ROWS=rows,
            BLOCK_C=triton.next_power_of_2(C),
            num_warps=warps,
        )

    tuner.launch("layernorm_fwd", f"{N}:{C}:{x.dtype}:r{int(resid)}", FWD_CONFIGS, make)


def scratch_numel(C: int, sm_count: int) -> int:
    """fp32 elements of the backward's `partials` scratch on a device of sm_count multiprocessors."""
    return PARTS_PER_SM * sm_count * 2 * C


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
    tuner: Tuner,
) -> None:
    """partials: fp32 scratch of (P, 2, C) elements or more (scratch_numel): its rows bound the programs."""
    C = w.shape[0]
    N = x.numel() // C
    rows = triton.cdiv(N, partials.numel() // (2 * C))
    P = triton.cdiv(N, rows)
    BC = triton.next_power_of_2(C)

    def bwd(tile: int, warps: int, stages: int):
        return lambda: k_layernorm_bwd[(P,)](
            dx, partials, dout, x, w, mean, rstd, N, C, rows, ROWS=tile, BLOCK_C=BC, STAGES=stages, num_warps=warps
        )

    def dwdb(cols: int, warps: int):  # latency-bound: narrow column blocks give more programs (C/32 = 24 at 768)
        cols = min(cols, BC)
        return lambda: k_layernorm_bwd_dwdb[(triton.cdiv(C, cols),)](
            dw, db, partials, P, C, BLOCK_P=128, BLOCK_C=cols, num_warps=warps
        )

    tuner.launch("layernorm_bwd", f"{N}:{C}:{x.dtype}", BWD_CONFIGS, bwd)
    tuner.launch("layernorm_dwdb", f"{P}:{C}", DWDB_CONFIGS, dwdb)
