"""MLP block: two bias-free linears with an activation between them: GELU (tanh approximation, as GPT-2: ops/gelu.py)
in the GPT-2 block, ReLU^2 (ops/relu2.py) in the modern one (`act`: ops/linear.ACTIVATIONS names them).

    h   = x @ w1                             (N,4C)  pre-activation: saved where backward reads it (below)
    a   = act(h)                             (N,4C)  saved (or, train.recompute_gelu, scratch)
    out = a @ w2                             (N,C)

Shapes: x, out (N,C); w1 (C,4C); w2 (4C,C); h, a, dh (N,4C).

Backward:

    dh   = dout @ w2.T                       (the gradient reaching a)
    dw2 += a.T @ dout
    dh   = dh * act'(h)                      GELU: gelu'(h); ReLU^2: 2 sqrt(a) (= 2 max(h, 0): ops/relu2.py)
    dw1 += x.T @ dh
    dx   = dh @ w1.T                         (written: this backward is dx's only writer)

What each keeps (engine/memory.py plans it). GELU's backward reads h: forward saves h and a (memory.act_output_saved),
or with train.recompute_gelu h only, and backward recomputes a = act(h) into a scratch first (one (N,4C) activation
less per layer, one elementwise pass more). ReLU^2's derivative is read from its output (ops/linear.FROM_OUTPUT), so
where a is saved forward keeps a alone and h is None: W_1's GEMM writes its product into a and the activation runs
over it in place (or in the GEMM's epilogue, which stores a alone). With train.recompute_gelu ReLU^2 keeps h, as GELU
does (a, a scratch, cannot give h back), and backward reads the recomputed a. fp8 (mm.dact_in_cast) keeps h in
either block: its cast of W_1's output gradient computes dh * act'(h) from h (relu2_backward_h for ReLU^2), and on the
GPU act(h) exists only in E4M3 (a is None).

Rounding, in a compute dtype narrower than the sums (bf16, fp16): h and dout @ w2.T are the GEMMs' fp32 sums rounded
to that dtype, and a = act(h) and dh * act'(h) are computed in fp32 from those rounded values and rounded once more
(ReLU^2's slope sqrt(a) rounded to that dtype too, which gives max(h, 0) back: ops/relu2.py says where exactly).
A GEMM whose epilogue applies the activation keeps this order (our Triton tile's), except cuBLASLt's GELU_AUX
epilogue, which applies GELU to the fp32 sum: there a may differ by a unit in its last place. Here, in the arrays'
dtype, each step rounds to that dtype as it writes.

The two linears are GEMM sites of the precision's Matmul `mm` (microgpt/engine/precision.py), which applies the
activation with its GEMMs: forward(h, x, w1, act_out=a) writes a = act(h) too (an epilogue it may fuse into the GEMM;
h None: a alone), forward(out, a, w2, act_of=h) reads a = act(h) (a precision may compute it inside its operand cast,
where a is None). dh * act'(h) is made where the precision says (mm.dact_in_cast): backward(dh, dw2, dout, a, w2,
dx_act_of=h) writes it (GELU; ReLU^2's reads a: dx_act_out=a) (a pass after the GEMM, or its epilogue), or, in fp8,
backward(dx, dw1, dh, x, w1, dact_of=h) turns the gradient reaching a as it casts it.
"""

from numpy.typing import NDArray

from microgpt.ops.linear import ACTIVATIONS, FROM_OUTPUT, Matmul
from microgpt.ops.rows import SERIAL, Rows


def mlp_forward(
    out: NDArray,
    h: NDArray | None,
    a: NDArray,
    x: NDArray,
    w1: NDArray,
    w2: NDArray,
    *,
    mm: Matmul,
    act: str = "gelu",
) -> None:
    """out (N,C) = act(x @ w1) @ w2; writes a = act(h) (N,4C) for backward, and h = x @ w1 (N,4C) unless h is None
    (an activation of FROM_OUTPUT whose a is kept: the module docstring)."""
    mm.forward(h, x, w1, act_out=a, act=act)
    mm.forward(out, a, w2, act_of=h, act=act)


def mlp_backward(
    dx: NDArray,
    dw1: NDArray,
    dw2: NDArray,
    dout: NDArray,
    x: NDArray,
    h: NDArray | None,
    w1: NDArray,
    w2: NDArray,
    a: NDArray,
    dh: NDArray,
    *,
    mm: Matmul,
    recompute: bool,
    rows: Rows = SERIAL,
    act: str = "gelu",
) -> None:
    """dx (N,C) = the input gradient; dw1 (C,4C), dw2 (4C,C) += theirs; dh (N,4C) is scratch. a (N,4C) is the
    forward's act(h), or with recompute a scratch this call fills with it first. h: the forward's, None where it
    kept a alone."""
    if recompute:
        ACTIVATIONS[act][0](a, h, rows)
    if mm.dact_in_cast:  # fp8: W_1's operand cast computes dh * act'(h)
        mm.backward(dh, dw2, dout, a, w2)
        mm.backward(dx, dw1, dh, x, w1, dact_of=h, act=act)
        return
    # W_2's input-gradient GEMM writes dh * act'(h), act' read from a (FROM_OUTPUT: ReLU^2) or from h (GELU)
    read = {"dx_act_out": a} if act in FROM_OUTPUT else {"dx_act_of": h}
    mm.backward(dh, dw2, dout, a, w2, **read, act=act)
    mm.backward(dx, dw1, dh, x, w1)
