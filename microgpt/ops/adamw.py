"""AdamW over the flat parameter array, with torch.optim.AdamW semantics, taking the step's gradient scale and clip.

The optimizer step (microgpt/engine/step.py) sums the gradients of all micro-batches (and ranks), takes the norm of that
raw sum, and leaves scaling and clipping to this function, so the GPU does it inside the same pass. `hyper` holds
the values that change every step, written by the host before the step runs:

    hyper = [lr, bias1 = 1 - beta1^t, bias2 = 1 - beta2^t, gscale = 1 / (count * world * loss_scale)]

(count: the step's micro-batches, train.n_micro or fewer in a batch warmup's first steps)

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

Segment maxima, on request: given disjoint segments of the flat array (weights: (start, end) each), the step can
also record each segment's finite max |p| as it stores p (updated, or as it was where the step is skipped):

    segment_max[j] = max(segment_max[j], max |p[start_j:end_j]| over its finite elements)

so that whoever reads the new weights' magnitudes next (a precision that scales its copies of the weights by them)
needs no pass of its own. The segments come as `segment_table` (per block of SEGMENT_BLOCK elements: which
segment holds its first elements and which its last), the layout the GPU's one program per block reads; the
backend's caller asks for it (engine/precision.py), and without it the step records nothing.
"""

import numpy as np
from numpy.typing import NDArray

from microgpt.ops.gradclip import clip_factor
from microgpt.ops.rows import SERIAL, Rows

SEGMENT_BLOCK = 2048  # elements of a row of the segment table (and of a GPU program recording segment maxima)
F32_MAX = 3.4028234663852886e38


def segment_table_of(segments: list[tuple[int, int]], n: int, block: int = SEGMENT_BLOCK) -> NDArray | None:
    """Where each segment of a flat array of n elements lies, block by block: segments[j] = (start, end), in order
    and disjoint. Per block of `block` elements, int32 [a, end_a, b, start_b]: the segment holding the block's first
    element (-1: none) and where it ends in the block; the segment holding its last element if another (-1: none)
    and where it starts. None where a segment lies inside one block without touching either edge (one shorter than
    a block): a block would then hold three."""
    out = np.full((-(-n // block), 4), -1, np.int32)
    out[:, 1], out[:, 3] = 0, block
    for j, (start, end) in enumerate(segments):
        first, last = start // block, (end - 1) // block
        head, tail = start - first * block, end - last * block
        if first == last and head > 0 and tail < block:
            return None
        if head > 0:  # it starts inside its first block: that block's second segment
            out[first, 2:] = j, head
            first += 1
        if first <= last:  # it holds the first element of each block from there on, and ends in its last
            out[first : last + 1, :2] = j, block
            out[last, 1] = tail
    return out


def record_segment_max(segment_max: NDArray, segment_table: NDArray, p: NDArray, block: int = SEGMENT_BLOCK) -> None:
    """segment_max[j] = max(itself, the finite max |p| of segment j), from the table (segment_table_of's)."""
    mag = np.abs(p)
    mag = np.where(mag <= F32_MAX, mag, 0)  # finite only: inf and NaN are left out
    for row, (a, end_a, b, start_b) in enumerate(segment_table.tolist()):
        part = mag[row * block : (row + 1) * block]
        if a >= 0:
            segment_max[a] = max(segment_max[a], part[:end_a].max(initial=0))
        if b >= 0:
            segment_max[b] = max(segment_max[b], part[start_b:].max(initial=0))


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
    segment_table: NDArray | None = None,
    segment_max: NDArray | None = None,
) -> None:
    """One AdamW step in place on p, m, v (and p_compute), reading g; leaves g zeroed. Element by element, so it
    runs over ranges of the flat arrays (ops/rows.py). segment_table and segment_max: the segments' maxima, recorded
    as p is stored (above)."""
    dt = p.dtype.type
    lr, bias1, bias2, gscale = (dt(x) for x in hyper[:4])
    clip = clip_factor(norm, gscale, max_norm)
    if clip is None:
        g.fill(0)
        if segment_table is not None:
            record_segment_max(segment_max, segment_table, p)
        return
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
    if segment_table is not None:
        record_segment_max(segment_max, segment_table, p)
