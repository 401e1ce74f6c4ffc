"""ReLU^2, the modern block's MLP activation (issue 46): a = max(h, 0)^2, elementwise.

    relu2(h)  = max(h, 0)^2
    relu2'(h) = 2 max(h, 0) = 2 sqrt(a)

Shapes: h, a, dh (N, ...), one shape. The backward reads the output a, not h (issue 53): max(h, 0) = sqrt(a), so the
MLP keeps a alone for both W_2's weight gradient and this backward, and h need never be stored (the forward may write
a over h, in place: relu2_forward(a, a)). Backward turns dh in place from the gradient reaching a into the gradient
reaching h, dh *= 2 sqrt(a), as GELU's backward does: W_2's input-gradient GEMM writes dh, this pass rewrites it,
W_1's backward reads it. relu2_backward_h is the same derivative read from h, dh *= 2 max(h, 0), for fp8, whose cast
of W_1's output gradient computes it from h (ops/fp8.py's dact_of; kernels/fp8_cast.py RELU2_GRAD): fp8 keeps h.

Rounding. The slope sqrt(a) is rounded to the arrays' dtype before it is doubled, and then it is max(h, 0) exactly
wherever a is a normal number of that dtype: a = r^2 rounded to nearest, its square root rounded to nearest is r
again (r = max(h, 0) as stored; the GPU computes the root in fp32 and rounds it to a's dtype, checked over every bf16
and fp16 value). So this backward is dh *= 2 max(h, 0) bit for bit: in bf16 and fp32 for r in [2^-63, 2^64) (below,
a is a subnormal or zero; above, inf, as the forward's output then is); in fp16 for r in [2^-7, 256): below 2^-7 a
is an fp16 subnormal and the slope errs by at most 2^-11.5 absolutely (it is 0 under 2^-12.5), and from 256 up a is
inf, which the forward's output already is there (fp16's loss scale then skips the step).

Arithmetic in the arrays' dtype, range of rows by range of rows (ops/rows.py), like GELU's passes.
"""

import numpy as np
from numpy.typing import NDArray

from microgpt.ops.rows import SERIAL, Rows


def relu2_forward(a: NDArray, h: NDArray, rows: Rows = SERIAL) -> None:
    """a = max(h, 0)^2 (a may be h itself: the activation written over its input)."""
    rows.map(_forward, a, h)


def relu2_backward(dh: NDArray, a: NDArray, rows: Rows = SERIAL) -> None:
    """dh *= 2 sqrt(a) in place (dh holds the gradient reaching a = relu2(h); sqrt(a) = max(h, 0))."""
    rows.map(_backward, dh, a)


def relu2_backward_h(dh: NDArray, h: NDArray, rows: Rows = SERIAL) -> None:
    """dh *= 2 max(h, 0) in place: the derivative from h, where fp8's cast computes it (the module docstring)."""
    rows.map(_backward_h, dh, h)


def _forward(a: NDArray, h: NDArray) -> None:
    np.maximum(h, 0, out=a)
    a *= a


def _backward(dh: NDArray, a: NDArray) -> None:
    slope = np.sqrt(a)
    slope *= 2
    dh *= slope


def _backward_h(dh: NDArray, h: NDArray) -> None:
    slope = np.maximum(h, 0)
    slope *= 2
    dh *= slope
