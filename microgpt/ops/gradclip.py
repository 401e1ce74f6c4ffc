"""The global gradient norm over the flat gradient array, as torch.nn.utils.clip_grad_norm_ computes it.

    partials[i] = sum(g[i*block:(i+1)*block] ** 2)      i < P = ceil(n / block)
    norm        = sqrt(sum(partials))

Shapes: g (n,), flat over all parameters; partials (P,); norm (1,).
The norm is reduced in two fixed passes (per-block partial sums, then their sum) so the GPU kernels
can do the same without atomics and the result does not depend on scheduling: deterministic.
The clip itself, min(1, max_norm / (norm + 1e-6)), is applied inside the optimizers (microgpt/ops/adamw.py,
microgpt/ops/muon.py) as they read the gradients (clip_factor), so the gradients are read once more, not twice.
Nothing is saved; there is no backward.
"""

import math

import numpy as np
from numpy.typing import NDArray


def grad_norm_partial(partials: NDArray, g: NDArray, block: int) -> None:
    """partials (ceil(n/block),) = sum of squares of each block of g (n,); the last block may be short."""
    n_full = g.shape[0] // block
    full = g[: n_full * block].reshape(n_full, block)
    np.einsum("ij,ij->i", full, full, out=partials[:n_full])
    if n_full < partials.shape[0]:
        tail = g[n_full * block :]
        partials[n_full] = np.dot(tail, tail)


def grad_norm_final(norm: NDArray, partials: NDArray) -> None:
    """norm (1,) = sqrt(sum(partials))."""
    norm[0] = math.sqrt(partials.sum())


def clip_factor(norm: NDArray, gscale: np.floating, max_norm: float) -> np.floating | None:
    """What an optimizer multiplies the raw gradient sums by, in gscale's dtype: gscale * min(1, max_norm / (total +
    1e-6)), total = norm[0] * gscale the global norm of the mean gradient (gscale = 1 / (count * world *
    loss_scale); max_norm inf: no clip). None where total is not finite (an fp16 overflow, or the warm-up step's inf
    gscale): the step is skipped."""
    dt = type(gscale)
    total = dt(norm[0]) * gscale
    if not np.isfinite(total):
        return None
    return gscale * min(dt(1), dt(max_norm) / (total + dt(1e-6)))
