"""GELU, tanh approximation (as GPT-2): the MLP's activation, which the GEMM sites around it apply (ops/linear.py:
an epilogue of W_1's forward and a prologue of W_1's backward; ops/fp8.py likewise before its casts).

    gelu(h)  = 0.5 h (1 + t),  t = tanh(u),  u = sqrt(2/pi) (h + 0.044715 h^3)
    gelu'(h) = 0.5 (1 + t) + 0.5 h (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 h^2)
             = 0.5 (1 + t) [1 + (1 - t) h sqrt(2/pi) (1 + 3 * 0.044715 h^2)]    (factored: 1 - t^2 = (1-t)(1+t))

Shapes: h, out, dh (N, ...), one shape. Arithmetic in the arrays' dtype, in place where it can be, range of rows by
range of rows (ops/rows.py: the passes over one range stay in cache; several threads take a range each).
"""

import math

import numpy as np
from numpy.typing import NDArray

from microgpt.ops.rows import SERIAL, Rows

GELU_K = math.sqrt(2.0 / math.pi)
GELU_C = 0.044715


def gelu(out: NDArray, h: NDArray, rows: Rows = SERIAL) -> None:
    """out = gelu(h), range of rows by range of rows."""
    rows.map(_gelu, out, h)


def gelu_backward(dh: NDArray, h: NDArray, rows: Rows = SERIAL) -> None:
    """dh *= gelu'(h) in place (dh holds the gradient reaching gelu(h)), range of rows by range of rows."""
    rows.map(_gelu_backward, dh, h)


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


def _gelu_backward(dh: NDArray, h: NDArray) -> None:
    """dh *= gelu'(h) in place; two temporaries of h's shape (h^2 serves both factors)."""
    inner = np.multiply(h, h)
    t = inner * GELU_C
    t += 1.0
    t *= h
    t *= GELU_K  # t = u, the argument of tanh
    np.tanh(t, out=t)
    inner *= 3.0 * GELU_C  # h sqrt(2/pi) (1 + 3c h^2)
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
