"""LayerNorm over the last axis, as torch.nn.LayerNorm (biased variance, eps = 1e-5).

    mean = x.mean(1)                          (N,)
    rstd = 1 / sqrt(((x - mean)^2).mean(1) + eps)   (N,)
    xhat = (x - mean) * rstd                  (N,C)
    out  = xhat * w + b                       (N,C)

Shapes: x, out (N,C); w, b (C,); mean, rstd (N,).
Forward saves mean and rstd (two floats per row). Backward recomputes xhat from x, mean and rstd
rather than storing it: storing xhat would cost a whole (N,C) activation per layernorm.

Backward, with g = dout * w (the gradient reaching xhat):

    db += dout.sum(0)
    dw += (dout * xhat).sum(0)
    dx += rstd * (g - g.mean(1) - xhat * (g * xhat).mean(1))

The last line is the derivative through both the mean and the variance of the row.

residual_layernorm_forward is the residual add and the LayerNorm that reads its sum,
in one call: s = x + y, then out = layernorm(s). The model calls it at every LayerNorm after the first, where the
residual stream's next value is made; the GPU kernel does both in one pass over the rows (the sum is not read
back). Its backward needs nothing of its own: the add's backward is folded into the residual stream's gradient
(microgpt/engine/model.py), the LayerNorm's is layernorm_backward on s.

Every row is normalized on its own, so the passes run range of rows by range of rows (ops/rows.py: one range a
thread, as its rows are short); the sums over the rows in backward (dw, db) run once over the whole arrays, in one
order. A row mean is np.add.reduce, then / C: np.mean's own bits, without its Python wrapper, which holds the GIL.
"""

import numpy as np
from numpy.typing import NDArray

from microgpt.ops.rows import SERIAL, Rows

EPS = 1e-5


def layernorm_forward(
    out: NDArray, mean: NDArray, rstd: NDArray, x: NDArray, w: NDArray, b: NDArray, *, rows: Rows = SERIAL
) -> None:
    """out (N,C) = layernorm(x) * w + b; writes mean, rstd (N,) for backward."""
    rows.map(lambda out, mean, rstd, x: _forward(out, mean, rstd, x, w, b), out, mean, rstd, x, per_thread=True)


def residual_layernorm_forward(
    s: NDArray,
    out: NDArray,
    mean: NDArray,
    rstd: NDArray,
    x: NDArray,
    y: NDArray,
    w: NDArray,
    b: NDArray,
    *,
    rows: Rows = SERIAL,
) -> None:
    """s (N,C) = x + y, then out = layernorm(s) * w + b; writes mean, rstd (N,) for backward."""

    def one(s: NDArray, out: NDArray, mean: NDArray, rstd: NDArray, x: NDArray, y: NDArray) -> None:
        np.add(x, y, out=s)
        _forward(out, mean, rstd, s, w, b)

    rows.map(one, s, out, mean, rstd, x, y, per_thread=True)


def _forward(out: NDArray, mean: NDArray, rstd: NDArray, x: NDArray, w: NDArray, b: NDArray) -> None:
    """The forward of the rows of x."""
    C = x.shape[1]
    _row_mean(mean, x)
    np.subtract(x, mean[:, None], out=out)  # out holds x - mean for now
    var = np.einsum("nc,nc->n", out, out) / C  # two-pass variance: no cancellation from E[x^2] - E[x]^2
    np.sqrt(var + EPS, out=rstd)
    np.reciprocal(rstd, out=rstd)
    out *= rstd[:, None]  # out = xhat
    out *= w
    out += b


def layernorm_backward(
    dx: NDArray,
    dw: NDArray,
    db: NDArray,
    dout: NDArray,
    x: NDArray,
    w: NDArray,
    mean: NDArray,
    rstd: NDArray,
    *,
    rows: Rows = SERIAL,
) -> None:
    """dx (N,C), dw (C,), db (C,) += gradients of layernorm, given dout (N,C)."""
    C = x.shape[1]
    xhat = np.empty_like(x)  # recomputed, see the module docstring

    def normalize(xhat: NDArray, x: NDArray, mean: NDArray, rstd: NDArray) -> None:
        np.subtract(x, mean[:, None], out=xhat)
        xhat *= rstd[:, None]

    def input_grad(dx: NDArray, dout: NDArray, xhat: NDArray, rstd: NDArray) -> None:
        g = dout * w  # gradient with respect to xhat
        g_mean = _row_mean(np.empty(len(g), g.dtype), g)  # (N,)
        gx_mean = np.einsum("nc,nc->n", g, xhat) / C  # (N,)
        g -= g_mean[:, None]
        xhat *= gx_mean[:, None]
        g -= xhat
        g *= rstd[:, None]
        dx += g

    rows.map(normalize, xhat, x, mean, rstd, per_thread=True)
    db += dout.sum(axis=0)
    dw += np.einsum("nc,nc->c", dout, xhat)
    rows.map(input_grad, dx, dout, xhat, rstd, per_thread=True)


def _row_mean(mean: NDArray, x: NDArray) -> NDArray:
    """mean (N,) = x.mean(1), written into mean, which it returns."""
    np.add.reduce(x, axis=1, out=mean)
    np.divide(mean, x.shape[1], out=mean)
    return mean
