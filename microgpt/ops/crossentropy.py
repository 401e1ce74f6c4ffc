"""Cross-entropy loss fused with the tied LM head.

    logits = x @ wte.T                       (N,V)  never held whole: R rows at a time
    lse    = logsumexp(logits, axis=1)       (N,)
    loss   = lse - logits[n, targets[n]]     (N,)   0 where targets[n] < 0 (ignored)

Shapes: x (N,C), wte (V,C) (the token embedding, tied as the output head), targets (N,) int32,
losses and lse (N,), logits (R,V) scratch. Rows are processed in chunks of R = logits.shape[0];
the last chunk may be shorter. With a GPT-2 vocabulary the full (N,V) logits would outweigh every
other activation, so only one chunk exists at a time.

Forward saves lse (one float per row). Backward recomputes each chunk's logits with one matmul
instead of storing (N,V) probabilities.

Backward, per chunk, with dlosses the upstream gradient of each row's loss:

    dlogits = (softmax(logits) - onehot(targets)) * dlosses[:, None]   (rows with targets < 0: 0)
    dx     += dlogits @ wte
    dwte   += dlogits.T @ x

Chunks run in order, so dwte is summed in a fixed order: deterministic.
"""

import numpy as np
from numpy.typing import NDArray


def _chunks(n: int, r: int) -> range:
    """Start rows of the chunks of r rows covering n rows."""
    return range(0, n, r)


def crossentropy_forward(
    losses: NDArray, lse: NDArray, x: NDArray, wte: NDArray, targets: NDArray, logits: NDArray
) -> None:
    """losses (N,) = per-token cross-entropy of x @ wte.T against targets; writes lse (N,) for backward."""
    N, R = x.shape[0], logits.shape[0]
    for i in _chunks(N, R):
        j = min(i + R, N)
        z = logits[: j - i]  # leading rows of the scratch: contiguous
        np.matmul(x[i:j], wte.T, out=z)
        tgt = targets[i:j]
        valid = tgt >= 0
        target_logit = z[np.arange(j - i), np.where(valid, tgt, 0)]  # copy, taken before z is overwritten
        m = z.max(axis=1)
        z -= m[:, None]  # shift by the row max so exp cannot overflow
        np.exp(z, out=z)
        np.log(z.sum(axis=1), out=lse[i:j])
        lse[i:j] += m
        np.subtract(lse[i:j], target_logit, out=losses[i:j])
        losses[i:j][~valid] = 0.0


def crossentropy_backward(
    dx: NDArray,
    dwte: NDArray,
    dlosses: NDArray,
    x: NDArray,
    wte: NDArray,
    targets: NDArray,
    lse: NDArray,
    logits: NDArray,
) -> None:
    """dx (N,C), dwte (V,C) += gradients of the losses weighted by dlosses (N,); logits (R,V) is scratch."""
    N, R = x.shape[0], logits.shape[0]
    for i in _chunks(N, R):
        j = min(i + R, N)
        z = logits[: j - i]
        np.matmul(x[i:j], wte.T, out=z)  # recomputed, see the module docstring
        z -= lse[i:j, None]
        np.exp(z, out=z)  # z = softmax
        tgt = targets[i:j]
        valid = tgt >= 0
        rows = np.flatnonzero(valid)
        z[rows, tgt[rows]] -= 1.0
        z *= np.where(valid, dlosses[i:j], 0.0)[:, None]  # z = dlogits
        dx[i:j] += z @ wte
        dwte += z.T @ x[i:j]
