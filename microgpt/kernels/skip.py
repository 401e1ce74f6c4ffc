"""The U-net skip connection (ops/skip.py gives the math): y = x + w s forward; ds += w dy and dw += sum(dy s)
backward. x, s, y, dy, ds contiguous of any shape (N, C), in the compute dtype; w (1,) the scalar's compute copy,
dw (1,) its fp32 gradient; loads and sums in fp32.

The forward is one elementwise pass (y may be x). The backward is one pass too, which adds w dy into ds (ds may be dy)
and sums dy s, deterministically without atomics: each program sums its own contiguous run of elements into its
slot of `partials` (P,) fp32, and a second kernel of one program adds the P slots in a fixed order into dw. The runtime
sizes `partials` by the device (PARTS_PER_SM programs an SM, kernels/runtime.py), and the backward's grid follows it,
as LayerNorm's weight gradients do.

One fixed launch configuration (BLOCK elements a tile, 4 warps), as the other elementwise passes (relu2, GELU): the
passes are bound by memory and each program's loads are contiguous.
"""

import torch
import triton
import triton.language as tl

from microgpt.kernels.gradclip import sum_parts

BLOCK = 1024  # elements a tile
PARTS_PER_SM = 4  # programs of the backward a streaming multiprocessor: slots of `partials`
BLOCK_P = 1024  # partial sums a tile of the final sum


@triton.jit
def k_skip_fwd(y_ptr, x_ptr, s_ptr, w_ptr, n, BLOCK: tl.constexpr):
    # y, x, s: (n,); w: (1,); y = x + w s (y may be x)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    w = tl.load(w_ptr).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    s = tl.load(s_ptr + offs, mask=mask).to(tl.float32)
    tl.store(y_ptr + offs, (x + w * s).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_skip_bwd(ds_ptr, part_ptr, dy_ptr, s_ptr, w_ptr, n, per_prog, BLOCK: tl.constexpr):
    # ds, dy, s: (n,); w: (1,); part: (P,) fp32, this program's sum of dy s over its per_prog elements (a multiple
    # of BLOCK); ds += w dy (ds may be dy: each element is read before it is written)
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_prog
    w = tl.load(w_ptr).to(tl.float32)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.range(0, per_prog, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        mask = offs < n
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        ds = tl.load(ds_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ds_ptr + offs, (ds + w * dy).to(ds_ptr.dtype.element_ty), mask=mask)
        acc += dy * s
    tl.store(part_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def k_skip_bwd_dw(dw_ptr, part_ptr, P, BLOCK_P: tl.constexpr):
    # dw: (1,) fp32 += the P partial sums, tile by tile in a fixed order
    tl.store(dw_ptr, tl.load(dw_ptr) + sum_parts(part_ptr, P, BLOCK_P))


def skip_forward(y: torch.Tensor, x: torch.Tensor, s: torch.Tensor, w: torch.Tensor) -> None:
    """y = x + w[0] s, one pass (y may be x)."""
    n = x.numel()
    k_skip_fwd[(triton.cdiv(n, BLOCK),)](y, x, s, w, n, BLOCK=BLOCK, num_warps=4)


def scratch_numel(sm_count: int) -> int:
    """fp32 elements of the backward's `partials` scratch on a device of sm_count multiprocessors."""
    return PARTS_PER_SM * sm_count


def skip_backward(
    ds: torch.Tensor, dw: torch.Tensor, dy: torch.Tensor, s: torch.Tensor, w: torch.Tensor, *, partials: torch.Tensor
) -> None:
    """dw (1,) += sum(dy s), ds += w[0] dy (ds may be dy). partials: fp32 scratch of P elements or more
    (scratch_numel): its length bounds the programs."""
    n = dy.numel()
    tiles = triton.cdiv(n, BLOCK)
    per_prog = triton.cdiv(tiles, min(partials.numel(), tiles)) * BLOCK
    P = triton.cdiv(n, per_prog)
    k_skip_bwd[(P,)](ds, partials, dy, s, w, n, per_prog, BLOCK=BLOCK, num_warps=4)
    k_skip_bwd_dw[(1,)](dw, partials, P, BLOCK_P=BLOCK_P, num_warps=4)
