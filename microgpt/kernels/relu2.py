"""ReLU^2 (ops/relu2.py gives the math): a = max(h, 0)^2 (a may be h: in place) and, in place, dh *= 2 sqrt(a), the
backward reading the output a, two elementwise passes in fp32 over contiguous arrays of any shape, and the device
functions relu2 and relu2_grad they share with the GEMM tiles' epilogues (kernels/tile.py's act_of, act_grad: gemm.py's
k_gemm_act, k_gemm_dact and gemm_tma.py's). The slope sqrt(a) is rounded to a's dtype, which gives max(h, 0) back
exactly wherever a is a normal number (ops/relu2.py; relu2_grad says which root). fp8's cast computes the
derivative from h instead, by its own op (fp8_cast.py RELU2_GRAD): these read a only.

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
def relu2_grad(a):
    # relu2'(h) from a = relu2(h) as stored (its dtype): 2 sqrt(a), the root rounded to a's dtype = 2 max(h, 0). In
    # 16 bits the fast root (sqrt.approx: a few units in fp32's last place) rounds as the exact one: a's exact root
    # lies at least 2^-10.1 (bf16), 2^-13.2 (fp16) from a rounding boundary, relatively, and the IEEE root (sqrt_rn)
    # spills k_gemm_dact_tma's 128x256 tile; fp32 takes the IEEE root, which is max(h, 0) itself
    if a.dtype == tl.float32:
        r = tl.sqrt_rn(a)
    else:
        r = tl.sqrt(a.to(tl.float32)).to(a.dtype).to(tl.float32)
    return 2.0 * r


@triton.jit
def k_relu2_fwd(a_ptr, h_ptr, n, BLOCK: tl.constexpr):
    # a, h: (n,); a = max(h, 0)^2
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + offs, mask=mask).to(tl.float32)
    tl.store(a_ptr + offs, relu2(h).to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_relu2_bwd(dh_ptr, a_ptr, n, BLOCK: tl.constexpr):
    # dh, a: (n,); in: dh holds the gradient reaching a = relu2(h); out: dh = dh * 2 sqrt(a)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask)
    da = tl.load(dh_ptr + offs, mask=mask).to(tl.float32)
    tl.store(dh_ptr + offs, (da * relu2_grad(a)).to(dh_ptr.dtype.element_ty), mask=mask)


def relu2_forward(a: torch.Tensor, h: torch.Tensor) -> None:
    """a = max(h, 0)^2, one pass (any shape, contiguous; a may be h)."""
    n = h.numel()
    k_relu2_fwd[(triton.cdiv(n, BLOCK),)](a, h, n, BLOCK=BLOCK, num_warps=4)


def relu2_backward(dh: torch.Tensor, a: torch.Tensor) -> None:
    """dh *= 2 sqrt(a) in place (= 2 max(h, 0)), one pass over a and dh."""
    n = a.numel()
    k_relu2_bwd[(triton.cdiv(n, BLOCK),)](dh, a, n, BLOCK=BLOCK, num_warps=4)
