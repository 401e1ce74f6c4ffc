"""The greedy pick: each row's largest logit's index, NumPy reference.

    argmax_rows   out[i] = the index of the largest x[i, j] over j (the first of equal ones; a NaN counts as the
                  largest, the first NaN, as np.argmax)

The decode step writes it after its logits (infer.InferState: into the inference plan's next_ids (B,) int32, inside
the step's CUDA graph on a GPU), so that a greedy row's token leaves the device as one int, not its V logits:
serve's rows at temperature 0 read b ints a pass (scheduler.py), and only a row that samples reads its logits.
Forward only: nothing is saved, there is no backward. Shapes: x (b, V) rows (a row stride of its own on the GPU),
out (b,) int32.
"""

import numpy as np
from numpy.typing import NDArray


def argmax_rows(out: NDArray[np.int32], x: NDArray) -> None:
    """out (b,) = the argmax of each row of x (b, V), as np.argmax picks it."""
    out[...] = np.argmax(x, axis=1)
