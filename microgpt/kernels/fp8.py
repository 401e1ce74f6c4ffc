"""FP8 E4M3 on the GPU: the casts (Triton) and the scaled GEMMs (cuBLASLt through torch._scaled_mm) of precision
"fp8". microgpt/fp8.py gives the format and the scale rule; microgpt/ops/fp8.py is the NumPy reference, which
this module matches bit for bit in every cast.

A cast is three launches: zero the slot's amax, k_amax (max |x| into the slot by atomic max), k_cast (the scale
from the amax, then each element rounded to E4M3, written in the row layout a GEMM's left operand needs and/or
transposed, as its right operand needs); one, where the producer left the amax. The rounding is done on the fp32
bits (round to nearest even, the rounding of torch's E4M3 conversion and of ml_dtypes, which the tests compare
byte for byte), so the Triton interpreter, which CI runs, computes the very bytes the GPU does.

GEMMs: cuBLASLt's FP8 GEMM wants the left operand row-major and the right one column-major, so every operand is
cast into the layout its GEMM reads:

    forward        out (N,OC)  = x8 (N,C)   @ w8t[g].T        x rows, weight transposed (optimizer's copy)
    input grad     dx  (N,C)   = dy8 (N,G*OC) @ w8.T          dout rows, weight rows (optimizer's copy)
    weight grad    dw  (C,OC) += xt (C,N)   @ dy8t[g].T       both transposed (the casts write them)

The forward casts a site's input once, into both layouts: the rows for its own GEMM (scratch) and the transpose,
which the site keeps (Fp8Weight.xt, a planned activation) for the weight gradient in backward. The MLP's GELU
kernels leave the amax of a = gelu(h) and of dh as they store them, so those casts skip their amax pass. The
weight gradient accumulates into fp32 (+=, over micro-batches): cuBLASLt writes its fp32 product into the
planned `fp8_wgrad` buffer and one add folds it in. Under TRITON_INTERPRET=1 (CI) and off CUDA the GEMMs run our
Triton tile kernel (gemm.gemm_tile with the two inverse scales applied to its fp32 sum), accumulating in place.

The scratch (`Scratch`, planned by `scratch_rows`): three E4M3 operand buffers of N*4C bytes (activation rows,
gradient rows and transposed), two scale slots ([2^-k, amax, 0, 0]) for output gradients, and the fp32
weight-gradient product; each site's saved transposed input is planned by `saved_rows`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from microgpt.fp8 import SLOT, Fp8Weight, site_shapes
from microgpt.kernels import tuning
from microgpt.kernels.gemm import k_mm_scaled

SLOT_DY, SLOT_DH = 0, 1  # the scratch's scale slots: an output gradient, and the MLP's dh beside it
SCRATCH_TAKERS = ("linear_forward", "linear_backward", "mlp_forward", "mlp_backward")


@triton.jit
def _scale(amax):
    """(2^k, 2^-k) for a tensor's amax: k the largest integer with amax * 2^k <= 448 = 1.75 * 2^8, in [-126, 126];
    0 for amax 0 or non-finite. From the fp32 bits: amax = 1.m * 2^E gives k = 8 - E when 1.m <= 1.75, else 7 - E."""
    u = amax.to(tl.int32, bitcast=True)
    biased = (u >> 23) & 0xFF
    k = tl.where((u & 0x7FFFFF) <= 0x600000, 135 - biased, 134 - biased)
    k = tl.minimum(tl.maximum(k, -126), 126)
    k = tl.where((amax == 0.0) | (biased == 0xFF), 0, k)
    return ((k + 127) << 23).to(tl.float32, bitcast=True), ((127 - k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(y):
    """The E4M3 (fn) byte of each fp32 y, |y| <= 448: round to nearest even; inf and NaN give NaN (0x7F)."""
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # normal results (|y| >= 2^-6): keep 3 mantissa bits (a carry moves into the exponent), rebias 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal results: multiples of 2^-9, rounded to an integer by the fp32 adder (ties to even)
    scaled = tl.abs(y) * 512.0
    sub = ((scaled + 8388608.0) - 8388608.0).to(tl.int32)
    q = tl.where(a >= (121 << 23), normal, sub)
    q = tl.where(a >= 0x7F800000, 0x7F, q)
    return (q | sign).to(tl.uint8)


@triton.jit
def k_amax(x_ptr, slot_ptr, n, BLOCK: tl.constexpr):
    # slot[1] = max(slot[1], max |x|) of the flat x: each program strides over the blocks, then one atomic
    m = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        m = tl.maximum(m, tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)))
    tl.atomic_max(slot_ptr + 1, tl.max(m, axis=0))


@triton.jit
def k_cast(x_ptr, rows_ptr, t_ptr, slot_ptr, R, Cc, sg, sr, sc,
           ROWS: tl.constexpr, TRANS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    # x (G, R, Cc), any strides -> rows (R, G*Cc): rows[r, g*Cc + c]; t (G, Cc, R): t[g, c, r]; slot[0] = 2^-k
    pid_r, pid_c, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s, inv = _scale(tl.load(slot_ptr + 1))
    if (pid_r == 0) & (pid_c == 0) & (g == 0):
        tl.store(slot_ptr, inv)
    r = pid_r * BR + tl.arange(0, BR)
    c = pid_c * BC + tl.arange(0, BC)
    mask = (r[:, None] < R) & (c[None, :] < Cc)
    g64, r64, c64 = g.to(tl.int64), r.to(tl.int64), c.to(tl.int64)
    x = tl.load(x_ptr + g64 * sg + r64[:, None] * sr + c64[None, :] * sc, mask=mask, other=0.0).to(tl.float32)
    q = _e4m3_bits(x * s)
    G = tl.num_programs(2)
    if ROWS:
        tl.store(rows_ptr + r64[:, None] * (G * Cc) + g64 * Cc + c64[None, :], q, mask=mask)
    if TRANS:
        tl.store(t_ptr + g64 * Cc * R + c64[None, :] * R + r64[:, None], q, mask=mask)


def quantize(x: torch.Tensor, slot: torch.Tensor, rows: torch.Tensor | None, trans: torch.Tensor | None,
             amax_done: bool = False) -> None:  # fmt: skip
    """x (R, Cc) or (G, R, Cc), contiguous -> E4M3 into rows (R, G*Cc) and/or trans (G, Cc, R) (either may be
    None), with slot (fp8.SLOT,) = [2^-k, amax, 0, 0]. amax_done: x's producer already left its amax in slot[1]."""
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    G, R, Cc = x3.shape
    if not amax_done:
        slot[1].zero_()
        n = x3.numel()

        def amax(block: int, per_sm: int, warps: int) -> Callable[[], None]:
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
            grid = (min(triton.cdiv(n, block), per_sm * sms),)
            return lambda: k_amax[grid](x3, slot, n, BLOCK=block, num_warps=warps)

        _run(amax, AMAX_CONFIGS, "fp8_amax", f"{n}:{x.dtype}")
    rows_or, trans_or = (rows if rows is not None else trans), (trans if trans is not None else rows)  # one unused

    def cast(br: int, bc: int, warps: int) -> Callable[[], None]:
        grid = (triton.cdiv(R, br), triton.cdiv(Cc, bc), G)
        return lambda: k_cast[grid](x3, rows_or.view(torch.uint8), trans_or.view(torch.uint8), slot, R, Cc,
                                    *x3.stride(), ROWS=rows is not None, TRANS=trans is not None, BR=br, BC=bc,
                                    num_warps=warps)  # fmt: skip

    _run(cast, CAST_CONFIGS, "fp8_cast", f"{G}x{R}x{Cc}:{x3.stride()}:{x.dtype}:{int(rows is not None)}"
         f"{int(trans is not None)}")  # fmt: skip


# Launch configurations, timed once per GPU and shape in the warm-up (tuning.py); the interpreter takes the first.
# k_amax: (BLOCK, programs per multiprocessor, warps); k_cast: (BR, BC, warps)
AMAX_CONFIGS = {"b4096x4": (4096, 4, 4), "b8192x8": (8192, 8, 8), "b2048x16": (2048, 16, 4), "b16384x2": (16384, 2, 8)}
CAST_CONFIGS = {"32x32": (32, 32, 4), "64x64": (64, 64, 4), "64x128": (64, 128, 4), "128x64": (128, 64, 8),
                "128x128": (128, 128, 8), "32x128": (32, 128, 4)}  # fmt: skip


def _run(make: Callable[..., Callable[[], None]], configs: dict[str, tuple[int, ...]], table: str, key: str) -> None:
    """Launch with the configuration chosen for this key (every candidate computes the same bytes: the casts are
    exact and the amax a max, so the warm-up may run each several times)."""
    if tuning.INTERPRET:
        make(*next(iter(configs.values())))()
        return
    choice = _chosen.get((table, key))
    if choice is None:
        choice = tuning.choose(table, key, {c: make(*configs[c]) for c in configs})
        if tuning.is_open() or key in tuning.choices(table):  # outside the warm-up: the first, not kept
            _chosen[(table, key)] = choice
    make(*configs[choice])()


_chosen: dict[tuple[str, str], str] = {}


def mm8(out: torch.Tensor, a: torch.Tensor, ia: torch.Tensor, b: torch.Tensor, ib: torch.Tensor,
        accumulate: bool = False, wgrad: torch.Tensor | None = None) -> None:  # fmt: skip
    """out (M,N) (+)= (a (M,K) @ b (K,N)) * ia * ib: E4M3 a (row-major) and b (column-major), fp32 sums; ia, ib
    the (1,) inverse scales. Accumulating on cuBLASLt goes through `wgrad` (fp32, at least M*N)."""
    if tuning.INTERPRET or not out.is_cuda:
        M, K = a.shape
        N = b.shape[1]
        cfg = dict(BM=32, BN=32, BK=32, GROUP_M=4)
        grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
        k_mm_scaled[grid](out, a, b, ia, ib, M, N, K, *a.stride(), *b.stride(), *out.stride(),
                                 ACC=accumulate, **cfg)  # fmt: skip
        return
    if not accumulate:
        torch._scaled_mm(a, b, ia, ib, out_dtype=out.dtype, out=out)
        return
    tmp = wgrad[: out.numel()].view(out.shape)
    torch._scaled_mm(a, b, ia, ib, out_dtype=torch.float32, out=tmp)
    out.add_(tmp)


@dataclass(frozen=True)
class Scratch:
    """The planned scratch of the FP8 linears (the rows of `scratch_rows`)."""

    x8: torch.Tensor  # activation operand, row layout (flat, N*4C); its transpose is saved with its site (xt)
    g8: torch.Tensor  # gradient operand, row layout
    g8t: torch.Tensor  # gradient operand, transposed
    scales: torch.Tensor  # (2, fp8.SLOT): the scale slots of SLOT_DY and SLOT_DH
    wgrad: torch.Tensor  # fp32 (C*4C,): cuBLASLt's weight-gradient product before the +=

    @classmethod
    def of(cls, arena: Any) -> Scratch:
        return cls(*(arena[name] for name in ("fp8_x", "fp8_g", "fp8_gt", "fp8_scales", "fp8_wgrad")))

    @staticmethod
    def view(flat: torch.Tensor, *shape: int) -> torch.Tensor:
        """The first prod(shape) elements of a flat scratch buffer, as that shape."""
        return flat[: math.prod(shape)].view(shape)


def scratch_rows(N: int, C: int) -> list[tuple[str, tuple[int, ...], str]]:
    """The triton backend's fp8 scratch for N tokens a micro-batch and width C: (buffer, shape, kind) rows of the
    plan's "kernel" role."""
    ops = [(name, (N * 4 * C,), "f8") for name in ("fp8_x", "fp8_g", "fp8_gt")]
    return ops + [("fp8_scales", (2, SLOT), "f32"), ("fp8_wgrad", (4 * C * C,), "f32")]


def saved_rows(N: int, C: int, L: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Each site's E4M3 input as the forward cast it, transposed (C_in, N), for its weight gradient in backward:
    (buffer, shape, kind) rows of the plan's "acts" role."""
    return [(f"h{layer}.{site}.xt", (C_in * N,), "f8") for layer in range(L)
            for site, (_, C_in, _) in site_shapes(C).items()]  # fmt: skip


# --- the ops' FP8 paths (linear.py and mlp.py call these when handed an Fp8Weight) -------------------------------
def linear_forward(out: torch.Tensor, x: torch.Tensor, w: Fp8Weight, q: Scratch) -> None:
    """out (N,OC) = x @ w, or out (G,N,OC) = x @ w[g]."""
    G, C, OC = w.master.shape
    x2 = x.view(-1, C)
    N = x2.shape[0]
    x8 = q.view(q.x8, N, C)
    quantize(x2, w.xscale, x8, w.xt.view(C, N))  # the transposed copy waits for backward's weight gradient
    out3 = out.view(G, N, OC)
    for g in range(G):
        mm8(out3[g], x8, w.xscale[:1], w.w8t[g].t(), w.scale[:1])


def linear_backward(dx: torch.Tensor, dw: torch.Tensor, dout: torch.Tensor, x: torch.Tensor, w: Fp8Weight,
                    q: Scratch) -> None:  # fmt: skip
    """dx = sum_g dout[g] @ w[g].T (one GEMM over K = G*OC) ; dw[g] += x.T @ dout[g]."""
    G, C, OC = w.master.shape
    x2 = x.view(-1, C)
    N = x2.shape[0]
    g8, g8t, sg = q.view(q.g8, N, G * OC), q.view(q.g8t, G, OC, N), q.scales[SLOT_DY]
    quantize(dout.view(G, N, OC), sg, g8, g8t)
    mm8(dx.view(N, C), g8, sg[:1], w.w8.t(), w.scale[:1])
    dw3 = dw.view(G, C, OC)
    for g in range(G):
        mm8(dw3[g], w.xt.view(C, N), w.xscale[:1], g8t[g].t(), sg[:1], accumulate=True, wgrad=q.wgrad)


def cast_weights(weights: list[Fp8Weight]) -> None:
    """Each site's fp32 masters (G, C, OC) -> w8 (C, G*OC) and w8t (G, OC, C) in E4M3; scale = [2^-k, amax, 0, 0]."""
    for w in weights:
        quantize(w.master, w.scale, w.w8, w.w8t)
