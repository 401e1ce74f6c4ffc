"""AdamW over the flat parameter array, with torch.optim.AdamW semantics, taking the step's gradient scale and clip.

The optimizer step (microgpt/engine/step.py) sums the gradients of all micro-batches (and ranks), takes the norm of that
raw sum, and leaves scaling and clipping to this function, so the GPU does it inside the same pass. `hyper` holds
the values that change every step, written by the host before the step runs:

    hyper = [lr, bias1 = 1 - beta1^t, bias2 = 1 - beta2^t, gscale = 1 / (n_micro * world * loss_scale)]

For every element (decay only where decay_mask is 1: the 2-D weights):

    total = norm * gscale                                 the global norm of the mean gradient
    g     = g * gscale * min(1, max_norm / (total + 1e-6))   clip_grad_norm_'s factor (max_norm inf: no clip)
    p    -= lr * weight_decay * decay_mask * p           decoupled weight decay, before the update
    m     = beta1 * m + (1 - beta1) * g
    v     = beta2 * v + (1 - beta2) * g^2
    p    -= lr * (m / bias1) / (sqrt(v / bias2) + eps)
    p_compute = p (rounded to the compute dtype), g = 0

A non-finite total (an fp16 overflow, or the warm-up step, which sets gscale to inf) leaves p, m and v untouched:
the loss scaler lowers the scale and the next step redoes the work. The gradients are zeroed either way.
Arithmetic is in the arrays' dtype (float32; float64 in the gradient checks), in the Triton kernel's order.
Shapes: p, g, m, v, decay_mask, p_compute all (n,), flat over all parameters in the canonical order; norm (1,).
m and v are the optimizer state (kept between steps, saved in checkpoints).
"""

import numpy as np
from numpy.typing import NDArray

from microgpt.ops.rows import SERIAL, Rows


def adamw_step(
    p: NDArray,
    g: NDArray,
    m: NDArray,
    v: NDArray,
    decay_mask: NDArray,
    p_compute: NDArray | None,
    hyper: NDArray,
    norm: NDArray,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    max_norm: float,
    *,
    rows: Rows = SERIAL,
) -> None:
    """One AdamW step in place on p, m, v (and p_compute), reading g; leaves g zeroed. Element by element, so it
    runs over ranges of the flat arrays (ops/rows.py)."""
    dt = p.dtype.type
    lr, bias1, bias2, gscale = (dt(x) for x in hyper[:4])
    total = dt(norm[0]) * gscale
    if not np.isfinite(total):
        g.fill(0)
        return
    clip = gscale * min(dt(1), dt(max_norm) / (total + dt(1e-6)))
    b1, b2 = dt(beta1), dt(beta2)

    def update(i: int, j: int) -> None:
        pr, gr, mr, vr = p[i:j], g[i:j], m[i:j], v[i:j]
        gr *= clip
        pr -= lr * dt(weight_decay) * decay_mask[i:j] * pr
        mr *= b1
        mr += (dt(1) - b1) * gr
        vr *= b2
        vr += (dt(1) - b2) * gr * gr
        pr -= lr * (mr / bias1) / (np.sqrt(vr / bias2) + dt(eps))
        if p_compute is not None:
            p_compute[i:j] = pr
        gr.fill(0)

    rows.run(update, len(p))
