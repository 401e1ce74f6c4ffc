"""FP8 E4M3 for the block linears (precision "fp8"): the number format, the scale rule, and where the copies live.

With precision "fp8" the four GEMM sites of every block -- QKV (one linear of three weights), O, W_1 and W_2 --
run all three of their GEMMs (forward, input gradient, weight gradient) on E4M3 operands with fp32 accumulation.
Everything else (attention, layernorm, GELU, residual, the tied LM head and cross-entropy) runs as in bf16; master
weights, gradients and Adam's m and v stay fp32, so the checkpoint is the same file as in every other precision.

Scaling: per tensor, current, a power of two. Just before an operand is cast, its amax = max |x| is taken over the
whole tensor, and its scale is 2^k with k the largest integer such that amax * 2^k <= 448 (E4M3's largest finite
value), clamped to [-126, 126] so that 2^k and 2^-k are normal fp32 numbers (amax = 0 gives k = 0):

    q = e4m3(x * 2^k)          round to nearest even; x * 2^k is exact, so no value rounds past 448: no clamp
    y = (sum_i qa_i * qb_i) * 2^-ka * 2^-kb     the GEMM's fp32 sum, then the two inverse scales (exact)

A power of two makes the scaling itself exact (only the E4M3 rounding loses bits), the same on every device and in
the NumPy reference, and costs at most one bit of the format's range against 448 / amax. Current scaling (the
tensor's own amax, not a history of earlier steps') keeps no state between steps: resume stays bit-exact with
the checkpoint unchanged. The QKV site shares one scale over its three weights and one over its three output
gradients, so its input gradient is one GEMM over K = 3C. A non-finite value casts to NaN (E4M3 has no
infinity) and reaches the loss, where the step's non-finite check sees it.

Weights: the optimizer step casts each site's fp32 master weights once per step, after AdamW, into two copies,
one per GEMM layout (W for the input gradient, W^T for the forward); the model reads them through `Fp8Weight`.
Activations and output gradients are cast where each linear reads them (microgpt/kernels/fp8.py, ops/fp8.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

E4M3_MAX = 448.0
K_MIN, K_MAX = -126, 126  # the scale exponent's range: 2^k and 2^-k stay normal fp32 numbers
SLOT = 4  # fp32 words of a scale slot, [2^-k, amax, 0, 0]: 16 bytes, as cuBLASLt reads the inverse scale from an
# address aligned to 16 bytes (its first word)
# each block's GEMM sites, by the model's name for the weight (model.py), and the parameters each one holds
SITES = {"w_qkv": ("w_q", "w_k", "w_v"), "w_o": ("w_o",), "w_1": ("w_1",), "w_2": ("w_2",)}


def scale_exponent(amax: float) -> int:
    """k of the scale 2^k for a tensor whose largest magnitude is amax (the rule above, in plain Python)."""
    if amax == 0.0:
        return 0
    f, e = math.frexp(amax)  # amax = f * 2^e, 0.5 <= f < 1; 448 = 0.875 * 2^9
    return min(max((9 if f <= 0.875 else 8) - e, K_MIN), K_MAX)


def site_shapes(C: int) -> dict[str, tuple[int, int, int]]:
    """Each site's weight as (G, C_in, C_out): G weights of (C_in, C_out) that share a scale."""
    return {"w_qkv": (3, C, C), "w_o": (1, C, C), "w_1": (1, C, 4 * C), "w_2": (1, 4 * C, C)}


@dataclass(frozen=True)
class Fp8Weight:
    """One site's weights as the FP8 GEMMs read them. name: the model's ("h3.w_qkv"); master: the fp32
    (G, C_in, C_out) view of the parameters; w8: (C_in, G*C_out), row c holding row c of each of the G weights (the
    input gradient's operand); w8t: (G, C_out, C_in), each weight transposed (the forward's); scale: their SLOT.
    On the GPU the site also keeps its input's E4M3 copy from the forward, transposed for the weight gradient:
    xt (C_in * N,) and xscale, its SLOT (None on the NumPy backend, which casts the input again)."""

    name: str
    master: Any
    w8: Any
    w8t: Any
    scale: Any
    xt: Any = None
    xscale: Any = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight the linear computes with: (C_in, C_out), or (G, C_in, C_out) for G > 1."""
        G, C, OC = self.master.shape
        return (C, OC) if G == 1 else (G, C, OC)
