"""The greedy pick in Triton (ops/argmax.py specifies it): out[i] = the index of row i's largest value, the first of
equal ones, the first NaN where there is one (np.argmax's choice). Shapes: x (b, V) rows of stride sx (the decode
step's next_logits, in the compute dtype), out (b,) int32.

One program a row: each of its BLOCK lanes walks its columns in order and keeps its largest value and where it was,
replacing it only by a strictly larger one (or by the first NaN), so a lane keeps its first maximum; then the row's
maximum is the lanes' largest and its index the smallest index among the lanes that hold it. Nothing is atomic and
nothing depends on the order programs run in. One program a row is enough work at serve's batch sizes: a row of V
values is read once, in V / BLOCK steps, and the loads of successive steps are in flight together.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microgpt.kernels.tuning import INTERPRET

BLOCK = 1024 if INTERPRET else 4096  # columns a step of one row's loop


@triton.jit
def k_argmax_rows(out_ptr, x_ptr, sx, V, BLOCK: tl.constexpr):
    # out: (b,) int32; x: (b, V) rows of stride sx
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    at = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        c = start + cols
        v = tl.load(x_ptr + row * sx + c, mask=c < V, other=float("-inf")).to(tl.float32)
        take = (v > best) | ((v != v) & (best == best))  # larger, or the lane's first NaN
        best = tl.where(take, v, best)
        at = tl.where(take, c, at)
    nan = best != best
    top = tl.max(tl.where(nan, float("-inf"), best), axis=0)
    hit = tl.where(tl.max(nan.to(tl.int32), axis=0) > 0, nan, best == top)
    tl.store(out_ptr + row, tl.min(tl.where(hit, at, V), axis=0))


def argmax_rows(out: torch.Tensor, x: torch.Tensor) -> None:
    """out (b,) int32 = the argmax of each row of x (b, V) (ops/argmax.py)."""
    b, V = x.shape
    assert x.stride(1) == 1 and out.is_contiguous() and out.dtype == torch.int32
    k_argmax_rows[(b,)](out, x, x.stride(0), V, BLOCK=BLOCK, num_warps=8)
