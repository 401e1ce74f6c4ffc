"""Fused AdamW over the flat fp32 parameter array, one pass, one launch: microgpt/ops/adamw.py is the specification.

lr, the bias corrections and the gradient scale come from the device array `hyper` (written by the host before
each step, so the same launch replays inside a CUDA graph), the clip factor from the device norm of the raw
gradients: g_eff = g * gscale * min(1, max_norm / (norm * gscale + 1e-6)). A non-finite norm (fp16 overflow, or
the warm-up's inf gscale) skips the update of every element. The pass also writes the compute copy of the
weights (bf16/fp16 runs) and zeroes the gradients. With precision fp8 it also records each E4M3 weight's amax, the
finite max |p| of its updated masters, for the weights' cast that follows (kernels/fp8.py: Matmul.cast_weights):
the table `amax_blocks` (microgpt/fp8.amax_blocks) says which weights each program's block holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microgpt import fp8
from microgpt.kernels import tuning

BLOCK = 1024 if tuning.INTERPRET else 2048


@triton.jit
def k_adamw(p_ptr, g_ptr, m_ptr, v_ptr, mask_ptr, pc_ptr, hyper_ptr, norm_ptr, blocks_ptr, amax_ptr, n, beta1, beta2,
            eps, wd, max_norm, COMPUTE: tl.constexpr, AMAX: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # p, m, v: (n,) fp32; g: (n,) fp32; mask: (n,) u8, 1 where decay applies; pc: (n,) compute copy;
    # hyper: [lr, bias1, bias2, gscale] fp32; norm: (1,) fp32, the raw gradients' norm. AMAX: blocks (n / BLOCK, 4)
    # int32 [a, end_a, b, start_b] per program: elements [0, end_a) of its block are weight a's, [start_b, BLOCK)
    # weight b's (-1: none); amax[a] and amax[b] = max(itself, the finite max |p| of those, as updated)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    lr = tl.load(hyper_ptr)
    bc1 = tl.load(hyper_ptr + 1)
    bc2 = tl.load(hyper_ptr + 2)
    gscale = tl.load(hyper_ptr + 3)
    total = tl.load(norm_ptr) * gscale
    gscale = gscale * tl.minimum(1.0, max_norm / (total + 1e-6))
    totalv = tl.zeros((BLOCK,), dtype=tl.float32) + total  # a vector: the interpreter cannot AND scalar bools in
    upd = mask & ((totalv - totalv) == 0.0)  # False for inf and NaN
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * gscale
    p0 = tl.load(p_ptr + offs, mask=mask, other=0.0)
    p = p0
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    dmask = tl.load(mask_ptr + offs, mask=mask, other=0).to(tl.float32)
    p = p - lr * wd * dmask * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - lr * (m / bc1) / (tl.sqrt(v / bc2) + eps)
    tl.store(p_ptr + offs, p, mask=upd)
    tl.store(m_ptr + offs, m, mask=upd)
    tl.store(v_ptr + offs, v, mask=upd)
    if COMPUTE:
        tl.store(pc_ptr + offs, p.to(pc_ptr.dtype.element_ty), mask=upd)
    tl.store(g_ptr + offs, tl.zeros((BLOCK,), dtype=g_ptr.dtype.element_ty), mask=mask)
    if AMAX:
        row = blocks_ptr + tl.program_id(0).to(tl.int64) * 4
        a, end_a, b, start_b = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
        mag = tl.abs(tl.where(upd, p, p0))  # the masters as stored
        mag = tl.where(mag <= 3.4028234663852886e38, mag, 0.0)  # finite only, as the casts' amax
        i = tl.arange(0, BLOCK)
        if a >= 0:
            tl.atomic_max(amax_ptr + a, tl.max(tl.where(i < end_a, mag, 0.0), axis=0), sem="relaxed")
        if b >= 0:
            tl.atomic_max(amax_ptr + b, tl.max(tl.where(i >= start_b, mag, 0.0), axis=0), sem="relaxed")


def adamw_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, decay_mask: torch.Tensor,
               p_compute: torch.Tensor | None, hyper: torch.Tensor, norm: torch.Tensor, beta1: float, beta2: float,
               eps: float, weight_decay: float, max_norm: float, amax_blocks: torch.Tensor | None = None,
               amaxes: torch.Tensor | None = None) -> None:  # fmt: skip
    """ops/adamw.py's step; amax_blocks and amaxes (fp8's planned table and amaxes, bound by the backend where the
    plan has them): each E4M3 weight's amax recorded on the way (the table's blocks are fp8.AMAX_BLOCK long)."""
    n = p.numel()
    block = BLOCK if amax_blocks is None else fp8.AMAX_BLOCK
    k_adamw[(triton.cdiv(n, block),)](
        p, g, m, v, decay_mask, p_compute if p_compute is not None else p, hyper, norm,
        p if amax_blocks is None else amax_blocks, p if amaxes is None else amaxes, n, float(beta1), float(beta2),
        float(eps), float(weight_decay), float(max_norm), COMPUTE=p_compute is not None, AMAX=amax_blocks is not None,
        BLOCK=block)  # fmt: skip
