"""Linear layer without bias; the weight is stored [in, out] so forward is a plain matmul.

    out = x @ w

Shapes: x (N,C), w (C,OC), out (N,OC). The attention's input projection is one linear of G = 3 weights:
w (G,C,OC), out (G,N,OC), out[g] = x @ w[g].
Forward saves nothing of its own: backward needs x, which is the previous op's output and is kept
by the caller anyway.

Backward:

    dx  = dout @ w.T      (N,C)     written: this backward is dx's only writer (G > 1: the sum over g)
    dw += x.T @ dout      (C,OC)    added: weight gradients accumulate over micro-batches

A linear is one GEMM site, so the pair is its precision's Matmul (microgpt/engine/precision.py), handed in as `mm`.
`Matmul` below is fp32's, the reference (float64 in the gradient checks); ops/fp8.py holds fp8's. A Matmul also
applies the MLP's activation around its GEMMs (ops/mlp.py): ACTIVATIONS names them, GPT-2's GELU and the modern
block's ReLU^2, each a forward (out, h, rows) and a backward (dh, h, rows) that turns dh in place from h;
FROM_OUTPUT names those whose backward W_2's GEMM reads from the activation's output a instead (ReLU^2's: dh *=
2 sqrt(a), ops/relu2.py), so that the MLP keeps a alone.
"""

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from microgpt.ops.gelu import gelu, gelu_backward
from microgpt.ops.relu2 import relu2_backward, relu2_backward_h, relu2_forward
from microgpt.ops.rows import SERIAL, Rows

ChunkLogits = Callable[[NDArray, int, int], None]  # logits(z, i, j): z = the logits of rows i .. j
Act = Callable[[NDArray, NDArray, Rows], None]

# the MLP's activation by name (the block family's: engine/model.py): out = act(h, rows), and dh *= act'(h) in place
# from h (GELU's backward; ReLU^2's where fp8's cast computes it: ops/fp8.py's dact_of)
ACTIVATIONS: dict[str, tuple[Act, Act]] = {"gelu": (gelu, gelu_backward), "relu2": (relu2_forward, relu2_backward_h)}
# the activations whose derivative W_2's GEMM reads from their output a = act(h) (backward's dx_act_out), and that
# backward, dh *= act'(h) given a: ReLU^2's 2 sqrt(a), equal to 2 max(h, 0) (ops/relu2.py), so the MLP keeps no h;
# their forward runs in place too (act(a, a)), so that W_1's GEMM may write into a (forward's y None)
FROM_OUTPUT: dict[str, Act] = {"relu2": relu2_backward}


class Matmul:
    """The GEMM sites in the arrays' own dtype: numpy's matmul, the MLP's activation as a separate pass after the GEMM
    that makes its input (over row ranges on `rows`: ops/rows.py; the backend hands in its own): a = act(h) after W_1's
    forward GEMM, dh *= act'(h) after W_2's input-gradient GEMM (backward's dx_act_of, or dx_act_out)."""

    dact_in_cast = False  # the MLP's act' runs with W_2's input-gradient GEMM, not inside W_1's operand cast (fp8's)

    def __init__(self, rows: Rows = SERIAL) -> None:
        self.rows = rows

    @staticmethod
    def unsupported(precision: str) -> str | None:
        """Why this machine cannot run this precision here (None: it can)."""
        return None

    def forward(
        self,
        y: NDArray | None,
        x: NDArray,
        w: NDArray,
        *,
        act_out: NDArray | None = None,
        act_of: NDArray | None = None,
        act: str = "gelu",
    ) -> None:
        """y = x @ w (w (G,C,OC): y (G,N,OC) by broadcasting); act_out: also act(y) (ACTIVATIONS[act]), and y None
        where y is not kept (the product goes into act_out, and the activation over it in place). act_of: x holds
        act of it already (this precision keeps a)."""
        if y is None:
            assert act in FROM_OUTPUT, f"{act}'s backward reads h: forward keeps it"
            np.matmul(x, w, out=act_out)
            ACTIVATIONS[act][0](act_out, act_out, self.rows)
            return
        np.matmul(x, w, out=y)
        if act_out is not None:
            ACTIVATIONS[act][0](act_out, y, self.rows)

    def backward(
        self,
        dx: NDArray,
        dw: NDArray,
        dy: NDArray,
        x: NDArray,
        w: NDArray,
        *,
        dx_act_of: NDArray | None = None,
        dx_act_out: NDArray | None = None,
        act: str = "gelu",
    ) -> None:
        """dx = dy @ w.T (written) ; dw += x.T @ dy. G weights: dx = sum_g dy[g] @ w[g].T, dw[g] +=. dx_act_of (one
        weight): dx is then turned into dx * act'(dx_act_of), in place (the GEMM's result, in dx's dtype, times
        act'); dx_act_out, for an activation of FROM_OUTPUT: the same act'(h), read from a = dx_act_out = act(h)."""
        if w.ndim == 2:
            np.matmul(dy, w.T, out=dx)
            if (read := dact_read(act, dx_act_of, dx_act_out)) is not None:
                (FROM_OUTPUT[act] if act in FROM_OUTPUT else ACTIVATIONS[act][1])(dx, read, self.rows)
            dw += x.T @ dy
            return
        assert dx_act_of is None and dx_act_out is None, "an activation's gradient follows a linear of one weight"
        np.matmul(dy[0], w[0].T, out=dx)
        for g in range(1, w.shape[0]):
            dx += dy[g] @ w[g].T
        for g in range(w.shape[0]):
            dw[g] += x.T @ dy[g]

    def logits(self, x: NDArray, wte: NDArray) -> ChunkLogits:
        """The tied head's logits GEMM, chunk by chunk: z = x[i:j] @ wte.T."""

        def chunk(z: NDArray, i: int, j: int) -> None:
            np.matmul(x[i:j], wte.T, out=z)

        return chunk

    def logits_backward(self, dx: NDArray, dwte: NDArray, dz: NDArray, x: NDArray, wte: NDArray) -> None:
        """One chunk's two head gradient GEMMs: dx += dz @ wte ; dwte += dz.T @ x."""
        dx += dz @ wte
        dwte += dz.T @ x


def dact_read(act: str, dx_act_of: Any, dx_act_out: Any) -> Any:
    """What act' reads where W_2's input-gradient GEMM applies it (backward's dx_act_of, dx_act_out): h for an
    activation outside FROM_OUTPUT, its output a for one in it; None where neither is given. Every Matmul that applies
    act' with that GEMM checks its arguments here, so that a caller handing the other one fails (ops/mlp.py)."""
    if dx_act_of is None and dx_act_out is None:
        return None
    out = act in FROM_OUTPUT
    assert (dx_act_of is None) == out and (dx_act_out is None) != out, f"{act}' reads {'a' if out else 'h'}"
    return dx_act_out if out else dx_act_of


def linear_forward(out: NDArray, x: NDArray, w: NDArray, *, mm: Matmul) -> None:
    """out (N,OC) = x (N,C) @ w (C,OC); out (G,N,OC) = x @ w[g] for w (G,C,OC)."""
    mm.forward(out, x, w)


def linear_backward(dx: NDArray, dw: NDArray, dout: NDArray, x: NDArray, w: NDArray, *, mm: Matmul) -> None:
    """dx (N,C) = dout @ w.T ; dw (C,OC) += x.T @ dout. With G weights: dx = sum_g dout[g] @ w[g].T, dw[g] +=."""
    mm.backward(dx, dw, dout, x, w)
