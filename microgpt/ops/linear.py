"""Linear layer without bias; the weight is stored [in, out] so forward is a plain matmul.

    out = x @ w

Shapes: x (N,C), w (C,OC), out (N,OC). The attention's input projection is one linear of G = 3 weights:
w (G,C,OC), out (G,N,OC), out[g] = x @ w[g].
Forward saves nothing of its own: backward needs x, which is the previous op's output and is kept
by the caller anyway.

Backward:

    dx  = dout @ w.T      (N,C)     written: this backward is dx's only writer (G > 1: the sum over g)
    dw += x.T @ dout      (C,OC)    added: weight gradients accumulate over micro-batches

With an Fp8Weight (precision "fp8") the same three GEMMs run on E4M3 operands (microgpt/fp8.py, ops/fp8.py).
"""

import numpy as np
from numpy.typing import NDArray

from microgpt.fp8 import INV, Fp8Weight
from microgpt.ops import fp8


def linear_forward(out: NDArray, x: NDArray, w: NDArray | Fp8Weight) -> None:
    """out (N,OC) = x (N,C) @ w (C,OC); out (G,N,OC) = x @ w[g] for w (G,C,OC)."""
    if isinstance(w, Fp8Weight):
        G = w.master.shape[0]
        x8, ix = fp8.cast(x, w.xslot, current=w.priming.on)
        for g in range(G):
            (out if G == 1 else out[g])[...] = fp8.mm8(x8, ix, w.w8t[g].T, w.scale[INV])
        return
    np.matmul(x, w, out=out)


def linear_backward(dx: NDArray, dw: NDArray, dout: NDArray, x: NDArray, w: NDArray | Fp8Weight) -> None:
    """dx (N,C) = dout @ w.T ; dw (C,OC) += x.T @ dout. With G weights: dx = sum_g dout[g] @ w[g].T, dw[g] +=."""
    if isinstance(w, Fp8Weight):
        G, _, OC = w.master.shape
        # (N, G*OC), one scale: the input gradient is one GEMM over K = G*OC
        dy8, idy = fp8.cast(fp8.groups(dout, G), w.gslot, current=w.priming.on)
        dx[...] = fp8.mm8(dy8, idy, w.w8.T, w.scale[INV])
        x8, ix = fp8.recast(x, w.xslot)  # the forward's operand again (the GPU keeps its transposed copy)
        for g in range(G):
            (dw if G == 1 else dw[g])[...] += fp8.mm8(x8.T, ix, dy8[:, g * OC : (g + 1) * OC], idy)
        return
    if w.ndim == 2:
        np.matmul(dout, w.T, out=dx)
        dw += x.T @ dout
        return
    np.matmul(dout[0], w[0].T, out=dx)
    for g in range(1, w.shape[0]):
        dx += dout[g] @ w[g].T
    for g in range(w.shape[0]):
        dw[g] += x.T @ dout[g]
