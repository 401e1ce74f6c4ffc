"""ReLU^2, the modern block's MLP activation (issue 46): a = max(h, 0)^2, elementwise.

    relu2(h)  = max(h, 0)^2
    relu2'(h) = 2 max(h, 0)

Shapes: h, a, dh (N, ...), one shape. The backward reads h only, so the MLP must keep h (W_1's output); a it may keep
for W_2's backward or recompute from h (one max and one multiply), as the GPT-2 MLP does GELU's. Backward turns dh in
place from the gradient reaching a into the gradient reaching h, dh *= 2 max(h, 0), as GELU's backward does: W_2's
input-gradient GEMM writes dh, this pass rewrites it, W_1's backward reads it.

Arithmetic in the arrays' dtype, range of rows by range of rows (ops/rows.py), like GELU's passes.
"""

import numpy as np
from numpy.typing import NDArray

from microgpt.ops.rows import SERIAL, Rows


def relu2_forward(a: NDArray, h: NDArray, rows: Rows = SERIAL) -> None:
    """a = max(h, 0)^2."""
    rows.map(_forward, a, h)


def relu2_backward(dh: NDArray, h: NDArray, rows: Rows = SERIAL) -> None:
    """dh *= 2 max(h, 0) in place (dh holds the gradient reaching relu2(h))."""
    rows.map(_backward, dh, h)


def _forward(a: NDArray, h: NDArray) -> None:
    np.maximum(h, 0, out=a)
    a *= a


def _backward(dh: NDArray, h: NDArray) -> None:
    slope = np.maximum(h, 0)
    slope *= 2
    dh *= slope
