"""Muon over the flat fp32 parameter array: microgpt/ops/muon.py is the specification.

Per group of same-shaped matrices (k of stored shape (rows, cols), working shape (R, Cw), R <= Cw), one after another:

    k_muon_momentum   (P, k) programs, BLOCK elements of one matrix each: G' = g * clip, M updated and stored,
                      U = G' + mu (M - G'), and the block's sum of U^2 into partials[i, j] (P = cdiv(rows cols, BLOCK))
    k_muon_normalise  (tiles, k) programs, a (TR, TC) tile of the stored matrix each: ||U_i|| from matrix i's P
                      partial sums (added in a fixed order, by every program alike), U recomputed from g and the new
                      M (one FMA: cheaper than a round trip of U through memory), X = U / (||U|| + 1e-7) written in
                      the compute dtype at the working layout (transposed for a tall matrix)
    Newton-Schulz     ns_steps x three batched GEMMs in the compute dtype (bf16 on bf16/fp8 runs) with fp32
                      accumulation, through the runtime's Gemm.addmm into the planned x, y, gram, poly:
                      A = X X^T ; B = b A + c A A ; Y = a X + B X, then X and Y swap (an output never aliases an
                      input). Each product runs the way the warm-up timed fastest for its shape: cuBLASLt under one
                      of its heuristic's algorithms (none splits K), or, for the two symmetric products A and B,
                      kernels/symmetric.py's tile, which computes the upper half and mirrors it
    k_muon_update     (tiles, k) programs: W = W (1 - lr wd) - lr scale X (X read transposed back for a tall
                      matrix), the fp32 master and the compute copy written in the same pass, g zeroed

g is zeroed by the update pass, which never reads it, and not by the normalise pass that reads it: inside one program
Triton may give a load and a store of the same addresses different thread layouts, and a store whose value does not
depend on the load (zeros) is then ordered after it by nothing, so another warp's zero could land before this warp's
read. That race is what made the step differ between runs (a few hundred elements of X a group, the square and wide
groups only, whose normalise loads g in one layout and stored its zeros in another: kernels/check/hazards.py finds
such a pair in the compiled kernel, and tests/kernels/test_hazards.py runs it over every kernel CI compiles).

The sums of squares are reduced in two fixed passes (per-block partials, then their sum), no atomics, and every
way of the GEMMs sums K in one fixed order (no split-K, no atomics). The ways sum in different orders from one
another, so the bits of a run depend on the way the tuner recorded for each product (the tuning cache: a resume and
a rerun on the machine read the same choice), as every other tuned GEMM of the engine does; outside a warm-up, a
product with no recorded choice takes cuBLASLt's first algorithm. Measured on an H100
(dev/muon_repeat.py, bench/RESULTS.md's twenty-first session): with g zeroed by the update pass the step repeats bit
for bit under cuBLASLt's GEMMs and under torch's baddbmm alike; the race on g was what had made it differ.
lr, mu, gscale and the weight decay come from the device array `hyper` (written by the host before
each step), the clip from the device norm, so every launch and GEMM replays inside the step's CUDA graph; nothing
is allocated (the views of the planned buffers are metadata). A non-finite norm (fp16 overflow, the warm-up's inf
gscale) leaves p, m and p_compute untouched and zeroes the owned gradients, as k_adamw does.
The offsets of every group's matrices sit in the planned int32 table `offsets` (filled once, before the first step:
`muon_scratch`'s fill), group after group, so one launch serves a group's k matrices.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from microgpt.kernels.gemm import Gemm
from microgpt.kernels.gradclip import clip_factor, finite, sum_parts
from microgpt.ops import muon as spec
from microgpt.ops.muon import MuonGroup, MuonScratch

BLOCK = 4096  # elements of one matrix per momentum program (and per partial sum: the plan's partials depend on it)
TR, TC = 64, 64  # the tile of the normalise and update programs (transposed stores go through shared memory)
PBLOCK = 1024  # partial sums added per round by the normalise program


@triton.jit
def _clip(hyper_ptr, norm_ptr, max_norm):
    # hyper: [lr, mu, gscale, wd] fp32; norm: (1,) fp32, the raw gradients' norm -> (g's factor, the mean's norm)
    return clip_factor(tl.load(hyper_ptr + 2), norm_ptr, max_norm)


@triton.jit
def _tile(offs_ptr, rows, cols, sxr, sxc, TR: tl.constexpr, TC: tl.constexpr):
    # program (t, i): a (TR, TC) tile of stored matrix i -> (i, the tile's mask, its offsets in the flat arrays
    # (matrix i row-major at offs[i]), its offsets in x (element (r, c) at i * rows * cols + r * sxr + c * sxc))
    t, i = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n_tc = tl.cdiv(cols, TC)
    r = (t // n_tc) * TR + tl.arange(0, TR)
    c = (t % n_tc) * TC + tl.arange(0, TC)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    ptr = tl.load(offs_ptr + i).to(tl.int64) + r[:, None].to(tl.int64) * cols + c[None, :]
    xo = i * rows * cols + r[:, None].to(tl.int64) * sxr + c[None, :].to(tl.int64) * sxc
    return i, mask, ptr, xo


@triton.jit
def k_muon_momentum(g_ptr, m_ptr, hyper_ptr, norm_ptr, offs_ptr, part_ptr, size, max_norm, BLOCK: tl.constexpr):
    # g, m: (n,) fp32 flat; matrix i (program 1) holds [offs[i], offs[i] + size); offs: (k,) int32;
    # part: (k, P) fp32, part[i, j] = sum of U^2 over block j of matrix i
    j, i = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    idx = j * BLOCK + tl.arange(0, BLOCK)
    mask = idx < size
    ptr = tl.load(offs_ptr + i).to(tl.int64) + idx
    clip, total = _clip(hyper_ptr, norm_ptr, max_norm)
    mu = tl.load(hyper_ptr + 1)
    upd = finite(total, mask)
    g = tl.load(g_ptr + ptr, mask=mask, other=0.0) * clip
    m = tl.load(m_ptr + ptr, mask=mask, other=0.0)
    m = m + (1.0 - mu) * (g - m)
    u = g + mu * (m - g)
    tl.store(m_ptr + ptr, m, mask=upd)
    tl.store(part_ptr + i * tl.num_programs(0) + j, tl.sum(u * u, axis=0))


@triton.jit
def k_muon_normalise(
    x_ptr,
    g_ptr,
    m_ptr,
    hyper_ptr,
    norm_ptr,
    offs_ptr,
    part_ptr,
    rows,
    cols,
    P,
    sxr,
    sxc,
    max_norm,
    TR: tl.constexpr,
    TC: tl.constexpr,
    PBLOCK: tl.constexpr,
):
    # x: (k, R, Cw) compute dtype, element (r, c) of stored matrix i at i * rows * cols + r * sxr + c * sxc;
    # g, m: (n,) fp32 flat, matrix i row-major at offs[i]; part: (k, P) fp32 from k_muon_momentum
    i, mask, ptr, xo = _tile(offs_ptr, rows, cols, sxr, sxc, TR, TC)
    denom = tl.sqrt(sum_parts(part_ptr + i * P, P, PBLOCK)) + 1e-7
    clip, total = _clip(hyper_ptr, norm_ptr, max_norm)
    mu = tl.load(hyper_ptr + 1)
    g = tl.load(g_ptr + ptr, mask=mask, other=0.0) * clip
    m = tl.load(m_ptr + ptr, mask=mask, other=0.0)
    u = g + mu * (m - g)
    tl.store(x_ptr + xo, (u / denom).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_muon_update(
    p_ptr,
    pc_ptr,
    g_ptr,
    x_ptr,
    hyper_ptr,
    norm_ptr,
    offs_ptr,
    rows,
    cols,
    sxr,
    sxc,
    scale,
    max_norm,
    COMPUTE: tl.constexpr,
    TR: tl.constexpr,
    TC: tl.constexpr,
):
    # p: (n,) fp32 flat, pc: its compute copy, g: (n,) fp32 the gradients (only written: zeroed); x: (k, R, Cw) the
    # orthogonalised updates, laid out as in k_muon_normalise; scale: sqrt(max(1, cols / rows))
    _, mask, ptr, xo = _tile(offs_ptr, rows, cols, sxr, sxc, TR, TC)
    lr = tl.load(hyper_ptr)
    wd = tl.load(hyper_ptr + 3)
    _, total = _clip(hyper_ptr, norm_ptr, max_norm)
    upd = finite(total, mask)
    x = tl.load(x_ptr + xo, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + ptr, mask=mask, other=0.0)
    p = p * (1.0 - lr * wd) - (lr * scale) * x
    tl.store(p_ptr + ptr, p, mask=upd)
    if COMPUTE:
        tl.store(pc_ptr + ptr, p.to(pc_ptr.dtype.element_ty), mask=upd)
    tl.store(g_ptr + ptr, tl.zeros((TR, TC), dtype=g_ptr.dtype.element_ty), mask=mask)


def partials_per_matrix(grp: MuonGroup) -> int:
    return triton.cdiv(grp.size, BLOCK)


def muon_scratch(groups: Iterable[MuonGroup]) -> list[MuonScratch]:
    """ops/muon.py's buffers (x, y, gram, poly in the compute dtype, the largest group's), plus the momentum pass's
    partial sums (the largest group's k P, f32) and every group's matrix offsets (int32, filled once)."""
    groups = tuple(groups)
    offsets = tuple(off for grp in groups for off in grp.offsets)
    parts = max((len(grp.offsets) * partials_per_matrix(grp) for grp in groups), default=0)
    return [
        *spec.muon_scratch(groups),
        MuonScratch("partials", "muon_partials", parts, "f32"),
        MuonScratch("offsets", "muon_offsets", len(offsets), "i32", offsets),
    ]


def newton_schulz(
    x: torch.Tensor, y: torch.Tensor, gram: torch.Tensor, poly: torch.Tensor, steps: int, gemm: Gemm
) -> torch.Tensor:
    """ops/muon.py's newton_schulz as batched GEMMs (fp32 accumulation, one rounding to the compute dtype per
    product) into the planned buffers, A and B as symmetric products; returns the buffer holding the result."""
    a, b, c = spec.NS_COEFFS
    for _ in range(steps):
        gemm.addmm(gram, gram, x, x.mT, 0.0, 1.0, symmetric=True)  # beta 0: gram's old contents are not read
        gemm.addmm(poly, gram, gram, gram, b, c, symmetric=True)  # A symmetric: A A = A A^T
        gemm.addmm(y, x, poly, x, a, 1.0)
        x, y = y, x
    return x


def muon_step(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    p_compute: torch.Tensor | None,
    hyper: torch.Tensor,
    norm: torch.Tensor,
    *,
    groups: tuple[MuonGroup, ...],
    x: torch.Tensor,
    y: torch.Tensor,
    gram: torch.Tensor,
    poly: torch.Tensor,
    partials: torch.Tensor,
    offsets: torch.Tensor,
    max_norm: float,
    gemm: Gemm,
    ns_steps: int = spec.NS_STEPS,
) -> None:
    """ops/muon.py's step; x, y, gram, poly, partials, offsets: muon_scratch's planned buffers (flat); gemm: the
    runtime's GEMM router (the backend binds it)."""
    first = 0
    for grp in groups:
        k, (R, W) = len(grp.offsets), grp.shape
        offs = offsets[first : first + k]
        first += k
        P = partials_per_matrix(grp)
        k_muon_momentum[(P, k)](g, m, hyper, norm, offs, partials, grp.size, float(max_norm), BLOCK=BLOCK)
        sxr, sxc = (1, grp.rows) if grp.transposed else (grp.cols, 1)
        tiles = (triton.cdiv(grp.rows, TR) * triton.cdiv(grp.cols, TC), k)
        X, Y = x[: k * R * W].view(k, R, W), y[: k * R * W].view(k, R, W)
        k_muon_normalise[tiles](
            X,
            g,
            m,
            hyper,
            norm,
            offs,
            partials,
            grp.rows,
            grp.cols,
            P,
            sxr,
            sxc,
            float(max_norm),
            TR=TR,
            TC=TC,
            PBLOCK=PBLOCK,
        )
        out = newton_schulz(X, Y, gram[: k * R * R].view(k, R, R), poly[: k * R * R].view(k, R, R), ns_steps, gemm)
        k_muon_update[tiles](
            p,
            p_compute if p_compute is not None else p,
            g,
            out,
            hyper,
            norm,
            offs,
            grp.rows,
            grp.cols,
            sxr,
            sxc,
            grp.scale,
            float(max_norm),
            COMPUTE=p_compute is not None,
            TR=TR,
            TC=TC,
        )
