"""Cross-entropy loss fused with the LM head, with an optional logit soft-cap.

    z      = x @ wte.T                       (N,V)  never held whole: R rows at a time
    logits = softcap * tanh(z / softcap)     (N,V)  softcap 0 (GPT-2's): logits = z
    lse    = logsumexp(logits, axis=1)       (N,)
    loss   = lse - logits[n, targets[n]]     (N,)   0 where targets[n] < 0 (ignored)

Shapes: x (N,C), wte (V,C) (the head's weight: the token embedding where it is tied, as in GPT-2, else the model's
untied lm_head; the functions call it wte either way), targets (N,) int32,
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
    dz      = dlogits * (1 - tanh(z / softcap)^2)                       (softcap 0: dz = dlogits)
    dx     += dz @ wte
    dwte   += dz.T @ x

The cap is applied to each chunk where it lies, after its GEMM; its slope 1 - tanh^2 is kept for the rows of a range
only while their dlogits are made (a temporary of the range's size), never stored.

Chunks run in order, so dwte is summed in a fixed order: deterministic.

The logits GEMM and the two gradient GEMMs are the precision's (its Matmul `mm`, microgpt/engine/precision.py: in fp8
the logits GEMM runs on E4M3 operands, x cast whole at its own amax; the gradient GEMMs stay on the compute copy).
Between the GEMMs, each row of a chunk is its own softmax: those passes run over ranges of the chunk's rows
(ops/rows.py).
"""

from collections.abc import Iterator
from functools import partial

import numpy as np
from numpy.typing import NDArray

from microgpt.ops.linear import Matmul
from microgpt.ops.rows import SERIAL, Rows


def _chunks(x: NDArray, wte: NDArray, logits: NDArray, mm: Matmul) -> Iterator[tuple[int, int, NDArray]]:
    """(i, j, z) for each chunk of rows i .. j in order, z (j - i, V) the leading rows of the scratch holding its
    logits, computed by the precision's head GEMM."""
    N, R = x.shape[0], logits.shape[0]
    chunk_logits = mm.logits(x, wte)
    for i in range(0, N, R):
        j = min(i + R, N)
        z = logits[: j - i]  # leading rows: contiguous
        chunk_logits(z, i, j)
        yield i, j, z


def _cap(z: NDArray, softcap: float, slope: bool = False) -> NDArray | None:
    """z -> softcap * tanh(z / softcap) in place; with slope, returns the cap's derivative 1 - tanh(z / softcap)^2
    (a new array of z's shape). softcap 0 (GPT-2's): no cap, z as it is, no slope (None)."""
    if not softcap:
        return None
    z /= softcap
    np.tanh(z, out=z)
    d = None
    if slope:
        d = np.multiply(z, z)
        np.subtract(1.0, d, out=d)
    z *= softcap
    return d


def _chunk_exp(z: NDArray, tgt: NDArray, losses: NDArray, lse: NDArray, softcap: float = 0.0) -> NDArray:
    """One chunk's forward from its logits in z (capped here first where softcap): losses and lse of its rows; leaves
    z = exp(z - rowmax) and returns the row sums of z (softmax = z / sums)."""
    _cap(z, softcap)
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


def _dlogits(z: NDArray, norm, dl: NDArray, tgt: NDArray) -> None:
    """One chunk's dlogits in place from z * norm = softmax: (softmax - onehot) * dl (ignored rows: 0)."""
    valid = tgt >= 0
    dl = np.where(valid, dl, 0.0)
    z *= (dl * norm)[:, None]  # softmax * dloss
    rows = np.flatnonzero(valid)
    z[rows, tgt[rows]] -= dl[rows]


def _softmax_dlogits(z: NDArray, lse: NDArray, dl: NDArray, tgt: NDArray, softcap: float = 0.0) -> None:
    """Recomputed logits z (before the cap) -> their gradient in place, from the forward's lse."""
    slope = _cap(z, softcap, slope=True)
    z -= lse[:, None]
    np.exp(z, out=z)  # z = softmax
    _dlogits(z, 1.0, dl, tgt)
    if slope is not None:
        z *= slope


def _loss_dlogits(z: NDArray, tgt: NDArray, losses: NDArray, lse: NDArray, dl: NDArray, softcap: float = 0.0) -> None:
    """Logits z (before the cap) -> the losses and lse of their rows, and z -> their gradient in place."""
    slope = _cap(z, softcap, slope=True)
    sums = _chunk_exp(z, tgt, losses, lse)
    _dlogits(z, 1.0 / sums, dl, tgt)
    if slope is not None:
        z *= slope


def crossentropy_forward(
    losses: NDArray,
    lse: NDArray,
    x: NDArray,
    wte: NDArray,
    targets: NDArray,
    logits: NDArray,
    *,
    mm: Matmul,
    rows: Rows = SERIAL,
    softcap: float = 0.0,
) -> None:
    """losses (N,) = per-token cross-entropy of the (capped) logits x @ wte.T against targets; writes lse (N,) for
    backward."""
    for i, j, z in _chunks(x, wte, logits, mm):
        rows.map(partial(_chunk_exp, softcap=softcap), z, targets[i:j], losses[i:j], lse[i:j])


def crossentropy_backward(
    dx: NDArray,
    dwte: NDArray,
    dlosses: NDArray,
    x: NDArray,
    wte: NDArray,
    targets: NDArray,
    lse: NDArray,
    logits: NDArray,
    *,
    mm: Matmul,
    rows: Rows = SERIAL,
    softcap: float = 0.0,
) -> None:
    """dx (N,C), dwte (V,C) += gradients of the losses weighted by dlosses (N,); logits (R,V) is scratch."""
    for i, j, z in _chunks(x, wte, logits, mm):  # the logits recomputed, see the module docstring
        rows.map(partial(_softmax_dlogits, softcap=softcap), z, lse[i:j], dlosses[i:j], targets[i:j])
        mm.logits_backward(dx[i:j], dwte, z, x[i:j], wte)


def crossentropy_forward_backward(
    losses: NDArray,
    lse: NDArray,
    dx: NDArray,
    dwte: NDArray,
    dlosses: NDArray,
    x: NDArray,
    wte: NDArray,
    targets: NDArray,
    logits: NDArray,
    *,
    mm: Matmul,
    rows: Rows = SERIAL,
    softcap: float = 0.0,
) -> None:
    """crossentropy_forward, then crossentropy_backward with dlosses, chunk by chunk without recomputing z."""
    for i, j, z in _chunks(x, wte, logits, mm):
        rows.map(partial(_loss_dlogits, softcap=softcap), z, targets[i:j], losses[i:j], lse[i:j], dlosses[i:j])
        mm.logits_backward(dx[i:j], dwte, z, x[i:j], wte)


def head_logits(out: NDArray, x: NDArray, wte: NDArray, *, mm: Matmul, softcap: float = 0.0) -> None:
    """out (b,V) = x (b,C) @ wte.T, capped where softcap: the next-token logits of the inference step's last positions
    (no loss)."""
    mm.logits(x, wte)(out, 0, x.shape[0])
    _cap(out, softcap)


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
