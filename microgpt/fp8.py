"""FP8 E4M3 for the block linears and the LM head's logits (precision "fp8"): the number format, the scale rule, and
where the copies live.

With precision "fp8" the four GEMM sites of every block -- QKV (one linear of three weights), O, W_1 and W_2 --
run all three of their GEMMs (forward, input gradient, weight gradient) on E4M3 operands with fp32 accumulation,
and the tied LM head runs its logits GEMM (logits = lnf @ wte^T) on E4M3 operands while its two gradient GEMMs
(d lnf, d wte) stay on the compute copies: an E4M3 logits gradient costs the loss at a 50,304-token vocabulary,
the logits' GEMM alone does not (bench/RESULTS.md). Everything else (attention, layernorm, GELU, residual and
cross-entropy) runs as in bf16; master weights, gradients and Adam's m and v stay fp32, so the checkpoint is the
same file as in every other precision.

Scaling: per tensor, a power of two. A tensor's scale is 2^k with k the largest integer such that
amax * 2^k <= 448 (E4M3's largest finite value), clamped to [-126, 126] so that 2^k and 2^-k are normal fp32
numbers (amax = 0 gives k = 0):

    q = e4m3(clamp(x * 2^k, -448, 448))     round to nearest even; x * 2^k is exact; a non-finite x gives NaN
    y = (sum_i qa_i * qb_i) * 2^-ka * 2^-kb     the GEMM's fp32 sum, then the two inverse scales (exact)

Weights: current scaling. The optimizer step casts each site's fp32 masters once per step, after AdamW, with the
amax of the masters themselves, into two copies, one per GEMM layout (W for the input gradient, W^T for the
forward); the model hands them to the GEMM sites as `Fp8Weight`s, each site's handle. On the GPU AdamW records
that amax as it writes the masters (its segment maxima, ops/adamw.py: the precision gives it the weights' segments),
so the cast reads them once.

Activations and output gradients: delayed scaling. Each site's input (x) and output gradient (g) has a slot with an
amax history of the last HISTORY micro-batches; a cast takes its amax from the largest entry, so the scale is known
before the tensor exists and its producer can write E4M3 itself (the casts computing GELU do: no bf16 copy, no amax
pass, no separate cast pass). While casting, it records the finite max |x| it met; the end of each micro-batch
(engine/precision.py: Fp8State.end_micro_batch) pushes that amax into the history (the oldest falls out). A value
above the history's range saturates at +-448. The history is the only state across steps: it rides in the checkpoint's
sidecar (`fp8_amax_history`), so resume is bit-exact. A run with no history yet (a fresh one, or one resumed from a
checkpoint of another precision) primes it: its first micro-batch takes each tensor's own amax first (current scaling,
one more pass on the GPU) and records it as the first entry. With data parallel the recorded amaxes are the max over
ranks, so every rank keeps the same history.

The LM head (`Fp8Head`) takes current scaling for both operands and so carries no state: wte is cast with the
block linears' weights after AdamW, lnf in each call of the loss head (its amax pass, then the cast). Its GEMM
needs the vocabulary to be a multiple of 16 (cuBLASLt's FP8 GEMM); a model whose vocabulary is not keeps its head
in the compute dtype (`head_in_fp8`).

The QKV site shares one scale over its three weights and one over its three output gradients, so its input
gradient is one GEMM over K = 3C. Evaluation (a forward without the loss's backward) casts with the histories and
records nothing (Fp8State.end_eval forgets what it met).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

E4M3_MAX = 448.0
K_MIN, K_MAX = -126, 126  # the scale exponent's range: 2^k and 2^-k stay normal fp32 numbers
HISTORY = 16  # micro-batches of amax an activation's or gradient's scale looks back over
# A slot: fp32 words [2^-k, pre, amax, 0] and, for activations and gradients, the history h_0 (newest) .. h_15.
# 2^-k: the inverse scale of the last cast (the GEMM's; cuBLASLt reads it only from an address aligned to 16 bytes:
# slots are multiples of 4 words). pre: the amax taken before casting (weights always; operands while priming).
# amax: the finite max |x| the casts met this micro-batch, which `roll_history` pushes into the history.
INV, PRE, AMAX, HIST = 0, 1, 2, 4  # word offsets in a slot
SLOT = 4  # a weight's slot (current scaling: no history)
OSLOT = HIST + HISTORY  # an operand's slot: an activation's or an output gradient's
SCRATCH = ("fp8_x", "fp8_g", "fp8_gt")  # the GPU's E4M3 operand scratch: activation rows, gradient rows, transposed


def scale_exponent(amax: float) -> int:
    """k of the scale 2^k for a tensor whose largest magnitude is amax (the rule above, in plain Python)."""
    if amax == 0.0:
        return 0
    f, e = math.frexp(amax)  # amax = f * 2^e, 0.5 <= f < 1; 448 = 0.875 * 2^9
    return min(max((9 if f <= 0.875 else 8) - e, K_MIN), K_MAX)


def reference_amax(slot: Any) -> Any:
    """The amax a cast into this slot scales by: the largest of its pre word and its history (the kernels compute
    the same from the same words)."""
    return max(slot[PRE], slot[HIST:].max()) if len(slot) > HIST else slot[PRE]


@dataclass
class Priming:
    """Whether the operand histories still need priming (a fresh run): shared by every site of a state, read by
    the casts (operands then take their own amax first), cleared after the first micro-batch's roll."""

    on: bool = True


@dataclass(frozen=True)
class Fp8Weight:
    """One site's weights as the FP8 GEMMs read them. name: the model's ("h3.w_qkv"); master: the fp32
    (G, C_in, C_out) view of the parameters; w8: (C_in, G*C_out), row c holding row c of each of the G weights (the
    input gradient's operand); w8t: (G, C_out, C_in), each weight transposed (the forward's); scale: their SLOT;
    xslot, gslot: the OSLOTs of the site's input and of its output gradient; priming: the state's Priming.
    On the GPU the site also keeps its input's E4M3 copy from the forward, transposed for the weight gradient:
    xt (C_in * N,) (None on the NumPy backend, which casts the input again with the same scale)."""

    name: str
    master: Any
    w8: Any
    w8t: Any
    scale: Any
    xslot: Any
    gslot: Any
    priming: Priming
    xt: Any = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight the linear computes with: (C_in, C_out), or (G, C_in, C_out) for G > 1."""
        G, C, OC = self.master.shape
        return (C, OC) if G == 1 else (G, C, OC)


def head_in_fp8(vocab_size: int) -> bool:
    """Whether precision "fp8" runs the LM head's logits GEMM in E4M3: the FP8 GEMM needs both dimensions of its
    column-major operand (wte^T: C x V) to be multiples of 16, and d_model already is one for the block linears."""
    return vocab_size % 16 == 0


@dataclass(frozen=True)
class Fp8Head:
    """The tied LM head as the loss head reads it in fp8: logits = (x8 @ w8^T) * 2^-kx * 2^-kw, fp32 sums, out in the
    compute dtype; the gradient GEMMs read w. w: the compute copy of wte (V, C) (the fp32 masters on the NumPy
    backend); master: the fp32 wte (V, C); w8: its E4M3 copy (V, C), the optimizer step's; scale: w8's SLOT; xslot:
    the SLOT of x (lnf), cleared and filled by each call (current scaling). The weights' cast treats it as a site of
    one weight (V, C) with no transposed layout (w8t None): its GEMM reads w8 only."""

    w: Any
    master: Any
    w8: Any
    scale: Any
    xslot: Any
    w8t: Any = None
