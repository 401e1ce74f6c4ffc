"""Linear without bias, weights stored [in, out]: out(N,OC) = x(N,C) @ w(C,OC).

Backward: dx = dout @ w.T (written: its one writer) ; dw += x.T @ dout (accumulated over micro-batches). Nothing
is saved beyond x (the caller keeps it). A linear is one GEMM site of the precision's Matmul (`mm`,
microgpt/engine/precision.py); `Matmul` here is fp32's, bf16's and fp16's (fp8.py holds fp8's), over the runtime's GEMM
router (gemm.py: Triton, cuBLAS or cuBLASLt per shape). The attention's input projection is one linear of G = 3
weights (G,C,OC): its forward and its weight gradients are one batched GEMM each (`bmm`), its input gradient three
GEMMs into dx, the first writing and the others adding (the weights' layout, fixed by the checkpoint, makes no single
matrix of them for cuBLAS; one Triton GEMM looping K over the three lost to the three: bench/RESULTS.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from microgpt.kernels.gemm import Gemm
from microgpt.kernels.tuning import INTERPRET
from microgpt.ops.linear import dact_read

ChunkLogits = Callable[[torch.Tensor, int, int], None]  # logits(lg, r0, r): lg = the logits of rows r0 .. r0 + r
BF16_CAPABILITY = (8, 0)  # bfloat16 tensor cores: Ampere (8.0, 8.6), Ada (8.9), Hopper (9.0) on


def this_card() -> tuple[tuple[int, int], str] | None:
    """(compute capability, name) of this process's GPU; None without one."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability()), torch.cuda.get_device_name()


def offer(cc: tuple[int, int]) -> str:
    """The precisions a refused one gives way to on a card of compute capability cc."""
    if cc >= BF16_CAPABILITY:
        return "train.precision 'bf16' runs here (or 'fp16')"
    return "train.precision 'fp16' runs here (with its dynamic loss scale)"


class Matmul:
    """The GEMM sites in the compute dtype (bf16/fp16 operands, fp32 sums; fp32 without tf32). The MLP's activation
    runs with the GEMM that makes its input: a = act(h) with W_1's forward GEMM (gemm.Gemm.mm_act), dh *= act'(h) with
    W_2's input-gradient GEMM (gemm.Gemm.mm_dact), each in that GEMM's epilogue where the warm-up timed it faster
    than a pass after the GEMM. ReLU^2's reads and writes a alone (ops/mlp.py): W_1's GEMM may store a without h
    (forward's y None) and act' is read from a (backward's dx_act_out)."""

    dact_in_cast = False  # the MLP's act' runs with W_2's input-gradient GEMM (dx_act_of, dx_act_out), not W_1's cast

    def __init__(self, gemm: Gemm) -> None:
        self.gemm = gemm

    @staticmethod
    def unsupported(precision: str) -> str | None:
        """Why this machine's GPU cannot run `precision` (None: it can): bf16 needs bfloat16 tensor cores, Ampere
        (compute capability 8.0) on; fp32 and fp16 are not refused. The interpreter runs every one (CI)."""
        card = None if INTERPRET or precision != "bf16" else this_card()
        if card is None or card[0] >= BF16_CAPABILITY:
            return None
        (major, minor), name = card
        return f"needs bfloat16 tensor cores (compute capability >= 8.0); {name} is {major}.{minor}: {offer(card[0])}"

    def forward(
        self,
        y: torch.Tensor | None,
        x: torch.Tensor,
        w: torch.Tensor,
        *,
        act_out: torch.Tensor | None = None,
        act_of: torch.Tensor | None = None,
        act: str = "gelu",
    ) -> None:
        """y (N,OC) = x (N,C) @ w (C,OC), or y (G,N,OC) = x @ w[g]; act_out: a = act(y) too, and y None where y is
        not kept (ReLU^2's: ops/linear.FROM_OUTPUT). act_of: x holds it."""
        C, OC = w.shape[-2:]
        x2 = x.view(-1, C)
        if act_out is not None:  # the GEMM and the activation's pass, or one GEMM with the activation in its epilogue
            self.gemm.mm_act(act_out.view(-1, OC), None if y is None else y.view(-1, OC), x2, w, act)
        elif w.dim() == 2:
            self.gemm.mm(y.view(-1, OC), x2, w)
        else:
            self.gemm.bmm(y.view(w.shape[0], -1, OC), x2.expand(w.shape[0], *x2.shape), w)

    def backward(
        self,
        dx: torch.Tensor,
        dw: torch.Tensor,
        dy: torch.Tensor,
        x: torch.Tensor,
        w: torch.Tensor,
        *,
        dx_act_of: torch.Tensor | None = None,
        dx_act_out: torch.Tensor | None = None,
        act: str = "gelu",
    ) -> None:
        """dx = dy @ w.T (written) ; dw += x.T @ dy. G weights: dx = sum_g dy[g] @ w[g].T ; dw[g] +=. dx_act_of
        (one weight): dx = (dy @ w.T) * act'(dx_act_of), the GEMM's sum rounded to dx's dtype, then multiplied (a
        pass after the GEMM, or its epilogue); dx_act_out, for an activation of ops/linear.FROM_OUTPUT (ReLU^2): the
        same act'(h), read from a = dx_act_out = act(h)."""
        w3, dw3 = (w, dw) if w.dim() == 3 else (w.unsqueeze(0), dw.unsqueeze(0))
        G, C, OC = w3.shape
        dy3, x2, dx2 = dy.view(G, -1, OC), x.view(-1, C), dx.view(-1, C)
        if (read := dact_read(act, dx_act_of, dx_act_out)) is not None:
            assert G == 1, "an activation's gradient follows a linear of one weight (the MLP's W_2)"
            self.gemm.mm_dact(dx2, dy3[0], w3[0].t(), read.view(-1, C), act)
        else:
            for g in range(G):
                self.gemm.mm(dx2, dy3[g], w3[g].t(), accumulate=g > 0)
        if G == 1:
            self.gemm.mm(dw3[0], x2.t(), dy3[0], accumulate=True)
        else:
            self.gemm.bmm(dw3, x2.t().expand(G, C, x2.shape[0]), dy3, accumulate=True)

    def logits(self, x: torch.Tensor, wte: torch.Tensor) -> ChunkLogits:
        """The tied head's logits GEMM, chunk by chunk: lg (r, V) = x[r0 : r0 + r] @ wte.T."""
        return lambda lg, r0, r: self.gemm.mm(lg, x[r0 : r0 + r], wte.t())

    def logits_backward(
        self, dx: torch.Tensor, dwte: torch.Tensor, dz: torch.Tensor, x: torch.Tensor, wte: torch.Tensor
    ) -> None:
        """One chunk's two head gradient GEMMs: dx += dz @ wte ; dwte += dz.T @ x."""
        self.gemm.mm(dx, dz, wte, accumulate=True)
        self.gemm.mm(dwte, dz.t(), x, accumulate=True)


def linear_forward(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *, mm: Matmul) -> None:
    """out (N,OC) = x (N,C) @ w (C,OC); out (G,N,OC) = x @ w[g] for w (G,C,OC)."""
    mm.forward(out, x, w)


def linear_backward(
    dx: torch.Tensor, dw: torch.Tensor, dout: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *, mm: Matmul
) -> None:
    """dx = dout @ w.T (written) ; dw += x.T @ dout. G weights: dx = sum_g dout[g] @ w[g].T ; dw[g] +=."""
    mm.backward(dx, dw, dout, x, w)
