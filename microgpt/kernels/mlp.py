"""MLP: h = x @ w1 (saved, pre-GELU), a = gelu_tanh(h) (saved), out = a @ w2. x:(N,C), w1:(C,4C), w2:(4C,C).

Backward (all grads accumulate):
    dh = dout @ w2.T                       (GEMM into the dh scratch)
    dh *= gelu'(h)                         (k_mlp_bwd: one pass over h and dh writes dh)
    dw2 += a.T @ dout ; dw1 += x.T @ dh ; dx = dh @ w1.T (written: its one writer)
With train.recompute_gelu the plan keeps h only (one (N,4C) activation less per layer) and the same pass also
writes a = gelu(h) into a scratch for dw2's GEMM: a fourth (N,4C) array through the pass (at micro-batch 32 on an
H200, 197 against 140 us a layer: dev/pass_bench.py).
The GEMMs go through linear.mm (Triton, cuBLAS or cuBLASLt, chosen once per shape); with Fp8Weights (precision "fp8")
through fp8.mm8 on E4M3 operands, and GELU and its backward run inside the casts of a and dh (fp8.py).
In bf16 and fp16 on a GPU the forward's first GEMM may instead write h and a = gelu(h) itself (cuBLASLt's GELU_AUX
epilogue, cublaslt.py), which saves the pass; the warm-up times that GEMM under each algorithm cuBLASLt offers
against GEMM + pass and keeps the fastest (at micro-batch 8 on an H200, 65 against 82 us a layer:
dev/gelu_epilogue_bench.py). h is the same either way; a is not quite: cuBLASLt applies its GELU (tanh-GELU to
within 6e-6) to the fp32 sum where the pass applies ours to h rounded, so a moves by about a unit in its last place
(30% of a's values at micro-batch 8). A kept a is the one the forward multiplied by w2; a recomputed one is the
pass's. cuBLASLt's DGELU epilogue (dh from the backward GEMM) measured 3.8x that GEMM + pass, so backward keeps the
pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microgpt.fp8 import Fp8Weight
from microgpt.kernels import cublaslt, fp8, tuning
from microgpt.kernels.gelu import gelu, gelu_grad
from microgpt.kernels.linear import mm

BLOCK = 2048


@triton.jit
def k_mlp_fwd(a_ptr, h_ptr, n, BLOCK: tl.constexpr):
    # a, h: (n,) = (N*4C,); a = gelu_tanh(h)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + offs, mask=mask).to(tl.float32)
    tl.store(a_ptr + offs, gelu(h).to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_mlp_bwd(a_ptr, dh_ptr, h_ptr, n, RECOMPUTE: tl.constexpr, BLOCK: tl.constexpr):
    # a, dh, h: (n,); in: dh holds d(gelu output); out: dh = dh * gelu'(h) and, RECOMPUTE, a = gelu(h)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + offs, mask=mask).to(tl.float32)
    da = tl.load(dh_ptr + offs, mask=mask).to(tl.float32)
    tl.store(dh_ptr + offs, (da * gelu_grad(h)).to(dh_ptr.dtype.element_ty), mask=mask)
    if RECOMPUTE:
        tl.store(a_ptr + offs, gelu(h).to(a_ptr.dtype.element_ty), mask=mask)


def mlp_forward(out: torch.Tensor, h: torch.Tensor, a: torch.Tensor | None, x: torch.Tensor,
                w1: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight,
                q: fp8.Scratch | None = None) -> None:  # fmt: skip
    """out = gelu(x @ w1) @ w2, keeping h = x @ w1 for backward; a receives gelu(h), except in fp8, where GELU's
    output exists only in E4M3 (a may be None: the plan has no such buffer then)."""
    C, H = w1.shape
    h2, x2 = h.view(-1, H), x.view(-1, C)
    if isinstance(w1, Fp8Weight) and isinstance(w2, Fp8Weight):
        _mlp_forward_fp8(out.view(-1, C), h2, x2, w1, w2, q)
        return
    a2 = a.view(-1, H)
    _gelu_forward(a2, h2, x2, w1)
    mm(out.view(-1, C), a2, w2)


_gelu_ways: dict[str, dict[str, tuple[int]]] = {}


def _gelu_forward(a: torch.Tensor, h: torch.Tensor, x: torch.Tensor, w1: torch.Tensor) -> None:
    """h = x @ w1 and a = gelu(h) (2D): GEMM + pass, or one cuBLASLt GEMM under one of its algorithms (bf16 and fp16
    on a GPU), whichever the warm-up timed fastest for this shape (tuning.launch: the pass outside the warm-up)."""
    key = f"{tuple(x.shape)}x{w1.shape[1]}:{x.dtype}:a" + ".".join(map(str, cublaslt.alignment(x, w1, a, h)))
    ways = _gelu_ways.get(key)
    if ways is None:
        ways = {"pass": (-1,)}
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and cublaslt.available():
            ways |= {f"lt{i}": (i,) for i in range(cublaslt.n_algos(a, x, w1, h, cublaslt.GELU_AUX))}
        _gelu_ways[key] = ways

    def make(algo: int):
        if algo >= 0:
            return lambda: cublaslt.gelu_aux(a, h, x, w1, algo)

        def gemm_and_pass() -> None:
            mm(h, x, w1)
            n = h.numel()
            k_mlp_fwd[(triton.cdiv(n, BLOCK),)](a, h, n, BLOCK=BLOCK)

        return gemm_and_pass

    tuning.launch("mlp_gelu", key, ways, make)


def _mlp_forward_fp8(out: torch.Tensor, h: torch.Tensor, x: torch.Tensor, w1: Fp8Weight, w2: Fp8Weight,
                     q: fp8.Scratch) -> None:  # fmt: skip
    """mlp_forward's two GEMMs on E4M3 operands (2D views: x, out (N,C); h (N,H)). Each input is cast once, into the
    rows its GEMM reads and the transpose its site keeps for the weight gradient; a = gelu(h) only ever exists in
    E4M3 (its cast computes GELU)."""
    (N, C), H = x.shape, h.shape[1]
    x8, a8 = q.view(q.x8, N, C), q.view(q.x8, N, H)
    fp8.cast(x, w1.xslot, x8, w1.xt.view(C, N), w1.priming.on)
    fp8.mm8(h, x8, w1.xslot[:1], w1.w8t[0].t(), w1.scale[:1])
    fp8.cast(h, w2.xslot, a8, w2.xt.view(H, N), w2.priming.on, op=fp8.GELU)
    fp8.mm8(out, a8, w2.xslot[:1], w2.w8t[0].t(), w2.scale[:1])


def mlp_backward(
    dx: torch.Tensor,
    dw1: torch.Tensor,
    dw2: torch.Tensor,
    dout: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor,
    w1: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    a: torch.Tensor | None,
    dh: torch.Tensor,
    q: fp8.Scratch | None = None,
    *,
    recompute: bool,
) -> None:
    """recompute: a holds nothing of this layer (scratch) and the pass writes gelu(h) into it before dW_2's GEMM
    reads it; else a is the forward's gelu(h), kept (memory.gelu_output_saved)."""
    C, H = w1.shape
    h2, dh2 = h.view(-1, H), dh.view(-1, H)
    dout2, x2 = dout.view(-1, C), x.view(-1, C)
    if isinstance(w1, Fp8Weight) and isinstance(w2, Fp8Weight):  # a: unused (None where unplanned)
        _mlp_backward_fp8(dx.view(-1, C), dw1, dw2, dout2, x2, h2, w1, w2, dh2, q)
        return
    a2 = a.view(-1, H)
    mm(dh2, dout2, w2.t())
    n = h2.numel()
    k_mlp_bwd[(triton.cdiv(n, BLOCK),)](a2, dh2, h2, n, RECOMPUTE=recompute, BLOCK=BLOCK)
    mm(dw2, a2.t(), dout2, accumulate=True)
    mm(dw1, x2.t(), dh2, accumulate=True)
    mm(dx.view(-1, C), dh2, w1.t())


def _mlp_backward_fp8(dx: torch.Tensor, dw1: torch.Tensor, dw2: torch.Tensor, dout: torch.Tensor, x: torch.Tensor,
                      h: torch.Tensor, w1: Fp8Weight, w2: Fp8Weight, da: torch.Tensor,
                      q: fp8.Scratch) -> None:  # fmt: skip
    """mlp_backward's six GEMMs on E4M3 operands (2D views: x, dout, dx (N,C); h, da (N,H)). The inputs' E4M3 copies
    (x, a = gelu(h)) are the forward's, saved transposed with their sites (w1.xt, w2.xt); dh = da * gelu'(h) only
    ever exists in E4M3 (its cast computes it), in the gradient scratch once dw2 is done with dout's."""
    (N, C), H = x.shape, h.shape[1]
    g8, g8t = q.view(q.g8, N, C), q.view(q.g8t, C, N)
    fp8.cast(dout, w2.gslot, g8, g8t, w2.priming.on)
    fp8.mm8(da, g8, w2.gslot[:1], w2.w8.t(), w2.scale[:1])  # the gradient reaching a
    fp8.mm8(dw2, w2.xt.view(H, N), w2.xslot[:1], g8t.t(), w2.gslot[:1], accumulate=True, wgrad=q.wgrad)
    dh8, dh8t = q.view(q.g8, N, H), q.view(q.g8t, H, N)
    fp8.cast(h, w1.gslot, dh8, dh8t, w1.priming.on, op=fp8.GELU_GRAD, x2=da)
    fp8.mm8(dw1, w1.xt.view(C, N), w1.xslot[:1], dh8t.t(), w1.gslot[:1], accumulate=True, wgrad=q.wgrad)
    fp8.mm8(dx, dh8, w1.gslot[:1], w1.w8.t(), w1.scale[:1])
