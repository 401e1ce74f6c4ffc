"""MLP: h = x @ w1 (saved, pre-GELU), a = gelu_tanh(h) (saved), out = a @ w2. x:(N,C), w1:(C,4C), w2:(4C,C).

Backward (all grads accumulate):
    dh = dout @ w2.T ; dw2 += a.T @ dout    (W_2's site)
    dh *= gelu'(h)                          (the prologue of W_1's site: k_gelu_bwd, one pass over h and dh)
    dw1 += x.T @ dh ; dx = dh @ w1.T        (W_1's site; dx written: its one writer)
With train.recompute_gelu the plan keeps h only (one (N,4C) activation less per layer) and backward first writes
a = gelu(h) into a scratch for dw2's GEMM (k_gelu_fwd).
The two linears are GEMM sites of the precision's Matmul `mm` (microgpt/engine/precision.py), which applies GELU around
its GEMMs (ops/mlp.py gives the contract): in bf16 and fp16 the forward's first GEMM may write h and a = gelu(h)
itself (cuBLASLt's GELU_AUX epilogue, chosen in the warm-up against GEMM + pass: gemm.Gemm.mm_gelu); in fp8, GELU
and its backward run inside the casts of a and dh (fp8_cast.py), and the plan has no a (a is None).
"""

from __future__ import annotations

import torch

from microgpt.kernels.gelu import gelu_forward
from microgpt.kernels.linear import Matmul


def mlp_forward(
    out: torch.Tensor,
    h: torch.Tensor,
    a: torch.Tensor | None,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    mm: Matmul,
) -> None:
    """out = gelu(x @ w1) @ w2, keeping h = x @ w1 for backward; a receives gelu(h), except where the precision
    casts GELU's output straight to its operand (a None: the plan has no such buffer then)."""
    mm.forward(h, x, w1, gelu_out=a)
    mm.forward(out, a, w2, gelu_of=h)


def mlp_backward(
    dx: torch.Tensor,
    dw1: torch.Tensor,
    dw2: torch.Tensor,
    dout: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    a: torch.Tensor | None,
    dh: torch.Tensor,
    *,
    mm: Matmul,
    recompute: bool,
) -> None:
    """recompute: a holds nothing of this layer (scratch) and gets gelu(h) before dW_2's GEMM reads it; else a is
    the forward's gelu(h), kept (memory.gelu_output_saved), or None where the precision kept its own copy."""
    if recompute and a is not None:
        gelu_forward(a, h)
    mm.backward(dh, dw2, dout, a, w2)
    mm.backward(dx, dw1, dh, x, w1, dgelu_of=h)
