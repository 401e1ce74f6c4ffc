"""Fused AdamW over the flat fp32 parameter array, one pass, one launch: microgpt/ops/adamw.py is the specification.

lr, the bias corrections and the gradient scale come from the device array `hyper` (written by the host before
each step, so the same launch replays inside a CUDA graph), the clip factor from the device norm of the raw
gradients: g_eff = g * gscale * min(1, max_norm / (norm * gscale + 1e-6)). A non-finite norm (fp16 overflow, or
the warm-up's inf gscale) skips the update of every element. The pass also writes the compute copy of the
weights (bf16/fp16 runs) and zeroes the gradients. Where asked (a segment table: ops/adamw.py), it also records
each segment's finite max |p| as it stores the masters: a program of SEGMENT_BLOCK elements takes the max of the
two segments its row of the table names and max-es it into theirs (an atomic max: the max of maxima is the same in
any order). The precision that asks reads them next (fp8's weights' cast: engine/precision.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microgpt.kernels import tuning
from microgpt.kernels.gradclip import clip_factor, finite
from microgpt.kernels.tuning import Tuner
from microgpt.ops.adamw import SEGMENT_BLOCK

BLOCK = 1024 if tuning.INTERPRET else 2048
# (elements a program, warps): the launches the warm-up times (every one updates every element alike: the step is
# elementwise). The first is the one launch there was: one H100 moved the 35 bytes a parameter takes at ~2.1 TB/s
# under it (bench/RESULTS.md, twenty-sixth session: 2.10 ms a step for ANDREA-120M's 124M parameters).
CONFIGS = {f"b{BLOCK}w4": (BLOCK, 4), "b4096w8": (4096, 8), "b1024w4": (1024, 4), "b8192w8": (8192, 8),
           "b4096w4": (4096, 4)}  # fmt: skip


@triton.jit
def k_adamw(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    mask_ptr,
    pc_ptr,
    hyper_ptr,
    norm_ptr,
    table_ptr,
    segmax_ptr,
    n,
    beta1,
    beta2,
    eps,
    wd,
    max_norm,
    COMPUTE: tl.constexpr,
    SEGMENT_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # p, m, v: (n,) fp32; g: (n,) fp32; mask: (n,) u8, 1 where decay applies; pc: (n,) compute copy;
    # hyper: [lr, bias1, bias2, gscale] fp32; norm: (1,) fp32, the raw gradients' norm. SEGMENT_MAX: table
    # (n / BLOCK, 4) int32 [a, end_a, b, start_b] per program: elements [0, end_a) of its block are segment a's,
    # [start_b, BLOCK) segment b's (-1: none); segmax[a] and segmax[b] = max(itself, the finite max |p| of those,
    # as stored)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    lr = tl.load(hyper_ptr)
    bc1 = tl.load(hyper_ptr + 1)
    bc2 = tl.load(hyper_ptr + 2)
    clip, total = clip_factor(tl.load(hyper_ptr + 3), norm_ptr, max_norm)
    upd = finite(total, mask)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * clip
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
    # every thread's read of g is done before any thread zeroes it: the zeros depend on no load, and Triton may lay
    # this store out over other threads than the load (check/hazards.py), so nothing else would order the two
    tl.debug_barrier()
    tl.store(g_ptr + offs, tl.zeros((BLOCK,), dtype=g_ptr.dtype.element_ty), mask=mask)
    if SEGMENT_MAX:
        row = table_ptr + tl.program_id(0).to(tl.int64) * 4
        a, end_a, b, start_b = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
        mag = tl.abs(tl.where(upd, p, p0))  # the masters as stored
        mag = tl.where(mag <= 3.4028234663852886e38, mag, 0.0)  # finite only
        i = tl.arange(0, BLOCK)
        if a >= 0:
            tl.atomic_max(segmax_ptr + a, tl.max(tl.where(i < end_a, mag, 0.0), axis=0), sem="relaxed")
        if b >= 0:
            tl.atomic_max(segmax_ptr + b, tl.max(tl.where(i >= start_b, mag, 0.0), axis=0), sem="relaxed")


def adamw_step(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    decay_mask: torch.Tensor,
    p_compute: torch.Tensor | None,
    hyper: torch.Tensor,
    norm: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    max_norm: float,
    segment_table: torch.Tensor | None = None,
    segment_max: torch.Tensor | None = None,
    tuner: Tuner | None = None,
) -> None:
    """ops/adamw.py's step; segment_table (int32, ops/adamw.segment_table_of's rows of SEGMENT_BLOCK elements) and
    segment_max (fp32, a word a segment): each segment's finite max |p| recorded on the way. With tuner (and no
    segment table, whose rows fix the block), the launch the warm-up timed fastest for this length (CONFIGS): the
    warm-up's step updates nothing (its gradient scale is inf: engine/step.py), so the candidates may run it again
    and again; without, the first."""
    n = p.numel()

    def make(block: int, warps: int):
        def launch() -> None:
            k_adamw[(triton.cdiv(n, block),)](
                p,
                g,
                m,
                v,
                decay_mask,
                p_compute if p_compute is not None else p,
                hyper,
                norm,
                p if segment_table is None else segment_table,
                p if segment_max is None else segment_max,
                n,
                float(beta1),
                float(beta2),
                float(eps),
                float(weight_decay),
                float(max_norm),
                COMPUTE=p_compute is not None,
                SEGMENT_MAX=segment_table is not None,
                BLOCK=block,
                num_warps=warps,
            )

        return launch

    if tuner is None or segment_table is not None:  # fp8's segment table fixes the block: no choice to make
        make(BLOCK if segment_table is None else SEGMENT_BLOCK, 4)()
    else:
        compute = "" if p_compute is None else f":{p_compute.dtype}"
        tuner.launch("adamw", f"{n}{compute}", CONFIGS, make)
