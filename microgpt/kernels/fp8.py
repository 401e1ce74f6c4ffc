"""FP8 E4M3 GEMM sites on the GPU: precision "fp8"'s Matmul (engine/precision.py), whose operands
kernels/fp8_cast.py casts and whose GEMMs are the GEMM router's scaled ones (cuBLASLt, or torch._scaled_mm).
microgpt/fp8.py gives the format, the scale rule and the slots; microgpt/ops/fp8.py's Matmul is the NumPy
reference, which this one matches in every cast and up to the order of the fp32 sums in every GEMM.

GEMMs: cuBLASLt's FP8 GEMM wants the left operand row-major and the right one column-major, so every operand is
cast into the layout its GEMM reads:

    forward        out (N,OC)  = x8 (N,C)   @ w8t[g].T        x rows, weight transposed (optimizer's copy)
    input grad     dx  (N,C)   = dy8 (N,G*OC) @ w8.T          dout rows, weight rows (optimizer's copy)
    weight grad    dw  (C,OC) += xt (C,N)   @ dy8t[g].T       both transposed (the casts write them)

Each runs by the GEMM router's `mm_scaled` (gemm.py): torch._scaled_mm, or cuBLASLt's FP8 GEMM under the algorithm
the warm-up timed fastest, which runs a site of three weights as one batched GEMM and adds a weight gradient into
its fp32 sum in its epilogue.

The forward casts a site's input once, into both layouts: the rows for its own GEMM (scratch) and the transpose,
which the site keeps (Fp8Weight.xt, a planned activation) for the weight gradient in backward. The weight gradient
accumulates into fp32 (+=, over micro-batches): cuBLASLt adds in its epilogue; torch._scaled_mm, which cannot,
writes its fp32 product into the planned `fp8_wgrad` buffer and one add folds it in. Under TRITON_INTERPRET=1 (CI)
and off CUDA the GEMMs run our Triton tile kernel (gemm.gemm_tile with the two inverse scales applied to its fp32
sum), accumulating in place.

The scratch (`Scratch`): three E4M3 operand buffers of N*4C bytes (activation rows, gradient rows and transposed)
and the fp32 weight-gradient product, planned with each site's saved transposed input and its slots by the
precision (engine/precision.py Fp8.rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from microgpt.fp8 import Fp8Head, Fp8Weight
from microgpt.kernels import linear
from microgpt.kernels.fp8_cast import CAST_OPS, COPY, cast, roll, stack
from microgpt.kernels.gemm import ACTIVATIONS, Gemm
from microgpt.kernels.tuning import INTERPRET

FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) on


@dataclass(frozen=True)
class Scratch:
    """The casts' planned scratch (microgpt/engine/precision.py Fp8.rows, the "kernel" role)."""

    x8: torch.Tensor  # activation operand, row layout (flat, N*4C); its transpose is saved with its site (xt)
    g8: torch.Tensor  # gradient operand, row layout
    g8t: torch.Tensor  # gradient operand, transposed
    wgrad: torch.Tensor  # fp32 (C*4C,): torch._scaled_mm's weight-gradient product before the += (that way only)

    @staticmethod
    def view(flat: torch.Tensor, *shape: int) -> torch.Tensor:
        """The first prod(shape) elements of a flat scratch buffer, as that shape."""
        return flat[: math.prod(shape)].view(shape)


class Matmul(linear.Matmul):
    """The GEMM sites on E4M3 operands (precision "fp8"): each operand cast once into the layout its GEMM reads,
    at its slot's scale; the head's gradient GEMMs are the base class's, on the compute copy. head: the LM head's
    E4M3 state, None where its logits GEMM stays bf16 (fp8.head_in_fp8); scratch: the planned buffers by name.
    The MLP's act' runs inside the cast of W_1's output gradient (backward's dact_of), not with W_2's GEMM: its
    backward takes dact_of where the base class takes dx_act_of."""

    dact_in_cast = True

    def __init__(self, gemm: Gemm, head: Fp8Head | None, scratch: dict[str, torch.Tensor]) -> None:
        super().__init__(gemm)
        self.tuner, self.head = gemm.tuner, head
        self.q = Scratch(*(scratch[name] for name in ("fp8_x", "fp8_g", "fp8_gt", "fp8_wgrad")))

    @staticmethod
    def unsupported(precision: str) -> str | None:
        """Why this machine cannot run precision "fp8" (it needs FP8 tensor cores: Ada and Hopper, compute capability
        8.9 on), or None where it can. The interpreter runs the FP8 kernels on the CPU (CI)."""
        if INTERPRET:
            return None
        card = linear.this_card()
        if card is None:
            return (
                "needs an NVIDIA GPU with FP8 tensor cores (compute capability >= 8.9) and this machine has no "
                "CUDA GPU; train.backend 'numpy' runs fp8's CPU reference"
            )
        cc, name = card
        if cc < FP8_CAPABILITY:
            return f"needs FP8 tensor cores (compute capability >= 8.9); {name} is {cc[0]}.{cc[1]}: {linear.offer(cc)}"
        return None

    def forward(
        self,
        y: torch.Tensor,
        x: torch.Tensor | None,
        w: Fp8Weight,
        *,
        act_out: torch.Tensor | None = None,
        act_of: torch.Tensor | None = None,
        act: str = "gelu",
    ) -> None:
        """y (N,OC) = x @ w, or y (G,N,OC) = x @ w[g]. The input is cast once, into the rows its GEMM reads and the
        transpose its site keeps for the weight gradient; x None: the input is act(act_of), which the cast
        computes on the way (act(h) then exists in E4M3 only)."""
        G, C, OC = w.master.shape
        src, op = (act_of, CAST_OPS[act][0]) if x is None else (x, COPY)
        x2 = src.view(-1, C)
        N = x2.shape[0]
        x8 = self.q.view(self.q.x8, N, C)
        cast(self.tuner, x2, w.xslot, x8, self.q.view(w.xt, C, N), w.priming.on, op=op)
        self._per_weight(y.view(G, N, OC), x8.expand(G, N, C), w.xslot[:1], w.w8t.transpose(1, 2), w.scale[:1])
        if act_out is not None:
            ACTIVATIONS[act][0](act_out, y)

    def backward(
        self,
        dx: torch.Tensor,
        dw: torch.Tensor,
        dy: torch.Tensor,
        x: torch.Tensor | None,
        w: Fp8Weight,
        *,
        dact_of: torch.Tensor | None = None,
        act: str = "gelu",
    ) -> None:
        """dx = sum_g dy[g] @ w[g].T (one GEMM over K = G*OC, the G gradients cast at one scale) ; dw[g] += x.T @
        dy[g] from the forward's transposed E4M3 copy of x (x itself unused: None where unplanned). dact_of = h:
        dy holds the gradient reaching act(h), and the cast computes dy * act'(h) (which exists in E4M3 only)."""
        G, C, OC = w.master.shape
        N = dy.numel() // (G * OC)
        g8, g8t = self.q.view(self.q.g8, N, G * OC), self.q.view(self.q.g8t, G, OC, N)
        if dact_of is None:
            cast(self.tuner, dy.view(G, N, OC), w.gslot, g8, g8t, w.priming.on)
        else:
            cast(self.tuner, dact_of.view(N, OC), w.gslot, g8, g8t, w.priming.on, op=CAST_OPS[act][1], x2=dy)
        self.gemm.mm_scaled(dx.view(N, C), g8, w.gslot[:1], w.w8.t(), w.scale[:1])
        xt = self.q.view(w.xt, C, N).expand(G, C, N)
        self._per_weight(dw.view(G, C, OC), xt, w.xslot[:1], g8t.transpose(1, 2), w.gslot[:1], accumulate=True)

    def _per_weight(
        self,
        out: torch.Tensor,
        a: torch.Tensor,
        ia: torch.Tensor,
        b: torch.Tensor,
        ib: torch.Tensor,
        accumulate: bool = False,
    ) -> None:
        """out[g] (+)= (a[g] @ b[g]) * ia * ib for a site's G weights: one batched GEMM, or one 2D GEMM for a
        site of one weight (G = 1)."""
        if out.shape[0] == 1:
            out, a, b = out[0], a[0], b[0]
        self.gemm.mm_scaled(out, a, ia, b, ib, accumulate, self.q.wgrad)

    def logits(self, x: torch.Tensor, wte: torch.Tensor) -> linear.ChunkLogits:
        """The head's logits GEMM in E4M3 where the head runs in fp8: x (N, C) cast at its own amax into the
        activation scratch, wte from the optimizer step's copy; lg (r, V) = the logits of rows r0 .. r0 + r."""
        if self.head is None:
            return super().logits(x, wte)
        N, C = x.shape
        x8, head = self.q.view(self.q.x8, N, C), self.head
        head.xslot.zero_()
        cast(self.tuner, x, head.xslot, x8, None, prime=True, hist=0)
        return lambda lg, r0, r: self.gemm.mm_scaled(lg, x8[r0 : r0 + r], head.xslot[:1], head.w8.t(), head.scale[:1])

    def cast_weights(self, weights: list[Fp8Weight | Fp8Head], amaxes: torch.Tensor | None = None) -> None:
        """Each site's fp32 masters (G, C, OC) -> w8 (C, G*OC) and w8t (G, OC, C) in E4M3, scaled by their own amax
        (current scaling: the slot ends [2^-k, amax, amax, 0]); the LM head's wte (V, C) -> its w8 (V, C). One
        site's weights in every layer go as one launch pair (`stack`): an amax launch, then the cast. amaxes
        (len(weights),): the amaxes AdamW left for the weights (the optimizer step's segment maxima), which the
        casts take instead of their amax launches and then clear for the next step."""
        for at, (master, w8, w8t, scale) in stack(weights):
            if amaxes is None:
                scale.zero_()
            cast(
                self.tuner,
                master,
                scale,
                w8,
                w8t,
                prime=amaxes is None,
                hist=0,
                take=None if amaxes is None else amaxes[at],
            )
        if amaxes is not None:
            amaxes.zero_()

    def roll(self, slots: torch.Tensor, shift: bool = True) -> None:
        """slots (..., OSLOT): the end of a micro-batch (fp8_cast.roll)."""
        roll(slots, shift)
