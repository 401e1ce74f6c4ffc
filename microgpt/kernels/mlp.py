"""MLP: h = x @ w1 (saved, pre-GELU), a = gelu_tanh(h) (scratch), out = a @ w2. x:(N,C), w1:(C,4C), w2:(4C,C).

Saving h and recomputing a in backward costs one elementwise pass and saves an (N,4C) activation per layer.
Backward (all grads accumulate):
    dh = dout @ w2.T                       (GEMM into the dh scratch)
    a = gelu(h); dh *= gelu'(h)            (k_mlp_bwd: one pass over h and dh writes a and dh)
    dw2 += a.T @ dout ; dw1 += x.T @ dh ; dx = dh @ w1.T (written: its one writer)
The GEMMs go through linear.mm (Triton or cuBLAS, chosen once per shape); with Fp8Weights (precision "fp8")
through fp8.mm8 on E4M3 operands: x and a = gelu(h) cast as activations, dout and dh as gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microgpt.fp8 import Fp8Weight
from microgpt.kernels import fp8
from microgpt.kernels.linear import mm

BLOCK = 2048


@triton.jit
def _tanh(u):
    # tanh through exp: saturates cleanly to +-1 (exp overflows to inf, 2/inf = 0)
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _amax_of_stored(amax_ptr, y, mask):
    # amax_ptr[0] = max(amax_ptr[0], max |y| over the block) as y is stored (fp8: the cast of y needs its amax)
    tl.atomic_max(amax_ptr, tl.max(tl.where(mask, tl.abs(y.to(tl.float32)), 0.0), axis=0))


@triton.jit
def k_mlp_fwd(a_ptr, h_ptr, amax_ptr, n, AMAX: tl.constexpr, BLOCK: tl.constexpr):
    # a, h: (n,) = (N*4C,); a = gelu_tanh(h); AMAX: also amax_ptr[0] = max(amax_ptr[0], max |a|)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + offs, mask=mask).to(tl.float32)
    t = _tanh(0.7978845608028654 * (h + 0.044715 * h * h * h))
    a = (0.5 * h * (1.0 + t)).to(a_ptr.dtype.element_ty)
    tl.store(a_ptr + offs, a, mask=mask)
    if AMAX:
        _amax_of_stored(amax_ptr, a, mask)


@triton.jit
def k_mlp_bwd(a_ptr, dh_ptr, h_ptr, amax_ptr, n, FP8: tl.constexpr, BLOCK: tl.constexpr):
    # a, dh, h: (n,); in: dh holds d(gelu output); out: a = gelu(h), dh = dh * gelu'(h)
    # FP8: a is not written (the forward saved its E4M3 copy) and amax_ptr[0] = max(amax_ptr[0], max |dh|)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + offs, mask=mask).to(tl.float32)
    da = tl.load(dh_ptr + offs, mask=mask).to(tl.float32)
    t = _tanh(0.7978845608028654 * (h + 0.044715 * h * h * h))
    dgelu = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * h * h)
    dh = (da * dgelu).to(dh_ptr.dtype.element_ty)
    tl.store(dh_ptr + offs, dh, mask=mask)
    if FP8:
        _amax_of_stored(amax_ptr, dh, mask)
    else:
        tl.store(a_ptr + offs, (0.5 * h * (1.0 + t)).to(a_ptr.dtype.element_ty), mask=mask)


def mlp_forward(out: torch.Tensor, h: torch.Tensor, a: torch.Tensor, x: torch.Tensor, w1: torch.Tensor | Fp8Weight,
                w2: torch.Tensor | Fp8Weight, q: fp8.Scratch | None = None) -> None:  # fmt: skip
    C, H = w1.shape
    h2, a2, x2 = h.view(-1, H), a.view(-1, H), x.view(-1, C)
    if isinstance(w1, Fp8Weight) and isinstance(w2, Fp8Weight):
        _mlp_forward_fp8(out.view(-1, C), h2, a2, x2, w1, w2, q)
        return
    mm(h2, x2, w1)
    n = h2.numel()
    k_mlp_fwd[(triton.cdiv(n, BLOCK),)](a2, h2, h2, n, AMAX=False, BLOCK=BLOCK)  # amax_ptr unused: any pointer
    mm(out.view(-1, C), a2, w2)


def _mlp_forward_fp8(out: torch.Tensor, h: torch.Tensor, a: torch.Tensor, x: torch.Tensor, w1: Fp8Weight,
                     w2: Fp8Weight, q: fp8.Scratch) -> None:  # fmt: skip
    """mlp_forward's two GEMMs on E4M3 operands (2D views: x, out (N,C); h, a (N,H)). Each input is cast once, into
    the rows its GEMM reads and the transpose its site keeps for the weight gradient; GELU leaves a's amax."""
    (N, C), H = x.shape, h.shape[1]
    x8, a8 = q.view(q.x8, N, C), q.view(q.x8, N, H)
    fp8.quantize(x, w1.xscale, x8, w1.xt.view(C, N))
    fp8.mm8(h, x8, w1.xscale[:1], w1.w8t[0].t(), w1.scale[:1])
    w2.xscale[1].zero_()
    n = h.numel()
    k_mlp_fwd[(triton.cdiv(n, BLOCK),)](a, h, w2.xscale[1:], n, AMAX=True, BLOCK=BLOCK)
    fp8.quantize(a, w2.xscale, a8, w2.xt.view(H, N), amax_done=True)
    fp8.mm8(out, a8, w2.xscale[:1], w2.w8t[0].t(), w2.scale[:1])


def mlp_backward(
    dx: torch.Tensor,
    dw1: torch.Tensor,
    dw2: torch.Tensor,
    dout: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor,
    w1: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    a: torch.Tensor,
    dh: torch.Tensor,
    q: fp8.Scratch | None = None,
) -> None:
    C, H = w1.shape
    h2, a2, dh2 = h.view(-1, H), a.view(-1, H), dh.view(-1, H)
    dout2, x2 = dout.view(-1, C), x.view(-1, C)
    if isinstance(w1, Fp8Weight) and isinstance(w2, Fp8Weight):
        _mlp_backward_fp8(dx.view(-1, C), dw1, dw2, dout2, x2, h2, w1, w2, a2, dh2, q)
        return
    mm(dh2, dout2, w2.t())
    n = h2.numel()
    k_mlp_bwd[(triton.cdiv(n, BLOCK),)](a2, dh2, h2, h2, n, FP8=False, BLOCK=BLOCK)  # amax_ptr unused
    mm(dw2, a2.t(), dout2, accumulate=True)
    mm(dw1, x2.t(), dh2, accumulate=True)
    mm(dx.view(-1, C), dh2, w1.t())


def _mlp_backward_fp8(dx: torch.Tensor, dw1: torch.Tensor, dw2: torch.Tensor, dout: torch.Tensor, x: torch.Tensor,
                      h: torch.Tensor, w1: Fp8Weight, w2: Fp8Weight, a: torch.Tensor, dh: torch.Tensor,
                      q: fp8.Scratch) -> None:  # fmt: skip
    """mlp_backward's six GEMMs on E4M3 operands (2D views: x, dout, dx (N,C); h, a, dh (N,H)). The inputs' E4M3
    copies (x, a = gelu(h)) are the forward's, saved transposed with their sites (w1.xt, w2.xt)."""
    (N, C), H = x.shape, h.shape[1]
    sd, sdh = q.scales[fp8.SLOT_DY], q.scales[fp8.SLOT_DH]
    g8, g8t = q.view(q.g8, N, C), q.view(q.g8t, C, N)
    fp8.quantize(dout, sd, g8, g8t)
    fp8.mm8(dh, g8, sd[:1], w2.w8.t(), w2.scale[:1])  # gradient reaching a
    n = h.numel()
    sdh[1].zero_()
    k_mlp_bwd[(triton.cdiv(n, BLOCK),)](a, dh, h, sdh[1:], n, FP8=True, BLOCK=BLOCK)
    fp8.mm8(dw2, w2.xt.view(H, N), w2.xscale[:1], g8t.t(), sd[:1], accumulate=True, wgrad=q.wgrad)
    dh8, dh8t = q.view(q.g8, N, H), q.view(q.g8t, H, N)
    fp8.quantize(dh, sdh, dh8, dh8t, amax_done=True)
    fp8.mm8(dw1, w1.xt.view(C, N), w1.xscale[:1], dh8t.t(), sdh[:1], accumulate=True, wgrad=q.wgrad)
    fp8.mm8(dx, dh8, sdh[:1], w1.w8.t(), w1.scale[:1])
