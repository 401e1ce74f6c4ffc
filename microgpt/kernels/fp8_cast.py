"""FP8 E4M3 casts on the GPU (precision "fp8"): every E4M3 operand of the GEMM sites (kernels/fp8.py) and every
E4M3 copy of the weights is one k_cast launch, and k_roll ends a micro-batch. microgpt/fp8.py gives the format, the
scale rule and the slots; microgpt/ops/fp8.py is the NumPy reference, which these casts match bit for bit.

    cast(tuner, x, slot, rows, trans, ...)   y = op(x) in E4M3, in rows and/or transposed, at the slot's scale
    roll(slots, shift)                       the end of a micro-batch: each slot's amax into its history
    stack(weights)                           the weights' cast as launches: a site's weights in every layer as one

A cast is one k_cast launch: every program takes the scale from the slot (its pre word and its amax history),
rounds its tile of y = op(x) to E4M3 and writes it in the row layout a GEMM's left operand needs and/or transposed,
as its right operand needs, and adds the tile's finite max |y| to the slot's amax word (atomic max); program 0
writes 2^-k. op is the identity, the MLP's activation (y = gelu(h) or relu(h)^2: the MLP's second input is cast as
the activation computes it, with no bf16 copy) or its backward (y = da * gelu'(h) or da * 2 relu(h): the MLP's dh
likewise). While the histories are being primed
(a fresh run's first micro-batch) and for the weights (current scaling), a first launch of the same kernel with
AMAX_ONLY puts max |y| into the pre word. k_roll ends a micro-batch (ops/fp8.Matmul.roll).

The weights' cast (kernels/fp8.Matmul.cast_weights) casts one site's weights in every layer with one launch (a layer
axis on the grid: `stack` finds them), and after the optimizer step's AdamW it skips the amax launches: where the
training plan asks AdamW for the weights' segment maxima (engine/precision.py; ops/adamw.py), AdamW recorded each
weight's finite max |p| as it stored the masters, and the cast takes it (TAKE) and leaves the slot as the amax
launch would have. ANDREA-120M's weights then take 6 launches a step (5 casts and the clearing of the recorded
amaxes) where they took 147 (an amax launch, a cast and a memset each).

The bytes are those of the rounding rule on the fp32 bits (_e4m3_bits: round to nearest even, the rounding of
torch's E4M3 conversion and of ml_dtypes, which the tests compare byte for byte), which the Triton interpreter (CI)
runs. The GPU gets them cheaper, since a cast is bound by instructions, not bytes (dev/cast_limits.py; bench/
RESULTS.md): the amax is a max over the bits of |y| as integers, and a tile whose values are all finite (every
tile in practice) is rounded by the conversion instruction alone, which saturates at +-448 itself; a tile with an
inf or a NaN takes the long way (_finite_amax, _e4m3). The GPU suite checks both against the rule on all 2^32 fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from microgpt.fp8 import HISTORY, OSLOT, Fp8Head, Fp8Weight
from microgpt.kernels.gelu import gelu, gelu_grad
from microgpt.kernels.tuning import INTERPRET, Tuner

COPY, GELU, GELU_GRAD, RELU2, RELU2_GRAD = 0, 1, 2, 3, 4  # k_cast's op: y = x, gelu(x), x2 gelu'(x), relu(x)^2,
# x2 * 2 relu(x), in fp32 (ops/relu2.py's order: the square of the max, the gradient times twice the max)
CAST_OPS = {"gelu": (GELU, GELU_GRAD), "relu2": (RELU2, RELU2_GRAD)}  # the MLP's activation -> (forward, backward)
HW_CVT = not INTERPRET  # k_cast rounds by the GPU's conversion instruction (_e4m3)


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
    """The E4M3 (fn) byte of each fp32 y: clamped to +-448, then round to nearest even; inf and NaN give NaN (0x7F,
    as ml_dtypes writes a NaN)."""
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = tl.minimum(u & 0x7FFFFFFF, 0x43E00000)  # 448's bits: a larger finite |y| saturates
    # normal results (|y| >= 2^-6): keep 3 mantissa bits (a carry moves into the exponent), rebias 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal results: multiples of 2^-9, rounded to an integer by the fp32 adder (ties to even)
    scaled = a.to(tl.float32, bitcast=True) * 512.0  # |y| (clamped: finite)
    sub = ((scaled + 8388608.0) - 8388608.0).to(tl.int32)
    q = tl.where(a >= (121 << 23), normal, sub) | sign
    return tl.where((u & 0x7FFFFFFF) >= 0x7F800000, 0x7F, q).to(tl.uint8)


@triton.jit
def _e4m3(y, HW: tl.constexpr):
    """_e4m3_bits(y); HW: by the GPU's own E4M3 conversion of y clamped to +-448, non-finite y made NaN after: far
    fewer instructions than the bit rule's ~20 integer operations, and the same byte for every fp32 (the GPU suite
    checks all 2^32). The interpreter rounds E4M3 subnormals otherwise, so it runs the bits."""
    if HW:
        q = tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return tl.where(tl.abs(y) <= 3.4028234663852886e38, q, 0x7F).to(tl.uint8)
    else:
        return _e4m3_bits(y)


@triton.jit
def _finite_amax(y):
    """(max |y| over the tile, whether every y is finite). The max is taken on the bits of |y| as integers (for
    non-negative floats their order), two instructions an element; a tile that holds an inf or a NaN (bits >=
    0x7F800000) takes the slower finite max, which leaves them out."""
    top = tl.max(tl.max(y.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0)
    finite = top < 0x7F800000
    if finite:
        m = top.to(tl.float32, bitcast=True)
    else:
        ay = tl.abs(y)
        m = tl.max(tl.max(tl.where(ay <= 3.4028234663852886e38, ay, 0.0), axis=1), axis=0)
    return m, finite


@triton.jit
def k_cast(
    x_ptr,
    x2_ptr,
    rows_ptr,
    t_ptr,
    slot_ptr,
    take_ptr,
    R,
    Cc,
    G,
    sl,
    sg,
    sr,
    sc,
    lrow,
    lt,
    lq,
    lw,
    OP: tl.constexpr,
    AMAX_ONLY: tl.constexpr,
    TAKE: tl.constexpr,
    HIST: tl.constexpr,
    ROWS: tl.constexpr,
    TRANS: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    PACK: tl.constexpr,
    HW: tl.constexpr,
):
    # L casts at once, one per layer l (grid axis 2 = L * G): x advanced by l * sl elements, rows, t, slot and take
    # by l * lrow, l * lt, l * lq and l * lw. TAKE (a weight's cast after AdamW, HIST 0): the amax is take[0], the
    # finite max |x| AdamW recorded, and the slot is written whole ([2^-k, amax, amax, 0] as the primed cast leaves
    # it) where it would be max-ed into.
    # y = op(x (G, R, Cc), x2 the same shape and strides) -> rows (R, G*Cc): rows[r, g*Cc + c]; t (G, Cc, R):
    # t[g, c, r]. slot: [2^-k, pre, amax, 0, history (HIST words)]. AMAX_ONLY: pre = max(pre, finite max |y|), no
    # stores; else k from max(pre, history), slot[0] = 2^-k, amax = max(amax, finite max |y|). PACK (R % PACK == 0):
    # the transpose is stored as PACK-byte words, PACK consecutive r of a column each (byte j of a word is r = PACK
    # i + j, little-endian): byte stores down a column are what make a transposing cast slow
    pid_r, pid_c, lg = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # lg = l * G + g
    layer, g = lg // G, lg % G
    l64 = layer.to(tl.int64)
    slot_ptr += l64 * lq
    rows_ptr += l64 * lrow
    r = pid_r * BR + tl.arange(0, BR)
    c = pid_c * BC + tl.arange(0, BC)
    mask = (r[:, None] < R) & (c[None, :] < Cc)
    g64, r64, c64 = g.to(tl.int64), r.to(tl.int64), c.to(tl.int64)
    at = l64 * sl + g64 * sg + r64[:, None] * sr + c64[None, :] * sc
    x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    if OP == 1:
        y = gelu(x)
    elif OP == 2:
        y = tl.load(x2_ptr + at, mask=mask, other=0.0).to(tl.float32) * gelu_grad(x)
    elif OP == 3:
        y = tl.maximum(x, 0.0) * tl.maximum(x, 0.0)
    elif OP == 4:
        y = tl.load(x2_ptr + at, mask=mask, other=0.0).to(tl.float32) * (2.0 * tl.maximum(x, 0.0))
    else:
        y = x
    m, finite = _finite_amax(y)  # masked-off elements load as 0, which every op maps to 0
    if AMAX_ONLY:
        tl.atomic_max(slot_ptr + 1, m, sem="relaxed")
    else:
        if TAKE:
            amax = tl.load(take_ptr + l64 * lw)
        else:
            amax = tl.load(slot_ptr + 1)
        if HIST > 0:
            amax = tl.maximum(amax, tl.max(tl.load(slot_ptr + 4 + tl.arange(0, HIST)), axis=0))
        s, inv = _scale(amax)
        if (pid_r == 0) & (pid_c == 0) & (g == 0):
            tl.store(slot_ptr, inv)
            if TAKE:  # every program's tile max is at most amax, the max over them all
                tl.store(slot_ptr + 1, amax)
                tl.store(slot_ptr + 2, amax)
        if not TAKE:
            tl.atomic_max(slot_ptr + 2, m, sem="relaxed")  # only k_roll, a later launch, reads it
        if finite & HW:  # the conversion alone: it saturates finite values at +-448 itself
            q = (y * s).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            q = _e4m3(y * s, HW)
        if ROWS:
            tl.store(rows_ptr + r64[:, None] * (G * Cc) + g64 * Cc + c64[None, :], q, mask=mask)
        if TRANS:
            if PACK > 1:
                word = tl.uint64 if PACK == 8 else tl.uint32
                shifts = (tl.arange(0, PACK) * 8).to(word)
                words = tl.sum(tl.reshape(q.to(word), [BR // PACK, PACK, BC]) << shifts[None, :, None], axis=1)
                i = pid_r * (BR // PACK) + tl.arange(0, BR // PACK)
                t_words = t_ptr.to(tl.pointer_type(word)) + (l64 * lt + g64 * Cc * R) // PACK
                tl.store(
                    t_words + c64[None, :] * (R // PACK) + i.to(tl.int64)[:, None],
                    words,
                    mask=(i[:, None] < R // PACK) & (c[None, :] < Cc),
                )
            else:
                tl.store(t_ptr + l64 * lt + g64 * Cc * R + c64[None, :] * R + r64[:, None], q, mask=mask)


@triton.jit
def k_roll(slots_ptr, SHIFT: tl.constexpr, SLOT: tl.constexpr, HIST: tl.constexpr):
    # one slot per program: SHIFT: history = [amax, history[:-1]]; then pre = amax = 0
    base = slots_ptr + tl.program_id(0).to(tl.int64) * SLOT
    if SHIFT:
        i = tl.arange(0, HIST)
        older = tl.load(base + 3 + i, mask=i > 0, other=0.0)  # history[i - 1] (word 4 + i - 1)
        amax = tl.load(base + 2)
        tl.store(base + 4 + i, tl.where(i == 0, amax, older))
    tl.store(base + 1, 0.0)
    tl.store(base + 2, 0.0)


def cast(
    tuner: Tuner,
    x: torch.Tensor,
    slot: torch.Tensor,
    rows: torch.Tensor | None,
    trans: torch.Tensor | None,
    prime: bool = False,
    op: int = COPY,
    x2: torch.Tensor | None = None,
    hist: int = HISTORY,
    take: torch.Tensor | None = None,
) -> None:
    """y = op(x) for x (R, Cc) or (G, R, Cc) (x2, da of an activation's backward, shaped and strided as x) -> E4M3 into
    rows (R, G*Cc) and/or trans (G, Cc, R) (either may be None), scaled by the slot (hist: the words of history it
    has, 0 for a weight's). prime: y's own amax goes into the slot's pre word first (one more launch); take (1,),
    a weight's instead of prime: its amax as AdamW recorded it, which the slot then holds as prime leaves it.
    Or L such casts in one launch, one a layer: x (L, G, R, Cc), rows (L, R, G*Cc), trans (L, G, Cc, R), slot
    (L, SLOT) and take (L,), each strided over its first axis (the weights' cast: a site's weights in every
    layer)."""
    stacked = slot.dim() == 2
    x4 = x if stacked else (x if x.dim() == 3 else x.unsqueeze(0)).unsqueeze(0)
    y2 = x4 if x2 is None else x2.view(x4.shape)
    L, G, R, Cc = x4.shape
    # a layout not asked for (and both in the amax launch) is never stored through: x stands in for its pointer
    rows_p, trans_p = (x4 if a is None else a.view(torch.uint8) for a in (rows, trans))
    lrow, lt = (a.stride(0) if stacked and a is not None else 0 for a in (rows, trans))
    lq = slot.stride(0) if stacked else 0
    lw = take.stride(0) if take is not None else 0

    def launch(amax_only: bool) -> Callable[[int, int, int, int], Callable[[], None]]:
        def make(br: int, bc: int, warps: int, pack: int) -> Callable[[], None]:
            grid = (triton.cdiv(R, br), triton.cdiv(Cc, bc), L * G)
            return lambda: k_cast[grid](
                x4,
                y2,
                rows_p,
                trans_p,
                slot,
                slot if take is None else take,
                R,
                Cc,
                G,
                *x4.stride(),
                lrow,
                lt,
                lq,
                lw,
                OP=op,
                AMAX_ONLY=amax_only,
                TAKE=take is not None,
                HIST=hist,
                ROWS=rows is not None and not amax_only,
                TRANS=trans is not None and not amax_only,
                BR=br,
                BC=bc,
                PACK=pack if R % pack == 0 and lt % pack == 0 else 1,
                HW=HW_CVT,
                num_warps=warps,
            )

        return make

    shape = f"{G}x{R}x{Cc}" if L == 1 else f"{L}x{G}x{R}x{Cc}"
    key = f"{shape}:{x4.stride()[1:]}:{x.dtype}:op{op}:h{hist}:{int(rows is not None)}{int(trans is not None)}"
    if take is not None:
        key += ":take"
    elif prime:
        tuner.launch("fp8_amax", key, CAST_CONFIGS, launch(True))
    tuner.launch("fp8_cast", key, CAST_CONFIGS, launch(False))


def roll(slots: torch.Tensor, shift: bool = True) -> None:
    """slots (..., OSLOT): the end of a micro-batch (ops/fp8.Matmul.roll): shift, each slot's amax becomes its
    history's newest entry; either way its pre and amax words are cleared."""
    k_roll[(slots.numel() // OSLOT,)](slots, SHIFT=shift, SLOT=OSLOT, HIST=HISTORY)


def stack(weights: list[Fp8Weight | Fp8Head]) -> list[tuple[slice, tuple[torch.Tensor, ...]]]:
    """The weights' cast as launches: for each run of weights that lie at one stride from each other in all four
    buffers (a site's weights in consecutive layers: the canonical order puts its masters one block apart, and the
    plan lists its E4M3 layouts and slots layer by layer, all of one size), its positions in `weights` and its
    (master, w8, w8t, scale) as views of (L, G, C, OC), (L, C, G*OC), (L, G, OC, C) and (L, SLOT); the rest one by
    one, as they are (w8t None for the head)."""
    out: list[tuple[slice, tuple[torch.Tensor, ...]]] = []
    runs: dict[str, list[int]] = {}
    for i, w in enumerate(weights):
        if isinstance(w, Fp8Weight):
            runs.setdefault(w.name.split(".", 1)[-1], []).append(i)
        else:
            out.append((slice(i, i + 1), (w.master, w.w8, w.w8t, w.scale)))
    for run in runs.values():
        parts = [[getattr(weights[i], f) for i in run] for f in ("master", "w8", "w8t", "scale")]
        steps = [_stride(ts) for ts in parts]
        step = run[1] - run[0] if len(run) > 1 else 1
        if len(run) == 1 or None in steps or run != list(range(run[0], run[-1] + 1, step)):
            out += [
                (slice(i, i + 1), (weights[i].master, weights[i].w8, weights[i].w8t, weights[i].scale)) for i in run
            ]
            continue
        views = tuple(t[0].as_strided((len(run), *t[0].shape), (d, *t[0].stride())) for t, d in zip(parts, steps))
        out.append((slice(run[0], run[-1] + 1, step), views))
    return out


def _stride(ts: list[torch.Tensor]) -> int | None:
    """The element stride between consecutive tensors of ts (one shape, strides and storage), or None where there
    is none."""
    t0, size = ts[0], ts[0].element_size()
    step, rem = divmod(ts[1].data_ptr() - t0.data_ptr(), size) if len(ts) > 1 else (0, 0)
    same = all(
        t.shape == t0.shape
        and t.stride() == t0.stride()
        and t.untyped_storage().data_ptr() == t0.untyped_storage().data_ptr()
        for t in ts
    )
    if rem or step <= 0 or not same:
        return None
    return step if all(t.data_ptr() - t0.data_ptr() == i * step * size for i, t in enumerate(ts)) else None


# Launch configurations of k_cast (BR, BC, warps, PACK: the transpose's word bytes, 1 where R is not a multiple;
# named BRxBC, wPACK, and nWARPS where the name would otherwise repeat one),
# timed once per GPU and shape in the warm-up (tuning.py); the interpreter takes the first. No one configuration
# wins every cast: the casts differ in width and in what they compute on the way, so each takes its own
# (dev/cast_limits.py; the H200's winners are in bench/RESULTS.md).
CAST_CONFIGS = {"32x32w4": (32, 32, 4, 4), "64x64w4": (64, 64, 4, 4), "32x128w4": (32, 128, 4, 4),
                "64x128w4": (64, 128, 8, 4), "64x64w8": (64, 64, 4, 8), "32x128w8": (32, 128, 4, 8),
                "64x128w8": (64, 128, 8, 8), "128x64w8": (128, 64, 8, 8), "64x64w1": (64, 64, 4, 1),
                "64x128w4n4": (64, 128, 4, 4), "32x128w1": (32, 128, 4, 1)}  # fmt: skip
