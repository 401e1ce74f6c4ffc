"""Muon over the hidden matrices of the flat parameter array: momentum, Nesterov, Newton-Schulz orthogonalisation.

Muon owns a set of matrices (the modern block's w_q, w_k, w_v, w_o, w_1, w_2); AdamW keeps everything else. The
optimizer step (microgpt/engine/step.py) hands both the raw gradient sum and its norm, and Muon folds the gradient
scale and the clip into its read of the gradients exactly as AdamW does (microgpt/ops/adamw.py). `hyper` holds the
values that may change every step, written by the host before the step runs:

    hyper = [lr, mu (momentum), gscale = 1 / (count * world * loss_scale), weight_decay]   (count: its micro-batches)

For every owned matrix W (rows, cols) at its offset in the flat arrays, with gradient G and momentum M there:

    total = norm * gscale                                     the global norm of the mean gradient (all parameters)
    G'    = G * gscale * min(1, max_norm / (total + 1e-6))    as AdamW's g (max_norm inf: no clip)
    M     = M + (1 - mu) * (G' - M)                           momentum, kept in the checkpoint's adam_m
    U     = G' + mu * (M - G')                                Nesterov
    X     = U / (||U||_F + 1e-7)                              a tall W (rows > cols) as U^T: X is wide, R <= Cw
    ns_steps times:  A = X X^T ;  B = b A + c A A ;  X = a X + B X     (a, b, c) = NS_COEFFS; train.muon_ns_steps (5)
    W     = W * (1 - lr * wd) - lr * sqrt(max(1, cols / rows)) * X           X^T back for a tall W
    p_compute = W (rounded to the compute dtype), G = 0

The quintic's coefficients push every singular value of the normalised U that is not tiny into about [0.7, 1.2]
after five steps (not exactly 1: they trade accuracy near 1 for speed from 0); X is then about U's polar factor
(U = Q S V^T -> Q V^T), the update Muon takes. A non-finite total (an fp16 overflow, or the warm-up step's inf
gscale) leaves p, m and p_compute untouched; the owned gradients are zeroed either way. Nothing is written to
adam_v (it stays zero where Muon owns a parameter).

Matrices of one stored shape form a group (MuonGroup) and are orthogonalised together: one batched GEMM per group
per product. The groups run one after another, so the scratch (x, y ping-pong (k, R, Cw), gram A and poly B
(k, R, R), in the compute dtype) is as large as the largest group needs, planned once (`muon_scratch`) and viewed per
group. Here the compute dtype is the arrays' (float32; float64 in the gradient checks); the GPU runs the Newton-Schulz
products in bf16 (microgpt/kernels/muon.py). Arithmetic is in p's dtype, in the Triton kernels' order.
Shapes: p, g, m, p_compute (n,) flat over all parameters in the canonical order; norm (1,); hyper (4,).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from microgpt.ops.gradclip import clip_factor

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # (a, b, c): the quintic X -> a X + b (X X^T) X + c (X X^T)^2 X
NORM_EPS = 1e-7  # X = U / (||U||_F + NORM_EPS)
NS_STEPS = 5


@dataclass(frozen=True)
class MuonGroup:
    """Matrices of one stored shape (rows, cols), row-major at `offsets` in the flat arrays (in element units)."""

    offsets: tuple[int, ...]
    rows: int
    cols: int

    def __post_init__(self) -> None:
        if self.rows < 1 or self.cols < 1 or not self.offsets or min(self.offsets) < 0:
            raise ValueError(f"a Muon group needs rows, cols >= 1 and offsets >= 0 (got {self})")

    @property
    def transposed(self) -> bool:
        """Whether a matrix is orthogonalised as its transpose (a tall one: the Gram matrix is then the small one)."""
        return self.rows > self.cols

    @property
    def shape(self) -> tuple[int, int]:
        """(R, Cw): the working (wide) shape of one matrix, R = min(rows, cols) <= Cw."""
        return (self.cols, self.rows) if self.transposed else (self.rows, self.cols)

    @property
    def size(self) -> int:
        return self.rows * self.cols

    @property
    def scale(self) -> float:
        """The update's shape scale sqrt(max(1, cols / rows)) (stored [in, out]: fan_out over fan_in)."""
        return math.sqrt(max(1.0, self.cols / self.rows))


def muon_groups(matrices: Iterable[tuple[int, int, int]]) -> tuple[MuonGroup, ...]:
    """The groups of (offset, rows, cols) matrices: one per stored shape, in the order the shapes first appear,
    each keeping its matrices' order."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for offset, rows, cols in matrices:
        by_shape.setdefault((rows, cols), []).append(offset)
    return tuple(MuonGroup(tuple(offs), rows, cols) for (rows, cols), offs in by_shape.items())


@dataclass(frozen=True)
class MuonScratch:
    """One planned buffer of the step: muon_step's `keyword`, the plan's `buffer` name, its elements and kind
    ("compute", "f32", "i32"), and what it must hold before the first step (`fill`; None: nothing, it is written
    by the step before being read)."""

    keyword: str
    buffer: str
    numel: int
    kind: str
    fill: tuple[int, ...] | None = None


def scratch_sizes(groups: Iterable[MuonGroup]) -> tuple[int, int]:
    """(elements of x and y, elements of gram and poly): the largest group's k R Cw and k R R."""
    work = [(len(grp.offsets), *grp.shape) for grp in groups]
    return max((k * r * w for k, r, w in work), default=0), max((k * r * r for k, r, _ in work), default=0)


def muon_scratch(groups: Iterable[MuonGroup]) -> list[MuonScratch]:
    """The buffers muon_step takes as keywords: the ping-pong pair x, y and the Gram and polynomial matrices gram,
    poly, all in the compute dtype and shared by the groups (they run one after another)."""
    xy, aa = scratch_sizes(groups)
    return [MuonScratch(kw, f"muon_{kw}", n, "compute") for kw, n in (("x", xy), ("y", xy), ("gram", aa), ("poly", aa))]


def newton_schulz(x: NDArray, y: NDArray, gram: NDArray, poly: NDArray, steps: int) -> NDArray:
    """ns_steps of X -> a X + B X, B = b A + c A A, A = X X^T over the batch x (k, R, Cw) (R <= Cw, so A (k, R, R)
    is the small Gram matrix), ping-ponging between x and y; returns the one holding the result."""
    a, b, c = (x.dtype.type(v) for v in NS_COEFFS)
    for _ in range(steps):
        np.matmul(x, x.transpose(0, 2, 1), out=gram)
        np.matmul(gram, gram, out=poly)
        poly *= c
        poly += b * gram
        np.matmul(poly, x, out=y)
        y += a * x
        x, y = y, x
    return x


def muon_step(
    p: NDArray,
    g: NDArray,
    m: NDArray,
    p_compute: NDArray | None,
    hyper: NDArray,
    norm: NDArray,
    *,
    groups: tuple[MuonGroup, ...],
    x: NDArray,
    y: NDArray,
    gram: NDArray,
    poly: NDArray,
    max_norm: float,
    ns_steps: int = NS_STEPS,
) -> None:
    """One Muon step in place on the groups' matrices of p and m (and p_compute), reading their g and leaving it
    zeroed; every other element of the flat arrays is left as it is. x, y, gram, poly: muon_scratch's buffers."""
    dt = p.dtype.type
    lr, mu, gscale, wd = (dt(v) for v in hyper[:4])
    clip = clip_factor(norm, gscale, max_norm)
    if clip is None:
        for grp in groups:
            for off in grp.offsets:
                g[off : off + grp.size] = 0
        return
    for grp in groups:
        k, (R, W), n = len(grp.offsets), grp.shape, grp.size
        X = x[: k * R * W].reshape(k, R, W)
        for i, off in enumerate(grp.offsets):
            gi, mi = g[off : off + n], m[off : off + n]
            gi *= clip  # G'
            mi += (dt(1) - mu) * (gi - mi)
            u = (gi + mu * (mi - gi)).reshape(grp.rows, grp.cols)
            u = u / (np.sqrt(np.sum(u * u)) + dt(NORM_EPS))
            X[i] = u.T if grp.transposed else u
            gi.fill(0)
        out = newton_schulz(
            X,
            y[: k * R * W].reshape(k, R, W),
            gram[: k * R * R].reshape(k, R, R),
            poly[: k * R * R].reshape(k, R, R),
            ns_steps,
        )
        step = lr * dt(grp.scale)
        for i, off in enumerate(grp.offsets):
            pi = p[off : off + n].reshape(grp.rows, grp.cols)
            pi *= dt(1) - lr * wd
            pi -= step * (out[i].T if grp.transposed else out[i])
            if p_compute is not None:
                p_compute[off : off + n] = pi.reshape(-1)
