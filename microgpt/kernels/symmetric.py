"""Products known to be symmetric, computed on half their tiles: Muon's A = X X^T and B = b A + c A A.

    symmetric_addmm(out, c, a, b, beta, alpha)   out = beta c + alpha (a @ b), out (k, R, R) or (R, R), a @ b symmetric

Newton-Schulz (kernels/muon.py) forms two symmetric matrices per step: the Gram matrix A = X X^T (K = Cw) and
B = b A + c A A (K = R; A symmetric, so A A = A A^T too). A full GEMM computes every element of them twice over, once
each side of the diagonal. k_symmetric_mm cuts the (R, R) output into (BM, BM) tiles and runs only the tiles (ti, tj)
with ti <= tj: n (n + 1) / 2 of n^2 (n = cdiv(R, BM): 21 of 36 at R = 768, BM = 128). Program (t, i) takes upper tile
t of matrix i of the batch, sums a's rows ti against b's columns tj over K in fixed BK steps (fp32 accumulation,
one fixed order: no split, no atomics, so a run repeats another bit for bit), applies the epilogue
alpha (a @ b) + beta c to the fp32 sum (c's tile read where beta is not 0), and stores the tile at (ti, tj) and its
transpose at (tj, ti). Each element (r, s) with r <= s is computed once and written to both (r, s) and (s, r), so
the output is exactly symmetric (a diagonal tile keeps its upper triangle and mirrors it onto its lower one).

No program reads what another writes: out is none of a, b (and not c where c is read), so the mirrored stores land
on addresses this launch never loads. The caller promises the symmetry: b = a^T (X X^T, the second operand X read
transposed) or a = b a symmetric matrix, and c symmetric where beta is not 0; the upper half of beta c + alpha a @ b
is what is computed, the lower half its mirror.

Tiles: BM x BM (square: a tile and its mirror have one shape) over BK of K; the 16-bit tile is k_gemm's (128, 64,
eight warps, four stages), fp32's a quarter of it (a 128 x 128 fp32 tile would not fit with its pipeline), the
interpreter's small (it runs programs one by one). Candidate "sym" of Gemm.addmm (kernels/gemm.py), timed in the
warm-up beside cuBLASLt's algorithms; the interpreter and the compile sweep run it directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microgpt.kernels.tile import dot_loop
from microgpt.kernels.tuning import INTERPRET


@triton.jit
def _upper_tile(t):
    # upper tile t -> (ti, tj), ti <= tj: column tj holds tiles (0 .. tj, tj) from t = tj (tj + 1) / 2 on. The
    # float square root is corrected by one either way where it rounds across a column's first tile.
    tj = ((tl.sqrt(8.0 * t + 1.0) - 1.0) * 0.5).to(tl.int32)
    tj = tl.where((tj + 1) * (tj + 2) // 2 <= t, tj + 1, tj)
    tj = tl.where(tj * (tj + 1) // 2 > t, tj - 1, tj)
    return t - tj * (tj + 1) // 2, tj


@triton.jit
def k_symmetric_mm(
    out_ptr,
    c_ptr,
    a_ptr,
    b_ptr,
    R,
    K,
    sab,
    sar,
    sak,
    sbb,
    sbk,
    sbr,
    scb,
    scr,
    sob,
    sor,
    beta,
    alpha,
    HAS_C: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    # out, c: (k, R, R) (rows contiguous); a: (k, R, K), b: (k, K, R), any strides (b may be a's transpose: the
    # same memory); matrix i at i * s.b of each. out = alpha (a @ b) + beta c on the upper tiles, mirrored
    ti, tj = _upper_tile(tl.program_id(0))
    i = tl.program_id(1).to(tl.int64)
    rows = ti * BM + tl.arange(0, BM)
    cols = tj * BM + tl.arange(0, BM)
    acc = dot_loop(a_ptr + i * sab, b_ptr + i * sbb, rows, cols, R, R, K, sar, sak, sbk, sbr, BM, BM, BK, IEEE)
    inside = (rows[:, None] < R) & (cols[None, :] < R)
    acc = alpha * acc
    if HAS_C:
        c_ptrs = c_ptr + i * scb + rows[:, None].to(tl.int64) * scr + cols[None, :]
        acc += beta * tl.load(c_ptrs, mask=inside, other=0.0).to(tl.float32)
    val = acc.to(out_ptr.dtype.element_ty)
    out_ptr += i * sob
    # (r, s) with r <= s as computed; (s, r) with r < s from the transposed tile: one value for both
    upper = inside & (rows[:, None] <= cols[None, :])
    tl.store(out_ptr + rows[:, None].to(tl.int64) * sor + cols[None, :], val, mask=upper)
    lower = (cols[:, None] < R) & (rows[None, :] < R) & (cols[:, None] > rows[None, :])
    tl.store(out_ptr + cols[:, None].to(tl.int64) * sor + rows[None, :], tl.trans(val), mask=lower)


def tile_config(dtype: torch.dtype) -> dict:
    """k_symmetric_mm's tile for an operand dtype."""
    if INTERPRET:
        return dict(BM=32, BK=32)
    if dtype == torch.float32:
        return dict(BM=64, BK=32, num_warps=4, num_stages=3)
    return dict(BM=128, BK=64, num_warps=8, num_stages=4)


def symmetric_addmm(
    out: torch.Tensor, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float
) -> None:
    """out = beta c + alpha (a @ b) for a symmetric a @ b (and c, where beta is not 0): out (k, R, R) or (R, R)
    with contiguous rows, c laid out as out (and possibly out itself where beta is 0: nothing of c is read then),
    a (k, R, K), b (k, K, R) any strides, none of them out's memory."""
    if out.dim() == 2:
        out, c, a, b = out[None], c[None], a[None], b[None]
    k, R, K = a.shape
    if out.shape != (k, R, R) or b.shape != (k, K, R) or c.shape != out.shape or out.stride(-1) != 1:
        raise ValueError(
            f"symmetric product {tuple(out.shape)} = {tuple(a.shape)} @ {tuple(b.shape)} (c {tuple(c.shape)})"
        )
    if c.stride(-1) != 1:
        raise ValueError(f"symmetric product: c's rows are not contiguous (strides {c.stride()})")
    cfg = tile_config(a.dtype)
    n = triton.cdiv(R, cfg["BM"])
    k_symmetric_mm[(n * (n + 1) // 2, k)](
        out,
        c,
        a,
        b,
        R,
        K,
        *a.stride(),
        *b.stride(),
        c.stride(0),
        c.stride(1),
        out.stride(0),
        out.stride(1),
        float(beta),
        float(alpha),
        HAS_C=beta != 0,
        IEEE=a.dtype == torch.float32,
        **cfg,
    )
