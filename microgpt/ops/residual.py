"""Residual add.

    out = x + y

Shapes: x, y, out all the same (usually (B,T,C)). Forward saves nothing: the sum's gradient does
not depend on its inputs.

Backward sends dout unchanged to both branches:

    dx += dout ; dy += dout
"""

import numpy as np
from numpy.typing import NDArray


def residual_forward(out: NDArray, x: NDArray, y: NDArray) -> None:
    """out = x + y."""
    np.add(x, y, out=out)


def residual_backward(dx: NDArray, dy: NDArray, dout: NDArray) -> None:
    """dx += dout ; dy += dout."""
    dx += dout
    dy += dout
