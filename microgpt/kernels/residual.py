"""Residual add: out = x + y. Backward: dx += dout ; dy += dout. Nothing saved. Flat over all elements."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def k_residual_fwd(out_ptr, x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    # out, x, y: (n,) flat views of (N, C)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_residual_bwd(dx_ptr, dy_ptr, dout_ptr, n, BLOCK: tl.constexpr):
    # dx, dy, dout: (n,)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    d = tl.load(dout_ptr + offs, mask=mask).to(tl.float32)
    dx = tl.load(dx_ptr + offs, mask=mask).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask).to(tl.float32)
    tl.store(dx_ptr + offs, (dx + d).to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dy_ptr + offs, (dy + d).to(dy_ptr.dtype.element_ty), mask=mask)


def residual_forward(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    n = out.numel()
    k_residual_fwd[(triton.cdiv(n, BLOCK),)](out, x, y, n, BLOCK=BLOCK)


def residual_backward(dx: torch.Tensor, dy: torch.Tensor, dout: torch.Tensor) -> None:
    n = dout.numel()
    k_residual_bwd[(triton.cdiv(n, BLOCK),)](dx, dy, dout, n, BLOCK=BLOCK)
