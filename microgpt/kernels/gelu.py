"""GELU (tanh approximation, as GPT-2) and its derivative, as Triton device functions, in fp32: the MLP's kernels
(mlp.py) and the FP8 casts that compute their operand on the way (fp8.py) share them. ops/mlp.py gives the math.

    gelu(h)  = 0.5 h (1 + t),  t = tanh(u),  u = sqrt(2/pi) (h + 0.044715 h^3)
    gelu'(h) = 0.5 (1 + t) + 0.5 h (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 h^2)
"""

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
