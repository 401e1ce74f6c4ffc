"""FP8 E4M3 operands for the block linears: the NumPy reference of what the GPU casts and multiplies.
(linear.py and mlp.py run their GEMMs through these when handed an Fp8Weight.)

microgpt/fp8.py gives the format and the scale rule. Here each operand is cast exactly as the triton backend casts
it (same amax, same power-of-two scale, E4M3 round-to-nearest-even through ml_dtypes), and each GEMM multiplies
the E4M3 values in fp32 and applies the two inverse scales once at the end, as the GPU's FP8 GEMM does: the two
sides differ only in the order the fp32 sums are taken.

    quantize(x)            -> (q, 2^-k)       q = e4m3(x * 2^k), k from amax(x)
    mm8(a, ia, b, ib)      -> (a @ b) * (ia * ib) in fp32
    cast_weights(ws)       each site's master weights -> its two E4M3 layouts and scale slot (optimizer step)

ml_dtypes (the NumPy dtype of E4M3) is imported on first use: runs in other precisions never need it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from microgpt.fp8 import Fp8Weight, scale_exponent


def e4m3() -> Any:
    """The NumPy dtype of E4M3 (ml_dtypes.float8_e4m3fn)."""
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError("train.precision 'fp8' on the numpy backend needs ml_dtypes: pip install ml_dtypes") from None
    return ml_dtypes.float8_e4m3fn


def quantize(x: NDArray) -> tuple[NDArray, np.float32]:
    """x -> (E4M3 values of x * 2^k, 2^-k) with one k for the whole tensor."""
    x = np.asarray(x, np.float32)
    amax = float(np.abs(x).max()) if x.size else 0.0
    k = scale_exponent(amax) if np.isfinite(amax) else 0
    return (x * np.float32(2.0**k)).astype(e4m3()), np.float32(2.0**-k)


def mm8(a: NDArray, ia: np.float32, b: NDArray, ib: np.float32) -> NDArray:
    """(a @ b) * (ia * ib): E4M3 operands, fp32 products and sums, the scales applied once."""
    return (a.astype(np.float32) @ b.astype(np.float32)) * np.float32(ia * ib)


def groups(dout: NDArray, G: int) -> NDArray:
    """dout (G, N, OC) or (N, OC) -> (N, G*OC), the G output gradients side by side (the QKV site's K = 3C)."""
    return dout if G == 1 else np.concatenate(list(dout), axis=1)


def cast_weights(weights: list[Fp8Weight]) -> None:
    """Each site's fp32 masters (G, C, OC) -> w8 (C, G*OC), w8t (G, OC, C) in E4M3 and scale = [2^-k, amax, 0, 0]."""
    for w in weights:
        master = np.asarray(w.master, np.float32)
        q, inv = quantize(master)
        w.w8[...] = np.concatenate(list(q), axis=1)
        w.w8t[...] = q.transpose(0, 2, 1)
        w.scale[...] = [inv, np.abs(master).max(), 0, 0]
