"""Global grad-norm clipping over the flat grads array, as torch.nn.utils.clip_grad_norm_.

Two-stage deterministic norm: k_grad_norm_partial writes one sum of squares per `block` elements, then
k_grad_norm_final (one program) adds the partials in a fixed order and takes the square root. k_grad_scale
multiplies in place by a host float, or, inside a CUDA graph where the host cannot read the norm, by a factor
computed on the device: scale * min(1, max_norm / (norm * scale + 1e-6)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microgpt.kernels import tuning

BLOCK = 1024 if tuning.INTERPRET else 4096


@triton.jit
def k_grad_norm_partial(part_ptr, g_ptr, n, block, BLOCK: tl.constexpr):
    # part: (P,) fp32, part[i] = sum(g[i*block:(i+1)*block]**2); g: (n,)
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    start = pid * block
    for off in range(0, block, BLOCK):
        offs = start + off + tl.arange(0, BLOCK)
        g = tl.load(g_ptr + offs, mask=(offs < n) & (off + tl.arange(0, BLOCK) < block), other=0.0).to(tl.float32)
        acc += g * g
    tl.store(part_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def k_grad_norm_final(norm_ptr, part_ptr, P, BLOCK: tl.constexpr):
    # norm: (1,) fp32 = sqrt(sum(part)); one program, fixed order
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for p0 in range(0, P, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        acc += tl.load(part_ptr + offs, mask=offs < P, other=0.0)
    tl.store(norm_ptr, tl.sqrt(tl.sum(acc, axis=0)))


@triton.jit
def k_grad_scale(g_ptr, n, scale, norm_ptr, max_norm, CLIP: tl.constexpr, BLOCK: tl.constexpr):
    # g: (n,) *= scale, times the clip coefficient read from norm (1,) when CLIP
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    f = scale
    if CLIP:
        f = scale * tl.minimum(1.0, max_norm / (tl.load(norm_ptr) * scale + 1e-6))
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    tl.store(g_ptr + offs, (g * f).to(g_ptr.dtype.element_ty), mask=mask)


def grad_norm_partial(partials: torch.Tensor, g: torch.Tensor, block: int) -> None:
    n = g.numel()
    P = triton.cdiv(n, block)
    k_grad_norm_partial[(P,)](partials, g, n, block, BLOCK=min(BLOCK, triton.next_power_of_2(block)))


def grad_norm_final(norm: torch.Tensor, partials: torch.Tensor) -> None:
    P = partials.numel()
    k_grad_norm_final[(1,)](norm, partials, P, BLOCK=min(1024, triton.next_power_of_2(P)))


def grad_scale(g: torch.Tensor, scale: float, *, norm: torch.Tensor | None = None, max_norm: float = 0.0) -> None:
    """g *= scale; with norm (a (1,) device tensor of the unscaled grads' norm), also clip to max_norm on device."""
    n = g.numel()
    k_grad_scale[(triton.cdiv(n, BLOCK),)](g, n, float(scale), norm if norm is not None else g, float(max_norm),
                                           CLIP=norm is not None, BLOCK=BLOCK)  # fmt: skip


def clip_coef(norm: torch.Tensor, max_norm: float) -> float:
    """min(1, max_norm / (norm + 1e-6)) on the host (reads the norm back: not for use inside a CUDA graph)."""
    return min(1.0, max_norm / (float(norm.reshape(-1)[0]) + 1e-6))
