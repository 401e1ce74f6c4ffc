"""MLP block: two bias-free linears with GELU (tanh approximation, as GPT-2) between them.

    h   = x @ w1                             (N,4C)  pre-activation, saved
    a   = gelu(h)                            (N,4C)  saved (or, train.recompute_gelu, scratch)
    out = a @ w2                             (N,C)
    gelu(h) = 0.5 h (1 + tanh(u)),  u = sqrt(2/pi) (h + 0.044715 h^3)

Shapes: x, out (N,C); w1 (C,4C); w2 (4C,C); h, a, dh (N,4C).
Forward saves h and a (memory.gelu_output_saved). With train.recompute_gelu it saves h only and backward
recomputes a = gelu(h) into a scratch: one (N,4C) activation less per layer, one elementwise pass more.

Backward, with t = tanh(u):

    dw2 += a.T @ dout
    dh   = (dout @ w2.T) * gelu'(h)
    gelu'(h) = 0.5 (1 + t) + 0.5 h (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 h^2)
             = 0.5 (1 + t) [1 + (1 - t) h sqrt(2/pi) (1 + 3 * 0.044715 h^2)]    (factored: 1 - t^2 = (1-t)(1+t))
    dw1 += x.T @ dh
    dx   = dh @ w1.T                         (written: this backward is dx's only writer)

With Fp8Weights (precision "fp8") the six GEMMs run on E4M3 operands (microgpt/fp8.py, ops/fp8.py): x and
a = gelu(h) are cast as the GEMMs' inputs (in fp32, from fp32 h: the GPU casts gelu(h) as it computes it, with no
stored copy), dout and dh = da * gelu'(h) as output gradients (dh likewise cast as computed). The backward casts
x and a again at their forward scales (the GPU keeps the forward's transposed E4M3 copies instead).
"""

import math

import numpy as np
from numpy.typing import NDArray

from microgpt.fp8 import INV, Fp8Weight
from microgpt.ops import fp8

GELU_K = math.sqrt(2.0 / math.pi)
GELU_C = 0.044715


def _gelu(out: NDArray, h: NDArray) -> None:
    """out = gelu(h), built up in place in out."""
    np.multiply(h, h, out=out)
    out *= h
    out *= GELU_C
    out += h
    out *= GELU_K  # out = u
    np.tanh(out, out=out)
    out += 1.0
    out *= h
    out *= 0.5


def _gelu_backward(dh: NDArray, h: NDArray, t: NDArray) -> None:
    """dh *= gelu'(h) in place; t is scratch (N,4C), overwritten."""
    np.multiply(h, h, out=t)
    t *= GELU_C
    t += 1.0
    t *= h
    t *= GELU_K  # t = u, the argument of tanh
    np.tanh(t, out=t)
    inner = h * h  # the one (N,4C) temporary: h sqrt(2/pi) (1 + 3c h^2)
    inner *= 3.0 * GELU_C
    inner += 1.0
    inner *= h
    inner *= GELU_K
    np.subtract(1.0, t, out=t)  # t = 1 - tanh(u)
    inner *= t
    inner += 1.0
    np.subtract(2.0, t, out=t)  # t = 1 + tanh(u)
    inner *= t
    inner *= 0.5
    dh *= inner


def mlp_forward(out: NDArray, h: NDArray, a: NDArray, x: NDArray, w1: NDArray | Fp8Weight,
                w2: NDArray | Fp8Weight) -> None:  # fmt: skip
    """out (N,C) = gelu(x @ w1) @ w2; writes h (N,4C) for backward, uses a (N,4C) as scratch."""
    if isinstance(w1, Fp8Weight) and isinstance(w2, Fp8Weight):
        h[...] = fp8.mm8(*fp8.cast(x, w1.xslot, current=w1.priming.on), w1.w8t[0].T, w1.scale[INV])
        _gelu(a, h)
        out[...] = fp8.mm8(*fp8.cast(a, w2.xslot, current=w2.priming.on), w2.w8t[0].T, w2.scale[INV])
        return
    np.matmul(x, w1, out=h)
    _gelu(a, h)
    np.matmul(a, w2, out=out)


def mlp_backward(
    dx: NDArray,
    dw1: NDArray,
    dw2: NDArray,
    dout: NDArray,
    x: NDArray,
    h: NDArray,
    w1: NDArray,
    w2: NDArray,
    a: NDArray,
    dh: NDArray,
    *,
    recompute: bool,
) -> None:
    """dx (N,C) = the input gradient; dw1 (C,4C), dw2 (4C,C) += theirs; dh (N,4C) is scratch. a (N,4C) is the
    forward's gelu(h), or with recompute a scratch this call fills with it first; either way this call overwrites a
    (its last reader) with temporaries."""
    if recompute:
        _gelu(a, h)
    if isinstance(w1, Fp8Weight) and isinstance(w2, Fp8Weight):
        dy8, idy = fp8.cast(dout, w2.gslot, current=w2.priming.on)
        a8, ia = fp8.recast(a, w2.xslot)
        dw2 += fp8.mm8(a8.T, ia, dy8, idy)
        dh[...] = fp8.mm8(dy8, idy, w2.w8.T, w2.scale[INV])
        _gelu_backward(dh, h, a)
        dh8, idh = fp8.cast(dh, w1.gslot, current=w1.priming.on)
        x8, ix = fp8.recast(x, w1.xslot)
        dw1 += fp8.mm8(x8.T, ix, dh8, idh)
        dx[...] = fp8.mm8(dh8, idh, w1.w8.T, w1.scale[INV])
        return
    dw2 += a.T @ dout
    np.matmul(dout, w2.T, out=dh)  # gradient reaching a
    _gelu_backward(dh, h, a)  # a is free again once dw2 is done
    dw1 += x.T @ dh
    np.matmul(dh, w1.T, out=dx)
