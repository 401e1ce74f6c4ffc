"""FP8 E4M3 operands for the block linears and the LM head's logits: the NumPy reference of what the GPU casts and
multiplies, as precision "fp8"'s Matmul (microgpt/engine/precision.py), which the linear, MLP and head pairs call.

microgpt/fp8.py gives the format, the scale rule and the slots. Here each operand is cast exactly as the triton
backend casts it (same amax, same history, same power-of-two scale, E4M3 round-to-nearest-even through
ml_dtypes), and each GEMM multiplies the E4M3 values in fp32 and applies the two inverse scales once at the end, as
the GPU's FP8 GEMM does: the two sides differ only in the order the fp32 sums are taken.

    cast(x, slot, current)  -> (q, 2^-k)     k from the slot (current: x's own amax first); records max |x|
    recast(x, slot)         -> (q, 2^-k)     x again at the scale of the slot's last cast, nothing recorded
    mm8(a, ia, b, ib)       -> (a @ b) * (ia * ib) in fp32
    Matmul                  the GEMM sites on E4M3 operands: forward, backward, the head's logits
    Matmul.cast_weights(ws) each site's master weights -> its two E4M3 layouts and scale slot, the LM head's wte
                            -> its E4M3 copy (optimizer step)
    Matmul.roll(slots, shift)  the end of a micro-batch: each slot's amax into its history (shift) or forgotten

ml_dtypes (the NumPy dtype of E4M3) is imported on first use: runs in other precisions never need it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from microgpt.fp8 import AMAX, E4M3_MAX, HIST, INV, PRE, Fp8Head, Fp8Weight, reference_amax, scale_exponent
from microgpt.ops import linear
from microgpt.ops.rows import SERIAL, Rows


def e4m3() -> Any:
    """The NumPy dtype of E4M3 (ml_dtypes.float8_e4m3fn), imported on first use: other precisions never need it."""
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError("on the numpy backend needs ml_dtypes: pip install ml_dtypes") from None
    return ml_dtypes.float8_e4m3fn


def finite_amax(x: NDArray) -> np.float32:
    """max |x| over the finite elements (0 for none): what a cast records and what current scaling scales by."""
    a = np.abs(x[np.isfinite(x)])
    return np.float32(a.max()) if a.size else np.float32(0.0)


def _e4m3_at(x: NDArray, k: int) -> NDArray:
    """E4M3(clamp(x * 2^k, +-448)); a non-finite x becomes NaN (E4M3 has no infinity)."""
    y = x * np.float32(2.0**k)
    y = np.where(np.isfinite(y), np.clip(y, -E4M3_MAX, E4M3_MAX), np.nan).astype(np.float32)
    return y.astype(e4m3())


def cast(x: NDArray, slot: NDArray, current: bool = False) -> tuple[NDArray, np.float32]:
    """x -> (E4M3 values of x * 2^k, 2^-k), one k for the whole tensor, from the slot's amax (its pre word and its
    history); current: x's own amax goes into the pre word first. Records x's finite amax in the slot's amax word."""
    x = np.asarray(x, np.float32)
    amax = finite_amax(x)
    if current:
        slot[PRE] = max(slot[PRE], amax)
    k = scale_exponent(float(reference_amax(slot)))
    slot[INV] = np.float32(2.0**-k)
    slot[AMAX] = max(slot[AMAX], amax)
    return _e4m3_at(x, k), slot[INV]


def recast(x: NDArray, slot: NDArray) -> tuple[NDArray, np.float32]:
    """x cast again at the scale its slot's last cast used (the backward's copy of a forward operand)."""
    k = -int(np.log2(slot[INV]))
    return _e4m3_at(np.asarray(x, np.float32), k), slot[INV]


def mm8(a: NDArray, ia: np.float32, b: NDArray, ib: np.float32) -> NDArray:
    """(a @ b) * (ia * ib): E4M3 operands, fp32 products and sums, the scales applied once."""
    return (a.astype(np.float32) @ b.astype(np.float32)) * np.float32(ia * ib)


def groups(dout: NDArray, G: int) -> NDArray:
    """dout (G, N, OC) or (N, OC) -> (N, G*OC), the G output gradients side by side (the QKV site's K = 3C)."""
    return dout if G == 1 else np.concatenate(list(dout), axis=1)


def head_logits(x: NDArray, head: Fp8Head) -> Callable[[NDArray, int, int], None]:
    """The loss head's logits GEMM in E4M3: x (N, C) is cast here, at its own amax (the slot cleared first: current
    scaling); the returned logits(z, i, j) writes z = the logits of rows i .. j."""
    head.xslot[...] = 0.0
    x8, ix = cast(x, head.xslot, current=True)

    def logits(z: NDArray, i: int, j: int) -> None:
        z[...] = mm8(x8[i:j], ix, head.w8.T, head.scale[INV])

    return logits


class Matmul(linear.Matmul):
    """The GEMM sites on E4M3 operands with fp32 sums, each operand cast as the GPU casts it; the head's gradient
    GEMMs are the base class's, on its compute copy. head: the LM head's E4M3 state, None where its logits GEMM
    stays in the compute dtype (fp8.head_in_fp8). w: each site's Fp8Weight. The MLP's act' runs where the GPU's cast
    computes it, on W_1's output gradient before its cast (backward's dact_of), not after W_2's GEMM."""

    dact_in_cast = True

    def __init__(self, head: Fp8Head | None, rows: Rows = SERIAL) -> None:
        super().__init__(rows)
        self.head = head

    @staticmethod
    def unsupported(precision: str) -> str | None:
        """E4M3 on the CPU needs NumPy's E4M3 dtype (ml_dtypes, the `fp8` extra)."""
        try:
            e4m3()
        except ImportError as e:
            return str(e)
        return None

    def forward(
        self,
        y: NDArray,
        x: NDArray | None,
        w: Fp8Weight,
        *,
        act_out: NDArray | None = None,
        act_of: NDArray | None = None,
        act: str = "gelu",
    ) -> None:
        """y = cast(x) @ w8: the input at its slot's scale (its own amax while priming)."""
        forward, _ = linear.ACTIVATIONS[act]
        if x is None:  # the input is act(act_of), not kept
            x = np.empty_like(act_of)
            forward(x, act_of, self.rows)
        G = w.master.shape[0]
        x8, ix = cast(x, w.xslot, current=w.priming.on)
        for g in range(G):
            (y if G == 1 else y[g])[...] = mm8(x8, ix, w.w8t[g].T, w.scale[INV])
        if act_out is not None:
            forward(act_out, y, self.rows)

    def backward(
        self,
        dx: NDArray,
        dw: NDArray,
        dy: NDArray,
        x: NDArray,
        w: Fp8Weight,
        *,
        dact_of: NDArray | None = None,
        act: str = "gelu",
    ) -> None:
        """The output gradient cast once, (N, G*OC) at one scale: the input gradient is one GEMM over K = G*OC; the
        weight gradient reads the forward's input cast again at its forward scale (the GPU keeps its copy)."""
        if dact_of is not None:
            linear.ACTIVATIONS[act][1](dy, dact_of, self.rows)
        G, _, OC = w.master.shape
        dy8, idy = cast(groups(dy, G), w.gslot, current=w.priming.on)
        dx[...] = mm8(dy8, idy, w.w8.T, w.scale[INV])
        x8, ix = recast(x, w.xslot)
        for g in range(G):
            (dw if G == 1 else dw[g])[...] += mm8(x8.T, ix, dy8[:, g * OC : (g + 1) * OC], idy)

    def logits(self, x: NDArray, wte: NDArray) -> Callable[[NDArray, int, int], None]:
        return super().logits(x, wte) if self.head is None else head_logits(x, self.head)

    def cast_weights(self, weights: list[Fp8Weight | Fp8Head]) -> None:
        """Each site's fp32 masters (G, C, OC) -> w8 (C, G*OC), w8t (G, OC, C) in E4M3, scaled by their own amax;
        the slot ends [2^-k, amax, amax, 0]. The LM head's wte (V, C) -> its w8 (V, C) likewise."""
        for w in weights:
            w.scale[...] = 0.0
            master = np.asarray(w.master, np.float32)
            q, _ = cast(master.reshape(-1, *master.shape[-2:]), w.scale, current=True)  # (G, C, OC)
            w.w8[...] = np.concatenate(list(q), axis=1)
            if w.w8t is not None:
                w.w8t[...] = q.transpose(0, 2, 1)

    def roll(self, slots: NDArray, shift: bool = True) -> None:
        """slots (..., OSLOT): shift: each amax becomes its history's newest entry (the oldest drops out); either
        way the pre and amax words are cleared for the next micro-batch."""
        s = slots.reshape(-1, slots.shape[-1])
        if shift:
            s[:, HIST + 1 :] = s[:, HIST:-1].copy()
            s[:, HIST] = s[:, AMAX]
        s[:, PRE] = s[:, AMAX] = 0.0
