"""RMSNorm over the last axis without a weight (eps 1e-6; ops/rmsnorm.py gives the math). x:(N,C), rstd:(N,) fp32.

Forward saves rstd (N,) in fp32: one float a row makes the backward one pass over x and dout.
residual_rmsnorm_forward is the residual add fused into the RMSNorm that reads the sum: s = x + y is stored
(rounded to s's type) and normalized as stored, so it equals the add then rmsnorm_forward bit for bit, one pass over
the rows instead of two (the sum is not read back).
Backward: dx += rstd * (dout - xhat * mean(dout * xhat)), xhat = x * rstd recomputed, one pass over the rows. With
no weight there is no sum over the rows, so each program owns its rows outright: no partial sums, no atomics.
Every program takes ROWS whole rows (C <= BLOCK_C in one tile; sums in fp32). Launch configurations are the runtime's
tuner's choices (`tuner`), timed once per GPU and shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microgpt.kernels import layernorm
from microgpt.kernels.tuning import Tuner

EPS = 1e-6


@triton.jit
def k_rmsnorm_fwd(
    out_ptr, rstd_ptr, x_ptr, y_ptr, s_ptr, N, C, eps, RESID: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr
):
    # out, x: (N, C); rstd: (N,) fp32; ROWS rows per program
    # RESID: y, s (N, C); the rows normalized are s = x + y, stored first (y, s unused otherwise)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < N)[:, None] & (cols < C)[None, :]
    off = rows[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if RESID:
        x = (x + tl.load(y_ptr + off, mask=mask, other=0.0).to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + off, x, mask=mask)
        x = x.to(tl.float32)  # the sum as stored: what rmsnorm_forward would read back
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / C + eps)
    tl.store(out_ptr + off, (x * rstd[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < N)


@triton.jit
def k_rmsnorm_bwd(dx_ptr, dout_ptr, x_ptr, rstd_ptr, N, C, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    # dx, dout, x: (N, C); rstd: (N,) fp32; dx += the input gradient; ROWS rows per program
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < N
    mask = rmask[:, None] & (cols < C)[None, :]
    off = rows[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dout_ptr + off, mask=mask, other=0.0).to(tl.float32)
    dx_old = tl.load(dx_ptr + off, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
    xhat = x * rstd[:, None]
    c = tl.sum(xhat * dy, axis=1) / C
    dx = (dy - xhat * c[:, None]) * rstd[:, None] + dx_old
    tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# Launch configurations (rows a tile, warps), timed once per GPU and shape in the warm-up (tuning.launch): LayerNorm's
# forward's row tiles, for both kernels. A row's sums never span programs; the configurations differ only in the order
# of a row's sum over its lanes (its last bits).
FWD_CONFIGS = BWD_CONFIGS = layernorm.FWD_CONFIGS


def rmsnorm_forward(out: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, *, tuner: Tuner) -> None:
    """out (N,C) = rmsnorm(x); writes rstd (N,) fp32."""
    _forward(out, rstd, x, None, None, tuner)


def residual_rmsnorm_forward(
    s: torch.Tensor, out: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, y: torch.Tensor, *, tuner: Tuner
) -> None:
    """s = x + y (the residual stream's next value), then out = rmsnorm(s), in one pass."""
    _forward(out, rstd, x, y, s, tuner)


def _forward(
    out: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, y: torch.Tensor | None, s: torch.Tensor | None, tuner: Tuner
) -> None:
    C = x.shape[-1]
    N = x.numel() // C
    resid = y is not None

    def make(rows: int, warps: int):
        return lambda: k_rmsnorm_fwd[(triton.cdiv(N, rows),)](
            out,
            rstd,
            x,
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

    tuner.launch("rmsnorm_fwd", f"{N}:{C}:{x.dtype}:r{int(resid)}", FWD_CONFIGS, make)


def rmsnorm_backward(
    dx: torch.Tensor, dout: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, *, tuner: Tuner
) -> None:
    """dx (N,C) += gradient of rmsnorm given dout (N,C), x and the forward's rstd (N,)."""
    C = x.shape[-1]
    N = x.numel() // C

    def make(rows: int, warps: int):
        return lambda: k_rmsnorm_bwd[(triton.cdiv(N, rows),)](
            dx, dout, x, rstd, N, C, ROWS=rows, BLOCK_C=triton.next_power_of_2(C), num_warps=warps
        )

    tuner.launch("rmsnorm_bwd", f"{N}:{C}:{x.dtype}", BWD_CONFIGS, make)
