"""GELU (tanh approximation, as GPT-2) and its derivative: Triton device functions, in fp32, and the two elementwise
passes the MLP's GEMMs run around them (k_gelu_fwd, k_gelu_bwd). The passes (gemm.py's GELU epilogue choice, the
GEMM sites of linear.py) and the FP8 casts that compute their operand on the way (fp8_cast.py) share the functions.
ops/mlp.py gives the math.

    gelu(h)  = 0.5 h (1 + t),  t = tanh(u),  u = sqrt(2/pi) (h + 0.044715 h^3)
    gelu'(h) = 0.5 (1 + t) + 0.5 h (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 h^2)
"""

import torch
import triton
import triton.language as tl

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def tanh(u):
    # through exp: saturates cleanly to +-1 (exp overflows to inf, 2/inf = 0)
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def gelu(h):
    t = tanh(SQRT_2_OVER_PI * (h + 0.044715 * h * h * h))
    return 0.5 * h * (1.0 + t)


@triton.jit
def gelu_grad(h):
    t = tanh(SQRT_2_OVER_PI * (h + 0.044715 * h * h * h))
    return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * h * h)


BLOCK = 2048  # elements a program of the passes


@triton.jit
def k_gelu_fwd(a_ptr, h_ptr, n, BLOCK: tl.constexpr):
    # a, h: (n,); a = gelu(h)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + offs, mask=mask).to(tl.float32)
    tl.store(a_ptr + offs, gelu(h).to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_gelu_bwd(dh_ptr, h_ptr, n, BLOCK: tl.constexpr):
    # dh, h: (n,); in: dh holds the gradient reaching gelu(h); out: dh = dh * gelu'(h)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + offs, mask=mask).to(tl.float32)
    da = tl.load(dh_ptr + offs, mask=mask).to(tl.float32)
    tl.store(dh_ptr + offs, (da * gelu_grad(h)).to(dh_ptr.dtype.element_ty), mask=mask)


def gelu_forward(a: torch.Tensor, h: torch.Tensor) -> None:
    """a = gelu(h), one pass (any shape, contiguous)."""
    n = h.numel()
    k_gelu_fwd[(triton.cdiv(n, BLOCK),)](a, h, n, BLOCK=BLOCK)


def gelu_backward(dh: torch.Tensor, h: torch.Tensor) -> None:
    """dh *= gelu'(h) in place, one pass over h and dh."""
    n = h.numel()
    k_gelu_bwd[(triton.cdiv(n, BLOCK),)](dh, h, n, BLOCK=BLOCK)
