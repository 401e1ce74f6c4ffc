"""Fused AdamW over the flat fp32 parameter array (torch.optim.AdamW semantics), one pass, one launch.

    p -= lr*wd*mask*p ; m = b1 m + (1-b1) g ; v = b2 v + (1-b2) g^2 ; p -= lr * (m/bc1) / (sqrt(v/bc2) + eps)
with bc1 = 1-b1^t, bc2 = 1-b2^t. Host floats by default; inside a CUDA graph, lr, bc1, bc2 and the gradient
factor come from a small device array `hyper` = [lr, bc1, bc2, gscale] written before each replay, and the clip
coefficient from the device norm: g_eff = g * gscale * min(1, max_norm / (norm * gscale + 1e-6)). A non-finite
norm (fp16 overflow) skips the update of every element: the loss scaler lowers the scale and the step is redone
by the next one. Optional: write a low-precision copy of p (the bf16/fp16 compute weights) and zero g.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microgpt.kernels import tuning

BLOCK = 1024 if tuning.INTERPRET else 2048


@triton.jit
def k_adamw(p_ptr, g_ptr, m_ptr, v_ptr, mask_ptr, plp_ptr, hyper_ptr, norm_ptr, n, lr, beta1, beta2, eps, wd, bc1, bc2,
            max_norm, HYPER: tl.constexpr, CLIP: tl.constexpr, LP: tl.constexpr, ZERO: tl.constexpr,
            BLOCK: tl.constexpr):  # fmt: skip
    # p, m, v: (n,) fp32; g: (n,); mask: (n,) 1 where decay applies; plp: (n,) compute copy; hyper: (4,) fp32
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gscale = 1.0
    if HYPER:
        lr = tl.load(hyper_ptr)
        bc1 = tl.load(hyper_ptr + 1)
        bc2 = tl.load(hyper_ptr + 2)
        gscale = tl.load(hyper_ptr + 3)
    upd = mask
    if CLIP:
        norm = tl.load(norm_ptr) * gscale
        gscale = gscale * tl.minimum(1.0, max_norm / (norm + 1e-6))
        normv = tl.zeros((BLOCK,), dtype=tl.float32) + norm  # a vector: the interpreter cannot AND scalar bools in
        upd = mask & ((normv - normv) == 0.0)  # False for inf and NaN
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * gscale
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
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
    if LP:
        tl.store(plp_ptr + offs, p.to(plp_ptr.dtype.element_ty), mask=upd)
    if ZERO:
        tl.store(g_ptr + offs, tl.zeros((BLOCK,), dtype=g_ptr.dtype.element_ty), mask=mask)


def adamw_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, decay_mask: torch.Tensor,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, t: int, *,
               p_lp: torch.Tensor | None = None, hyper: torch.Tensor | None = None, norm: torch.Tensor | None = None,
               max_norm: float = 0.0, zero_grad: bool = False) -> None:  # fmt: skip
    """Spec arguments as in microgpt.ops.adamw; keyword extras for the graph-captured step (see module doc)."""
    n = p.numel()
    k_adamw[(triton.cdiv(n, BLOCK),)](
        p, g, m, v, decay_mask, p_lp if p_lp is not None else p, hyper if hyper is not None else p,
        norm if norm is not None else p, n, float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        1.0 - beta1**t, 1.0 - beta2**t, float(max_norm), HYPER=hyper is not None, CLIP=norm is not None,
        LP=p_lp is not None, ZERO=zero_grad, BLOCK=BLOCK)  # fmt: skip
