"""The U-net skip connection of the modern block (model.skips): a residual stream kept from an early layer, added to
a late layer's input times a learned scalar.

    y = x + w * s            x, s, y (N,C); w (1,): one scalar parameter (a view of params' skip_w)

y may be x (the model adds in place, into the late layer's input). Forward saves nothing: backward needs s, which the
model keeps anyway (the early layer's output, a saved activation in training), and dy.

Backward, with dy the gradient reaching y:

    dx  = dy                 passed through: the caller's dy buffer is dx (the residual add's rule, engine/model.py)
    ds += w * dy             the gradient reaching the kept stream (ds may be dy itself: s = x, nothing between)
    dw += sum(dy * s)        over every element: one scalar

Both are added (+=), as every backward's are: the model adds ds straight into the residual stream's gradient where
the kept stream was made. The reduction for dw sums each row first and then the N row sums (NumPy's pairwise sum), on
one thread whatever the backend's thread count: the same bits on any machine with the same inputs (BLAS's dot would
split by threads). The Triton pair reduces in a fixed order too (per-program partial sums, then one program adds
them), so neither depends on timing.
"""

import numpy as np
from numpy.typing import NDArray


def skip_forward(y: NDArray, x: NDArray, s: NDArray, w: NDArray) -> None:
    """y (N,C) = x + w[0] * s; y may be x."""
    np.add(x, w[0] * s, out=y)


def skip_backward(ds: NDArray, dw: NDArray, dy: NDArray, s: NDArray, w: NDArray) -> None:
    """dw (1,) += sum(dy * s); then ds (N,C) += w[0] * dy (ds may be dy: dw reads dy first)."""
    C = s.shape[-1]
    dw += np.einsum("nc,nc->n", dy.reshape(-1, C), s.reshape(-1, C)).sum()
    ds += w[0] * dy
