"""RMSNorm over the last axis, without a weight (the modern block's norm, issue 46), eps = 1e-6.

    rstd = 1 / sqrt((x^2).mean(1) + eps)      (N,)
    out  = x * rstd                           (N,C)

Shapes: x, out (N,C); rstd (N,).
Forward saves rstd (one float a row). Backward recomputes xhat = x * rstd from x rather than storing it: storing
xhat would cost a whole (N,C) activation per norm, and x is kept anyway (it is the residual stream).

Backward, with g = dout (the gradient reaching out; there is no weight):

    dx += rstd * (g - xhat * (g * xhat).mean(1))

the derivative through the row's mean square. dx is added to (+=), as layernorm_backward's is: the model folds the
residual add's backward into the residual stream's one gradient buffer (microgpt/engine/model.py).

residual_rmsnorm_forward is the residual add and the RMSNorm that reads its sum in one call: s = x + y, then
out = rmsnorm(s) (the GPU kernel makes one pass over the rows; the sum is not read back). Its backward is
rmsnorm_backward on s; the add's backward is folded into the residual stream's gradient.

Every row is normalized on its own, so every pass runs range of rows by range of rows (ops/rows.py: one range a
thread, as its rows are short, like LayerNorm's). Without a weight nothing is summed over the rows.
"""

import numpy as np
from numpy.typing import NDArray

from microgpt.ops.rows import SERIAL, Rows

EPS = 1e-6


def rmsnorm_forward(out: NDArray, rstd: NDArray, x: NDArray, *, rows: Rows = SERIAL) -> None:
    """out (N,C) = rmsnorm(x); writes rstd (N,) for backward."""
    rows.map(_forward, out, rstd, x, per_thread=True)


def residual_rmsnorm_forward(
    s: NDArray, out: NDArray, rstd: NDArray, x: NDArray, y: NDArray, *, rows: Rows = SERIAL
) -> None:
    """s (N,C) = x + y, then out = rmsnorm(s); writes rstd (N,) for backward."""

    def one(s: NDArray, out: NDArray, rstd: NDArray, x: NDArray, y: NDArray) -> None:
        np.add(x, y, out=s)
        _forward(out, rstd, s)

    rows.map(one, s, out, rstd, x, y, per_thread=True)


def _forward(out: NDArray, rstd: NDArray, x: NDArray) -> None:
    """The forward of the rows of x."""
    C = x.shape[1]
    ms = np.einsum("nc,nc->n", x, x)  # (n,) the rows' sums of squares
    ms /= C
    ms += EPS
    np.sqrt(ms, out=rstd)
    np.reciprocal(rstd, out=rstd)
    np.multiply(x, rstd[:, None], out=out)


def rmsnorm_backward(dx: NDArray, dout: NDArray, x: NDArray, rstd: NDArray, *, rows: Rows = SERIAL) -> None:
    """dx (N,C) += gradient of rmsnorm, given dout (N,C), x (N,C) and the forward's rstd (N,)."""
    rows.map(_backward, dx, dout, x, rstd, per_thread=True)


def _backward(dx: NDArray, dout: NDArray, x: NDArray, rstd: NDArray) -> None:
    """dx += the input gradient of the rows of x."""
    C = x.shape[1]
    xhat = x * rstd[:, None]  # recomputed, see the module docstring
    gx_mean = np.einsum("nc,nc->n", dout, xhat) / C  # (n,)
    xhat *= gx_mean[:, None]
    g = dout - xhat
    g *= rstd[:, None]
    dx += g
