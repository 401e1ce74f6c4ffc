"""MLP: h = x @ w1 (pre-activation), a = act(h) (saved), out = a @ w2. x:(N,C), w1:(C,4C), w2:(4C,C). act: GELU (tanh
approximation) in the GPT-2 block, ReLU^2 in the modern one (ops/mlp.py gives the contract and what each keeps).

Backward (all grads accumulate):
    dh = (dout @ w2.T) * act'(h) ; dw2 += a.T @ dout    (W_2's site; ReLU^2's act' read from a: 2 sqrt(a))
    dw1 += x.T @ dh ; dx = dh @ w1.T                    (W_1's site; dx written: its one writer)
GELU keeps h (its backward reads it) and a; ReLU^2 where a is kept keeps a alone (h None: W_1's GEMM writes a only).
With train.recompute_gelu the plan keeps h only (one (N,4C) activation less per layer) and backward first writes
a = act(h) into a scratch for dw2's GEMM (and ReLU^2's act').
The two linears are GEMM sites of the precision's Matmul `mm` (microgpt/engine/precision.py), which applies the
activation around its GEMMs (ops/mlp.py gives the contract). In fp32, bf16 and fp16 each activation runs with the GEMM
that makes its input, as a pass after it or in its epilogue, whichever the warm-up timed faster for the shape: a =
act(h) with W_1's forward GEMM (gemm.Gemm.mm_act: the pass, our Triton tile's epilogue, or for GELU in bf16 and fp16
cuBLASLt's GELU_AUX epilogue), dh *= act'(h) with W_2's input-gradient GEMM (gemm.Gemm.mm_dact: the pass, or the
tile's epilogue). In fp8 (mm.dact_in_cast) the activation and its backward run inside the casts of a and dh
(fp8_cast.py), both from h: W_2's GEMM writes the gradient reaching a, W_1's cast turns it, and the plan has no a (a
is None) and keeps h in either block.
"""

from __future__ import annotations

import torch

from microgpt.kernels.gemm import ACTIVATIONS
from microgpt.kernels.linear import Matmul
from microgpt.ops.linear import FROM_OUTPUT


def mlp_forward(
    out: torch.Tensor,
    h: torch.Tensor | None,
    a: torch.Tensor | None,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    mm: Matmul,
    act: str = "gelu",
) -> None:
    """out = act(x @ w1) @ w2, keeping h = x @ w1 for backward (h None: not kept, ReLU^2's where a is); a receives
    act(h), except where the precision casts the activation's output straight to its operand (a None: the plan has
    no such buffer then)."""
    mm.forward(h, x, w1, act_out=a, act=act)
    mm.forward(out, a, w2, act_of=h, act=act)


def mlp_backward(
    dx: torch.Tensor,
    dw1: torch.Tensor,
    dw2: torch.Tensor,
    dout: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    a: torch.Tensor | None,
    dh: torch.Tensor,
    *,
    mm: Matmul,
    recompute: bool,
    act: str = "gelu",
) -> None:
    """recompute: a holds nothing of this layer (scratch) and gets act(h) before dW_2's GEMM reads it; else a is
    the forward's act(h), kept (memory.act_output_saved), or None where the precision kept its own copy. h: the
    forward's, None where it kept a alone."""
    if recompute and a is not None:
        ACTIVATIONS[act][0](a, h)
    if mm.dact_in_cast:  # W_1's operand cast computes dh * act'(h)
        mm.backward(dh, dw2, dout, a, w2)
        mm.backward(dx, dw1, dh, x, w1, dact_of=h, act=act)
        return
    # W_2's input-gradient GEMM writes dh * act'(h), act' read from a (FROM_OUTPUT: ReLU^2) or from h (GELU)
    read = {"dx_act_out": a} if act in FROM_OUTPUT else {"dx_act_of": h}
    mm.backward(dh, dw2, dout, a, w2, **read, act=act)
    mm.backward(dx, dw1, dh, x, w1)
