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

In training the loss is the root of backward, so its upstream gradient dlosses is known before the
forward runs (it depends only on which targets count). `crossentropy_forward_backward` uses that: one
pass per chunk computes the losses and lse, turns the logits into dlogits where they lie, and adds both
gradients, so the recomputing matmul disappears (a third of the LM head's FLOPs). It equals
crossentropy_forward followed by crossentropy_backward; the separate pair stays the specification.

Backward, per chunk, with dlosses the upstream gradient of each row's loss:

    dlogits = (softmax(logits) - onehot(targets)) * dlosses[:, None]   (rows with targets < 0: 0)
    dx     += dlogits @ wte
    dwte   += dlogits.T @ x

Chunks run in order, so dwte is summed in a fixed order: deterministic.

With an Fp8Head in place of wte (precision "fp8", microgpt/fp8.py) the logits GEMM runs on E4M3 operands: x
cast whole at its own amax (current scaling), wte from the optimizer step's E4M3 copy, fp32 sums times the two
inverse scales. Everything after the logits, and both gradient GEMMs, run as above on the head's compute copy.
"""

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from microgpt.fp8 import Fp8Head
from microgpt.ops import fp8


def _chunks(n: int, r: int) -> range:
    """Start rows of the chunks of r rows covering n rows."""
    return range(0, n, r)


ChunkLogits = Callable[[NDArray, int, int], None]  # logits(z, i, j): z = the logits of rows i .. j


def _head(x: NDArray, wte: NDArray | Fp8Head) -> tuple[ChunkLogits, NDArray]:
    """(the chunks' logits GEMM, the wte the gradient GEMMs read). In fp8 x is cast to E4M3 here, once for all
    chunks."""
    if isinstance(wte, Fp8Head):
        return fp8.head_logits(x, wte), wte.w

    def logits(z: NDArray, i: int, j: int) -> None:
        np.matmul(x[i:j], wte.T, out=z)

    return logits, wte


def _chunk_exp(z: NDArray, tgt: NDArray, losses: NDArray, lse: NDArray) -> NDArray:
    """One chunk's forward from its logits in z: losses and lse of its rows; leaves z = exp(z - rowmax) and returns
    the row sums of z (softmax = z / sums)."""
    valid = tgt >= 0
    target_logit = z[np.arange(len(z)), np.where(valid, tgt, 0)]  # copy, taken before z is overwritten
    m = z.max(axis=1)
    z -= m[:, None]  # shift by the row max so exp cannot overflow
    np.exp(z, out=z)
    sums = z.sum(axis=1)
    np.log(sums, out=lse)
    lse += m
    np.subtract(lse, target_logit, out=losses)
    losses[~valid] = 0.0
    return sums


def _add_grads(z: NDArray, norm, dx: NDArray, dwte: NDArray, dl: NDArray, x: NDArray, wte: NDArray,
               tgt: NDArray) -> None:  # fmt: skip
    """One chunk's backward from z * norm = softmax: z becomes dlogits, then dx += dlogits @ wte and
    dwte += dlogits.T @ x (ignored rows: dlogits 0)."""
    valid = tgt >= 0
    dl = np.where(valid, dl, 0.0)
    z *= (dl * norm)[:, None]  # softmax * dloss
    rows = np.flatnonzero(valid)
    z[rows, tgt[rows]] -= dl[rows]  # z = dlogits
    dx += z @ wte
    dwte += z.T @ x


def crossentropy_forward(
    losses: NDArray, lse: NDArray, x: NDArray, wte: NDArray | Fp8Head, targets: NDArray, logits: NDArray
) -> None:
    """losses (N,) = per-token cross-entropy of x @ wte.T against targets; writes lse (N,) for backward."""
    N, R = x.shape[0], logits.shape[0]
    chunk_logits, _ = _head(x, wte)
    for i in _chunks(N, R):
        j = min(i + R, N)
        z = logits[: j - i]  # leading rows: contiguous
        chunk_logits(z, i, j)
        _chunk_exp(z, targets[i:j], losses[i:j], lse[i:j])


def crossentropy_backward(
    dx: NDArray,
    dwte: NDArray,
    dlosses: NDArray,
    x: NDArray,
    wte: NDArray | Fp8Head,
    targets: NDArray,
    lse: NDArray,
    logits: NDArray,
) -> None:
    """dx (N,C), dwte (V,C) += gradients of the losses weighted by dlosses (N,); logits (R,V) is scratch."""
    N, R = x.shape[0], logits.shape[0]
    chunk_logits, w = _head(x, wte)
    for i in _chunks(N, R):
        j = min(i + R, N)
        z = logits[: j - i]
        chunk_logits(z, i, j)  # recomputed, see the module docstring
        z -= lse[i:j, None]
        np.exp(z, out=z)  # z = softmax
        _add_grads(z, 1.0, dx[i:j], dwte, dlosses[i:j], x[i:j], w, targets[i:j])


def crossentropy_forward_backward(
    losses: NDArray,
    lse: NDArray,
    dx: NDArray,
    dwte: NDArray,
    dlosses: NDArray,
    x: NDArray,
    wte: NDArray | Fp8Head,
    targets: NDArray,
    logits: NDArray,
) -> None:
    """crossentropy_forward, then crossentropy_backward with dlosses, chunk by chunk without recomputing z."""
    N, R = x.shape[0], logits.shape[0]
    chunk_logits, w = _head(x, wte)
    for i in _chunks(N, R):
        j = min(i + R, N)
        z = logits[: j - i]
        chunk_logits(z, i, j)
        sums = _chunk_exp(z, targets[i:j], losses[i:j], lse[i:j])
        _add_grads(z, 1.0 / sums, dx[i:j], dwte, dlosses[i:j], x[i:j], w, targets[i:j])


def loss_weights(dlosses: NDArray, targets: NDArray, scale: NDArray) -> None:
    """dlosses (N,) = d(mean loss over targets >= 0) / d(per-token loss), times scale[0] (the fp16 loss scale:
    1 in fp32 and bf16), the loss's upstream gradient; 0 on ignored tokens."""
    valid = targets >= 0
    dt = dlosses.dtype.type
    dlosses[...] = np.where(valid, dt(scale[0]) / dt(max(1, int(valid.sum()))), dt(0))


def loss_sum(out: NDArray, losses: NDArray, targets: NDArray, weight: float = 0.0, accumulate: bool = False) -> None:
    """out[:2] = (sum of losses, count of targets >= 0); with accumulate, out[0] += weight * their mean instead
    (the step's report of the mean loss over its micro-batches)."""
    total, count = losses.sum(dtype=np.float64), int((targets >= 0).sum())
    if accumulate:
        out[0] += weight * total / max(1, count)
    else:
        out[0], out[1] = total, count
