"""Linear layer without bias; the weight is stored [in, out] so forward is a plain matmul.

    out = x @ w

Shapes: x (N,C), w (C,OC), out (N,OC).
Forward saves nothing of its own: backward needs x, which is the previous op's output and is kept
by the caller anyway.

Backward:

    dx += dout @ w.T      (N,C)
    dw += x.T @ dout      (C,OC)
"""

import numpy as np
from numpy.typing import NDArray


def linear_forward(out: NDArray, x: NDArray, w: NDArray) -> None:
    """out (N,OC) = x (N,C) @ w (C,OC)."""
    np.matmul(x, w, out=out)


def linear_backward(dx: NDArray, dw: NDArray, dout: NDArray, x: NDArray, w: NDArray) -> None:
    """dx (N,C) += dout @ w.T ; dw (C,OC) += x.T @ dout."""
    dx += dout @ w.T
    dw += x.T @ dout
