"""AdamW over the flat parameter array, with torch.optim.AdamW semantics.

At 1-based step t, for every element (decay only where decay_mask is 1: the 2-D weights):

    p -= lr * weight_decay * decay_mask * p              decoupled weight decay, before the update
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g^2
    p -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

Shapes: p, g, m, v, decay_mask all (n,), flat over all parameters in the canonical order.
m and v are the optimizer state (kept between steps, saved in checkpoints); nothing else is saved.
"""

import math

import numpy as np
from numpy.typing import NDArray


def adamw_step(
    p: NDArray,
    g: NDArray,
    m: NDArray,
    v: NDArray,
    decay_mask: NDArray,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    t: int,
) -> None:
    """One AdamW step in place on p, m, v (all (n,)); t is the 1-based step number."""
    p -= (lr * weight_decay) * decay_mask * p
    m *= beta1
    m += (1.0 - beta1) * g
    v *= beta2
    v += (1.0 - beta2) * np.square(g)
    bias1 = 1.0 - beta1**t
    bias2 = 1.0 - beta2**t
    denom = np.sqrt(v)
    denom /= math.sqrt(bias2)  # sqrt(v / bias2), in torch's order: sqrt first, then divide
    denom += eps
    p -= (lr / bias1) * m / denom
