"""ReLU^2 (ops/relu2.py gives the math): a = max(h, 0)^2 and, in place, dh *= 2 max(h, 0), two elementwise passes in
fp32 over contiguous arrays of any shape, and the device functions relu2 and relu2_grad they share with the GEMM tiles'
epilogues (kernels/tile.py's act_of, act_grad: gemm.py's k_gemm_act, k_gemm_dact and gemm_tma.py's).

One fixed launch configuration (BLOCK elements a program, 4 warps), as GELU's passes: an elementwise pass is bound by
memory, every element costs alike, and each program's loads are contiguous, so tile choices would only move the
launch's grid.
"""

import torch
import triton
import triton.language as tl

BLOCK = 2048  # elements a program


@triton.jit
def relu2(h):
    r = tl.maximum(h, 0.0)
    return r * r


@triton.jit
def relu2_grad(h):
    return 2.0 * tl.maximum(h, 0.0)


@triton.jit
def k_relu2_fwd(a_ptr, h_ptr, n, BLOCK: tl.constexpr):
    # a, h: (n,); a = max(h, 0)^2
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + offs, mask=mask).to(tl.float32)
    tl.store(a_ptr + offs, relu2(h).to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_relu2_bwd(dh_ptr, h_ptr, n, BLOCK: tl.constexpr):
    # dh, h: (n,); in: dh holds the gradient reaching relu2(h); out: dh = dh * 2 max(h, 0)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + offs, mask=mask).to(tl.float32)
    da = tl.load(dh_ptr + offs, mask=mask).to(tl.float32)
    tl.store(dh_ptr + offs, (da * relu2_grad(h)).to(dh_ptr.dtype.element_ty), mask=mask)


def relu2_forward(a: torch.Tensor, h: torch.Tensor) -> None:
    """a = max(h, 0)^2, one pass (any shape, contiguous)."""
    n = h.numel()
    k_relu2_fwd[(triton.cdiv(n, BLOCK),)](a, h, n, BLOCK=BLOCK, num_warps=4)


def relu2_backward(dh: torch.Tensor, h: torch.Tensor) -> None:
    """dh *= 2 max(h, 0) in place, one pass over h and dh."""
    n = h.numel()
    k_relu2_bwd[(triton.cdiv(n, BLOCK),)](dh, h, n, BLOCK=BLOCK, num_warps=4)
