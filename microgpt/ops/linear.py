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
block's ReLU^2, each a forward (out, h, rows) and a backward (dh, h, rows) that turns dh in place.
"""

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from microgpt.ops.gelu import gelu, gelu_backward
from microgpt.ops.relu2 import relu2_backward, relu2_forward
from microgpt.ops.rows import SERIAL, Rows

ChunkLogits = Callable[[NDArray, int, int], None]  # logits(z, i, j): z = the logits of rows i .. j
Act = Callable[[NDArray, NDArray, Rows], None]

# the MLP's activation by name (the block family's: engine/model.py): out = act(h, rows), and dh *= act'(h) in place
ACTIVATIONS: dict[str, tuple[Act, Act]] = {"gelu": (gelu, gelu_backward), "relu2": (relu2_forward, relu2_backward)}


class Matmul:
    """The GEMM sites in the arrays' own dtype: numpy's matmul, the MLP's activation as a separate pass after the GEMM
    that makes its input (over row ranges on `rows`: ops/rows.py; the backend hands in its own): a = act(h) after W_1's
    forward GEMM, dh *= act'(h) after W_2's input-gradient GEMM (backward's dx_act_of)."""

    dact_in_cast = False  # the MLP's act' runs with W_2's input-gradient GEMM, not inside W_1's operand cast (fp8's)

    def __init__(self, rows: Rows = SERIAL) -> None:
        self.rows = rows

    @staticmethod
    def unsupported(precision: str) -> str | None:
        """Why this machine cannot run this precision here (None: it can)."""
        return None

    def forward(
        self,
        y: NDArray,
        x: NDArray,
        w: NDArray,
        *,
        act_out: NDArray | None = None,
        act_of: NDArray | None = None,
        act: str = "gelu",
    ) -> None:
        """y = x @ w (w (G,C,OC): y (G,N,OC) by broadcasting); act_out: also act(y) (ACTIVATIONS[act]). act_of: x
        holds act of it already (this precision keeps a)."""
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
        act: str = "gelu",
    ) -> None:
        """dx = dy @ w.T (written) ; dw += x.T @ dy. G weights: dx = sum_g dy[g] @ w[g].T, dw[g] +=. dx_act_of (one
        weight): dx is then turned into dx * act'(dx_act_of), in place (the GEMM's result, in dx's dtype, times
        act')."""
        if w.ndim == 2:
            np.matmul(dy, w.T, out=dx)
            if dx_act_of is not None:
                ACTIVATIONS[act][1](dx, dx_act_of, self.rows)
            dw += x.T @ dy
            return
        assert dx_act_of is None, "an activation's gradient follows a linear of one weight (the MLP's W_2)"
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


def linear_forward(out: NDArray, x: NDArray, w: NDArray, *, mm: Matmul) -> None:
    """out (N,OC) = x (N,C) @ w (C,OC); out (G,N,OC) = x @ w[g] for w (G,C,OC)."""
    mm.forward(out, x, w)


def linear_backward(dx: NDArray, dw: NDArray, dout: NDArray, x: NDArray, w: NDArray, *, mm: Matmul) -> None:
    """dx (N,C) = dout @ w.T ; dw (C,OC) += x.T @ dout. With G weights: dx = sum_g dout[g] @ w[g].T, dw[g] +=."""
    mm.backward(dx, dw, dout, x, w)
