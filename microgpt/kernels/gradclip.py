"""The global gradient norm over the flat grads array (microgpt/ops/gradclip.py is the specification).

Two-stage deterministic norm: k_grad_norm_partial writes one sum of squares per `block` elements, then
k_grad_norm_final (one program) adds the partials in a fixed order and takes the square root. The clip factor
is applied by the optimizers' kernels (kernels/adamw.py, kernels/muon.py) as they read the gradients: each reads the
norm on the device (no host round trip inside the CUDA graph) through clip_factor and finite, as the NumPy
optimizers call ops/gradclip.py's clip_factor.
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
def sum_parts(part_ptr, P, BLOCK: tl.constexpr):
    # the sum of part: (P,) fp32 partial sums, BLOCK at a time and then across the tile: a fixed order (every
    # two-pass reduction's second pass: the norm's, Muon's per matrix, the skip scalars')
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for p0 in range(0, P, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        acc += tl.load(part_ptr + offs, mask=offs < P, other=0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def k_grad_norm_final(norm_ptr, part_ptr, P, BLOCK: tl.constexpr):
    # norm: (1,) fp32 = sqrt(sum(part)); one program, fixed order
    tl.store(norm_ptr, tl.sqrt(sum_parts(part_ptr, P, BLOCK)))


@triton.jit
def clip_factor(gscale, norm_ptr, max_norm):
    # gscale: fp32 scalar; norm: (1,) fp32, the raw gradients' norm -> (g's factor, total = the mean's norm)
    total = tl.load(norm_ptr) * gscale
    return gscale * tl.minimum(1.0, max_norm / (total + 1e-6)), total


@triton.jit
def finite(total, mask):
    # mask, all False where total is inf or NaN (compared as a tensor: the interpreter cannot AND scalar bools in)
    totalv = tl.where(mask, total, 0.0)
    return mask & ((totalv - totalv) == 0.0)


def grad_norm_partial(partials: torch.Tensor, g: torch.Tensor, block: int) -> None:
    n = g.numel()
    P = triton.cdiv(n, block)
    k_grad_norm_partial[(P,)](partials, g, n, block, BLOCK=min(BLOCK, triton.next_power_of_2(block)))


def grad_norm_final(norm: torch.Tensor, partials: torch.Tensor) -> None:
    P = partials.numel()
    k_grad_norm_final[(1,)](norm, partials, P, BLOCK=min(1024, triton.next_power_of_2(P)))
