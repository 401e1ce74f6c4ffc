"""Causal self-attention, flash style. q, k, v, out: (B,T,C) with heads interleaved as (B,T,NH,hs); lse (B,NH,T) fp32.

Forward keeps only out and the row log-sum-exp lse = log(sum_j exp(q.k_j / sqrt(hs))) (natural log): never a
TxT matrix in memory. Backward recomputes P = exp(S - lse) tile by tile:
    delta = rowsum(dout * out)                      (k_attention_bwd_delta, into a (B,NH,T) fp32 scratch)
    dv = P.T @ dout ; dk = dS.T @ q * scale         (programs owning a K/V block, looping over q blocks)
    dq = dS @ k * scale, dS = P * (dout @ v.T - delta)    (programs owning a q block, looping over K/V blocks)
Both halves run in one launch and each output tile has one owner: no atomics, deterministic, and dq, dk, dv are
stored, not added (attention is their one writer: nothing zeroes them first).
Exponentials run in base 2 with the scale folded in (exp2 is the native instruction). Each loop is split into
the tiles that straddle the diagonal (masked) and the rest (no mask), so the hot loop carries no causal test.
Tile sizes are chosen once per GPU, dtype and (T, hs) by timing inside the warm-up step (tuning.py, cached on
disk); fp32 and the interpreter use one fixed config each.

The window and the documents (ops/attention.py: query i sees key j iff j <= i, i - j < w and j >= doc_start[i]): the
window w is read from a (1,) int32 buffer and the document starts from a (B, T) int32 one, so neither is compiled in
(a window that widens during training changes what the kernels read, not their binaries or a captured graph);
constexprs WINDOW and DOC say only whether each is given. Each row's first visible key lo(i) = max(i - w + 1,
doc_start[i]) is non-decreasing in i, so a block of query rows needs the keys from its first row's lo: the tiles below
it are skipped (that is the window's speed), the tiles between the rows' smallest and largest lo are masked, the rest
before the diagonal are not. A key tile's rows (dk, dv) run from the tile to its last key's last reader, min(j + w,
the next document's start), which a binary search over doc_start finds; the rows that see the whole tile are
unmasked, those past them masked. Without either buffer the kernels are the causal ones, bit for bit.

The modern block's q and k are qkrope's outputs, and its backward is attention's then qkrope's (ops/attention.py
`qkrope`). Every dq tile and every dk tile ends in one program with the whole tile in fp32 registers, and that
program has just read the same rows of q or k, qkrope's output y: with the constexpr QKROPE, it rounds its tile to
dq's dtype (what the unfused pass would read back), applies qkrope's backward row by row (each row's rstd, its
position's cos and sin, the tile's halves paired by a reshape in registers, y's halves read again from L2 rather
than kept live through the loop; kernels/qkrope.py norm_rotate_row_bwd, the pass's own function) and stores the
gradient w.r.t. qkrope's input, so the pass over dq, dk (reading y and g, rewriting g) goes. It needs the head's
lanes to fill the tile (hs a power of two, 16 or more: the modern block's 128). Fused, or attention then the pass,
is a choice the warm-up times (table attention_qkrope, its tiles timed apart: key suffix ":qkrope"); with QKROPE off
(the GPT-2 block, the pass way) the kernel computes what it did without the flag, in the same order.

attention_forward_cached is the inference step's (microgpt/engine/model.py gpt_infer, ops/attention.py says what it
computes): queries at positions pos .. pos + t - 1 against the KV cache's keys and values of positions 0 .. pos +
t - 1, one program per (sequence, head, block of queries) over the cached keys with the same online softmax. It is
the plain first version: a decode step (t = 1) fills one row of its 16-row tile and does not split the keys over
programs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from microgpt.kernels import qkrope as kqkrope
from microgpt.kernels.qkrope import norm_rotate_row_bwd, rope_row
from microgpt.kernels.tuning import INTERPRET, Tuner

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")  # fp32 mode: no tf32 rounding
    else:
        return tl.dot(a, b)


@triton.jit
def _fwd_tiles(
    acc,
    l_i,
    m_i,
    q,
    k_ptr,
    v_ptr,
    base,
    offs_m,
    lo,
    hi,
    T,
    C,
    HS,
    qk_scale,
    first,
    MASK: tl.constexpr,
    BOUND: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
):
    # first: (BM,) each row's first visible key, read where MASK and BOUND
    offs_d = tl.arange(0, BD)
    dmask = offs_d < HS
    for start_n in range(lo, hi, BN):
        cols = start_n + tl.arange(0, BN)
        kt = tl.load(
            k_ptr + base + cols[None, :] * C + offs_d[:, None], mask=dmask[:, None] & (cols < T)[None, :], other=0.0
        )
        s = _dot(q, kt, IEEE)
        if MASK:
            seen = (offs_m[:, None] >= cols[None, :]) & (cols < T)[None, :]
            if BOUND:
                seen = seen & (cols[None, :] >= first[:, None])
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        shift = m_new
        if BOUND:  # a row that has seen no key yet: shift by 0 (not -inf), its maximum still -inf
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * qk_scale - shift[:, None])  # the scale and the shift as one FMA per score
        alpha = tl.math.exp2(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + base + cols[:, None] * C + offs_d[None, :], mask=(cols < T)[:, None] & dmask[None, :], other=0.0
        )
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _first_keys(win_ptr, ds_ptr, ds_off, pos, WINDOW: tl.constexpr, DOC: tl.constexpr):
    # each query's first visible key max(0, pos - w + 1, doc_start): pos its positions, ds_off where its doc_start is
    lo = tl.zeros_like(pos)
    if WINDOW:
        lo = tl.maximum(lo, pos - tl.load(win_ptr) + 1)
    if DOC:
        lo = tl.maximum(lo, tl.load(ds_ptr + ds_off))
    return lo


@triton.jit
def k_attention_fwd(
    out_ptr,
    lse_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    win_ptr,
    ds_ptr,
    T,
    C,
    NH,
    HS,
    sds,
    qk_scale,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
    WINDOW: tl.constexpr,
    DOC: tl.constexpr,
):
    # out, q, k, v: (B, T, C) head h at columns [h*HS, (h+1)*HS); lse: (B, NH, T) fp32; qk_scale = log2(e)/sqrt(HS);
    # win: (1,) int32, read with WINDOW; ds: (B, T) int32 of row stride sds, read with DOC
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest rows first
    bh = tl.program_id(1)
    base = (bh // NH).to(tl.int64) * T * C + (bh % NH) * HS
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    qmask = (offs_m < T)[:, None] & (offs_d < HS)[None, :]
    q = tl.load(q_ptr + base + offs_m[:, None] * C + offs_d[None, :], mask=qmask, other=0.0)
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, BD), dtype=tl.float32)
    diag = pid_m * BM  # K/V tiles before this are visible to every row of the tile (BM % BN == 0)
    if WINDOW or DOC:
        rows = tl.minimum(offs_m, T - 1)  # rows past T (never stored) take the last row's bound
        first = _first_keys(win_ptr, ds_ptr, (bh // NH).to(tl.int64) * sds + rows, rows, WINDOW, DOC)
        lo = tl.min(first, axis=0) // BN * BN  # the tiles before lo: seen by no row of the block, skipped
        free = tl.maximum(tl.minimum(tl.cdiv(tl.max(first, axis=0), BN) * BN, diag), lo)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_ptr, v_ptr, base, offs_m, lo, free, T, C, HS, qk_scale, first, True, True, BN, BD, IEEE
        )
    else:
        first = offs_m
        free = 0
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_ptr, v_ptr, base, offs_m, free, diag, T, C, HS, qk_scale, first, False, False, BN, BD, IEEE
    )
    acc, l_i, m_i = _fwd_tiles(
        acc,
        l_i,
        m_i,
        q,
        k_ptr,
        v_ptr,
        base,
        offs_m,
        diag,
        tl.minimum(diag + BM, T),
        T,
        C,
        HS,
        qk_scale,
        first,
        True,
        WINDOW or DOC,
        BN,
        BD,
        IEEE,
    )
    out = acc / l_i[:, None]
    tl.store(out_ptr + base + offs_m[:, None] * C + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=qmask)
    tl.store(lse_ptr + bh.to(tl.int64) * T + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=offs_m < T)


@triton.jit
def k_attention_bwd_delta(delta_ptr, out_ptr, dout_ptr, T, C, NH, HS, BM: tl.constexpr, BD: tl.constexpr):
    # delta: (B, NH, T) fp32 = rowsum(dout * out) per head
    bh = tl.program_id(1)
    base = (bh // NH).to(tl.int64) * T * C + (bh % NH) * HS
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    mask = (offs_m < T)[:, None] & (offs_d < HS)[None, :]
    ptr = base + offs_m[:, None] * C + offs_d[None, :]
    o = tl.load(out_ptr + ptr, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(dout_ptr + ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh.to(tl.int64) * T + offs_m, tl.sum(o * do, axis=1), mask=offs_m < T)


@triton.jit
def _dkdv_tiles(
    dk,
    dv,
    k,
    v,
    q_ptr,
    dout_ptr,
    lse_ptr,
    delta_ptr,
    base,
    row_base,
    offs_n,
    lo,
    hi,
    T,
    C,
    HS,
    qk_scale,
    win_ptr,
    ds_ptr,
    ds_row,
    MASK: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
    WINDOW: tl.constexpr,
    DOC: tl.constexpr,
):
    # rows >= T load as zeros (q, dout, lse, delta): their terms vanish without a mask; where MASK, the rows' first
    # keys (WINDOW, DOC) narrow it
    offs_d = tl.arange(0, BD)
    for start_m in range(lo, hi, BM):
        offs_m = start_m + tl.arange(0, BM)
        mmask = offs_m < T
        qt = tl.load(
            q_ptr + base + offs_m[None, :] * C + offs_d[:, None],
            mask=(offs_d < HS)[:, None] & mmask[None, :],
            other=0.0,
        )
        do = tl.load(
            dout_ptr + base + offs_m[:, None] * C + offs_d[None, :],
            mask=mmask[:, None] & (offs_d < HS)[None, :],
            other=0.0,
        )
        lse = tl.load(lse_ptr + row_base + offs_m, mask=mmask, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_ptr + row_base + offs_m, mask=mmask, other=0.0)
        pt = tl.math.exp2(_dot(k, qt, IEEE) * qk_scale - lse[None, :])  # (BN, BM) = P.T
        if MASK:
            seen = (offs_m[None, :] >= offs_n[:, None]) & mmask[None, :]
            if WINDOW or DOC:
                rows = tl.minimum(offs_m, T - 1)
                first = _first_keys(win_ptr, ds_ptr, ds_row + rows, rows, WINDOW, DOC)
                seen = seen & (offs_n[:, None] >= first[None, :])
            pt = tl.where(seen, pt, 0.0)
        dv += _dot(pt.to(do.dtype), do, IEEE)
        dpt = _dot(v, tl.trans(do), IEEE)
        dst = pt * (dpt - delta[None, :])
        dk += _dot(dst.to(qt.dtype), tl.trans(qt), IEEE)
    return dk, dv


@triton.jit
def _dq_tiles(
    dq,
    q,
    do,
    lse,
    delta,
    k_ptr,
    v_ptr,
    base,
    offs_m,
    lo,
    hi,
    T,
    C,
    HS,
    qk_scale,
    first,
    MASK: tl.constexpr,
    BOUND: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
):
    # first: (BM,) each row's first visible key, read where MASK and BOUND
    offs_d = tl.arange(0, BD)
    for start_n in range(lo, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        kv_mask = (offs_d < HS)[:, None] & (offs_n < T)[None, :]
        kt = tl.load(k_ptr + base + offs_n[None, :] * C + offs_d[:, None], mask=kv_mask, other=0.0)
        vt = tl.load(v_ptr + base + offs_n[None, :] * C + offs_d[:, None], mask=kv_mask, other=0.0)
        p = tl.math.exp2(_dot(q, kt, IEEE) * qk_scale - lse[:, None])
        if MASK:
            seen = (offs_m[:, None] >= offs_n[None, :]) & (offs_n < T)[None, :]
            if BOUND:
                seen = seen & (offs_n[None, :] >= first[:, None])
            p = tl.where(seen, p, 0.0)
        ds = p * (_dot(do, vt, IEEE) - delta[:, None])
        dq += _dot(ds.to(kt.dtype), tl.trans(kt), IEEE)
    return dq


@triton.jit
def _doc_end(ds_ptr, ds_row, j, T, SEARCH):
    # the first row after key j whose document starts after j (T where none), by binary search over the row's
    # doc_start (non-decreasing); SEARCH >= the bit length of T
    lo = j + 1
    hi = T + tl.zeros_like(j)
    for _ in range(SEARCH):
        active = lo < hi
        mid = (lo + hi) // 2
        start = tl.load(ds_ptr + ds_row + tl.minimum(mid, T - 1))
        lo = tl.where(active & (start <= j), mid + 1, lo)
        hi = tl.where(active & (start > j), mid, hi)
    return hi


@triton.jit
def _halves(x, BR: tl.constexpr, BD: tl.constexpr):
    # (BR, BD) -> its (BR, BD/2) halves, lanes [0, BD/2) and [BD/2, BD), in registers
    return tl.split(tl.permute(tl.reshape(x, (BR, 2, BD // 2)), (0, 2, 1)))


@triton.jit
def _qkrope_tile(
    g, y_ptr, rstd_ptr, rope_ptr, which, bh, base, rows, T, C, NH, HS, TR, BR: tl.constexpr, BD: tl.constexpr
):
    # The qkrope backward (kernels/qkrope.py norm_rotate_row_bwd) of BR rows of one head: g (BR, BD) fp32 the gradient
    # reaching qkrope's output (q's: which 0, k's: 1), y that output (q or k at y_ptr + base, read again by halves
    # rather than split from the loop's operand tile: fewer registers live), rows (BR,) their positions, clamped to
    # T - 1 (the rows past T are never stored); rstd (2, B*T, NH) fp32, rope (2, TR, HS/2) fp32; BD == HS. Returns the
    # gradient reaching qkrope's input, (BR, BD) fp32.
    g1, g2 = _halves(g, BR, BD)
    half = tl.arange(0, BD // 2)
    y_off = base + rows[:, None] * C + half[None, :]
    y1 = tl.load(y_ptr + y_off).to(tl.float32)
    y2 = tl.load(y_ptr + y_off + BD // 2).to(tl.float32)
    b = (bh // NH).to(tl.int64)
    rstd = tl.load(rstd_ptr + ((which * (tl.num_programs(1) // NH) + b) * T + rows) * NH + bh % NH)
    c, s = rope_row(rope_ptr, rows[:, None], HS, TR, BD // 2)
    d1, d2 = norm_rotate_row_bwd(g1, g2, y1, y2, rstd, c, s, HS)
    return tl.reshape(tl.permute(tl.join(d1, d2), (0, 2, 1)), (BR, BD))


@triton.jit
def k_attention_bwd(
    dq_ptr,
    dk_ptr,
    dv_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    dout_ptr,
    lse_ptr,
    delta_ptr,
    win_ptr,
    ds_ptr,
    rstd_ptr,
    rope_ptr,
    T,
    C,
    NH,
    HS,
    sds,
    TR,
    SEARCH,
    qk_scale,
    sm_scale,
    BM1: tl.constexpr,
    BN1: tl.constexpr,
    BM2: tl.constexpr,
    BN2: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
    WINDOW: tl.constexpr,
    DOC: tl.constexpr,
    QKROPE: tl.constexpr,
):
    # dq, dk, dv, q, k, v, dout: (B, T, C); lse, delta: (B, NH, T) fp32; win, ds as k_attention_fwd's; with QKROPE
    # (BD == HS), rstd (2, B*T, NH) fp32 and rope (2, TR, HS/2) fp32: q, k are qkrope's outputs, and dq, dk are stored
    # as the gradients w.r.t. its input (rounded to their dtype first, as the unfused pass reads them)
    # programs [0, cdiv(T, BN1)) own dk/dv tiles, the rest own dq tiles; BN1 % BM1 == 0 and BM2 % BN2 == 0
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    base = (bh // NH).to(tl.int64) * T * C + (bh % NH) * HS
    row_base = bh.to(tl.int64) * T
    ds_row = (bh // NH).to(tl.int64) * sds
    offs_d = tl.arange(0, BD)
    n_kv = tl.cdiv(T, BN1)
    if pid < n_kv:
        start_n = pid * BN1
        offs_n = start_n + tl.arange(0, BN1)
        kv_mask = (offs_n < T)[:, None] & (offs_d < HS)[None, :]
        kv_off = base + offs_n[:, None] * C + offs_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        dk = tl.zeros((BN1, BD), dtype=tl.float32)
        dv = tl.zeros((BN1, BD), dtype=tl.float32)
        mid = tl.minimum(start_n + BN1, T)  # q rows before start_n never see this tile; rows past mid see all of it
        end = T  # past the last row that sees a key of the tile
        unmasked = T  # past the rows from mid on that see every key of it, in whole tiles of rows
        if WINDOW or DOC:
            free = T + tl.zeros_like(start_n)  # past the last row that sees the tile's first key
            if WINDOW:
                w = tl.load(win_ptr)
                end = tl.minimum(end, mid - 1 + w)
                free = tl.minimum(free, start_n + w)
            if DOC:
                end = tl.minimum(end, _doc_end(ds_ptr, ds_row, mid - 1, T, SEARCH))
                free = tl.minimum(free, _doc_end(ds_ptr, ds_row, start_n, T, SEARCH))
            unmasked = mid + tl.maximum(free - mid, 0) // BM1 * BM1
        dk, dv = _dkdv_tiles(
            dk,
            dv,
            k,
            v,
            q_ptr,
            dout_ptr,
            lse_ptr,
            delta_ptr,
            base,
            row_base,
            offs_n,
            start_n,
            mid,
            T,
            C,
            HS,
            qk_scale,
            win_ptr,
            ds_ptr,
            ds_row,
            True,
            BM1,
            BD,
            IEEE,
            WINDOW,
            DOC,
        )
        dk, dv = _dkdv_tiles(
            dk,
            dv,
            k,
            v,
            q_ptr,
            dout_ptr,
            lse_ptr,
            delta_ptr,
            base,
            row_base,
            offs_n,
            mid,
            unmasked,
            T,
            C,
            HS,
            qk_scale,
            win_ptr,
            ds_ptr,
            ds_row,
            False,
            BM1,
            BD,
            IEEE,
            WINDOW,
            DOC,
        )
        if WINDOW or DOC:
            dk, dv = _dkdv_tiles(
                dk,
                dv,
                k,
                v,
                q_ptr,
                dout_ptr,
                lse_ptr,
                delta_ptr,
                base,
                row_base,
                offs_n,
                unmasked,
                end,
                T,
                C,
                HS,
                qk_scale,
                win_ptr,
                ds_ptr,
                ds_row,
                True,
                BM1,
                BD,
                IEEE,
                WINDOW,
                DOC,
            )
        dk = dk * sm_scale
        if QKROPE:  # dv first: its registers are free for the epilogue's
            tl.store(dv_ptr + kv_off, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)
            rows = tl.minimum(offs_n, T - 1)
            dk = _qkrope_tile(
                dk.to(dk_ptr.dtype.element_ty).to(tl.float32), k_ptr, rstd_ptr, rope_ptr, 1, bh, base, rows, T, C, NH,
                HS, TR, BN1, BD,
            )  # fmt: skip
        tl.store(dk_ptr + kv_off, dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
        if not QKROPE:
            tl.store(dv_ptr + kv_off, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)
    else:
        start_m = (tl.num_programs(0) - 1 - pid) * BM2  # the last rows (the longest loops) first, as dk/dv
        offs_m = start_m + tl.arange(0, BM2)
        mmask = offs_m < T
        q_mask = mmask[:, None] & (offs_d < HS)[None, :]
        q_off = base + offs_m[:, None] * C + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
        do = tl.load(dout_ptr + q_off, mask=q_mask, other=0.0)
        lse = tl.load(lse_ptr + row_base + offs_m, mask=mmask, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_ptr + row_base + offs_m, mask=mmask, other=0.0)
        dq = tl.zeros((BM2, BD), dtype=tl.float32)
        if WINDOW or DOC:
            rows = tl.minimum(offs_m, T - 1)
            first = _first_keys(win_ptr, ds_ptr, ds_row + rows, rows, WINDOW, DOC)
            lo = tl.min(first, axis=0) // BN2 * BN2
            free = tl.maximum(tl.minimum(tl.cdiv(tl.max(first, axis=0), BN2) * BN2, start_m), lo)
            dq = _dq_tiles(
                dq, q, do, lse, delta, k_ptr, v_ptr, base, offs_m, lo, free, T, C, HS, qk_scale, first, True, True,
                BN2, BD, IEEE,
            )  # fmt: skip
        else:
            first = offs_m
            free = 0
        dq = _dq_tiles(
            dq, q, do, lse, delta, k_ptr, v_ptr, base, offs_m, free, start_m, T, C, HS, qk_scale, first, False, False,
            BN2, BD, IEEE,
        )  # fmt: skip
        dq = _dq_tiles(
            dq,
            q,
            do,
            lse,
            delta,
            k_ptr,
            v_ptr,
            base,
            offs_m,
            start_m,
            tl.minimum(start_m + BM2, T),
            T,
            C,
            HS,
            qk_scale,
            first,
            True,
            WINDOW or DOC,
            BN2,
            BD,
            IEEE,
        )
        dq = dq * sm_scale
        if QKROPE:
            rows = tl.minimum(offs_m, T - 1)
            dq = _qkrope_tile(
                dq.to(dq_ptr.dtype.element_ty).to(tl.float32), q_ptr, rstd_ptr, rope_ptr, 0, bh, base, rows, T, C, NH,
                HS, TR, BM2, BD,
            )  # fmt: skip
        tl.store(dq_ptr + q_off, dq.to(dq_ptr.dtype.element_ty), mask=q_mask)


def _cfg(num_warps: int, num_stages: int, **meta: int) -> dict:
    return dict(meta, num_warps=num_warps, num_stages=num_stages)


FWD_CONFIGS = [_cfg(4, 3, BM=128, BN=64), _cfg(4, 4, BM=128, BN=64), _cfg(8, 3, BM=128, BN=64),
               _cfg(8, 3, BM=128, BN=128), _cfg(8, 4, BM=128, BN=128), _cfg(4, 3, BM=64, BN=64),
               _cfg(4, 4, BM=128, BN=32), _cfg(4, 2, BM=64, BN=32)]  # fmt: skip
BWD_CONFIGS = [_cfg(4, 3, BM1=32, BN1=128, BM2=128, BN2=32), _cfg(4, 4, BM1=32, BN1=128, BM2=128, BN2=32),
               _cfg(4, 5, BM1=32, BN1=128, BM2=128, BN2=32), _cfg(8, 3, BM1=64, BN1=128, BM2=128, BN2=64),
               _cfg(8, 4, BM1=64, BN1=128, BM2=128, BN2=64), _cfg(4, 3, BM1=32, BN1=64, BM2=64, BN2=32),
               _cfg(4, 3, BM1=64, BN1=64, BM2=64, BN2=64), _cfg(8, 2, BM1=64, BN1=128, BM2=128, BN2=64),
               _cfg(4, 2, BM1=16, BN1=64, BM2=64, BN2=16), _cfg(4, 3, BM1=32, BN1=64, BM2=64, BN2=64)]  # fmt: skip
# The forward's default, for a length the warm-up did not time (eval's packed batches, a prompt's prefill): 5 (BM 64,
# BN 64, 4 warps, 3 stages) spills on no target of the compile sweep, where 0 spills on sm_80-sm_89, and the H200's
# warm-up chose it at T 1024 over every other (bench/RESULTS.md, twelfth session). The backward runs only in training,
# whose warm-up times every candidate: its default is never run untimed.
FWD_DEFAULT = 5
# Head sizes 65 to 128 (the modern block's 128): each tile holds twice the lanes, so the lists above would put some
# candidates over sm_90's shared memory and most of the rest spilling (the compile sweep at ANDREA-120M-MODERN,
# kernels/check). These keep the tiles that spill little or nothing on sm_90, and a default first that fits every
# target without spilling (forward BM 64 BN 64: 88 KiB on sm_80-sm_89; backward BM 32/BN 64: 58.5 KiB); the larger
# ones fit sm_80 or sm_90 only and are dropped on the cards they do not fit (tuning.py).
FWD_CONFIGS_D128 = [_cfg(4, 3, BM=64, BN=64), _cfg(8, 3, BM=128, BN=64), _cfg(8, 4, BM=128, BN=64),
                    _cfg(8, 3, BM=128, BN=128), _cfg(4, 3, BM=64, BN=32), _cfg(4, 2, BM=64, BN=32),
                    _cfg(8, 4, BM=128, BN=32)]  # fmt: skip
BWD_CONFIGS_D128 = [_cfg(4, 3, BM1=32, BN1=64, BM2=64, BN2=32), _cfg(4, 2, BM1=16, BN1=64, BM2=64, BN2=16),
                    _cfg(8, 3, BM1=64, BN1=128, BM2=128, BN2=64), _cfg(8, 4, BM1=64, BN1=128, BM2=128, BN2=64),
                    _cfg(8, 2, BM1=64, BN1=128, BM2=128, BN2=64), _cfg(4, 3, BM1=64, BN1=64, BM2=64, BN2=64),
                    _cfg(4, 3, BM1=32, BN1=64, BM2=64, BN2=64), _cfg(8, 3, BM1=32, BN1=64, BM2=64, BN2=32),
                    _cfg(4, 3, BM1=16, BN1=64, BM2=64, BN2=16)]  # fmt: skip
# fp32 (checks, not speed) and the interpreter: one fixed config each, no tuning
FIXED = {"interpret": (dict(BM=16, BN=16), dict(BM1=16, BN1=32, BM2=32, BN2=16)),
         "fp32": (dict(BM=64, BN=32, num_warps=4, num_stages=2),
                  dict(BM1=16, BN1=64, BM2=64, BN2=16, num_warps=4, num_stages=2))}  # fmt: skip


def configs(half: str, HS: int) -> tuple[list[dict], int]:
    """The candidates of one half ("fwd" or "bwd") at head size HS (up to 128), and the index of the default."""
    if HS <= 64:
        return (FWD_CONFIGS, FWD_DEFAULT) if half == "fwd" else (BWD_CONFIGS, 0)
    return (FWD_CONFIGS_D128 if half == "fwd" else BWD_CONFIGS_D128), 0


def _launch(
    half: str, dtype: torch.dtype, T: int, HS: int, launch, tuner: Tuner, bounded: bool = False, variant: str = ""
) -> None:
    """launch(config) for one half under the config of this dtype and (T, hs): fixed in fp32 and the interpreter,
    else the fastest that fits the device, timed once inside the tuning window (on the warm-up step's buffers) and
    cached on disk (tuning.py; the candidates are named by their index in `configs(half, HS)`, the default
    first). variant: a suffix of the key for a kernel variant whose tiles are timed apart (":qkrope")."""
    if INTERPRET or dtype == torch.float32:
        launch(FIXED["interpret" if INTERPRET else "fp32"][half == "bwd"])
        return
    configs_, first = configs(half, HS)
    order = [first, *(i for i in range(len(configs_)) if i != first)]
    candidates = {str(i): (configs_[i],) for i in order}  # named by index; the first is the default
    # a window or documents (bounded), or a variant of the kernel: other tiles may win
    key = f"{T}:{HS}:{dtype}" + (":bounded" if bounded else "") + variant
    tuner.launch(f"attention_{half}", key, candidates, lambda cfg: lambda: launch(cfg))


def _bd(HS: int) -> int:
    return max(16, triton.next_power_of_2(HS))  # tl.dot needs every tile dimension >= 16 on the GPU


def _mask_args(q: torch.Tensor, window: torch.Tensor | None, doc_start: torch.Tensor | None) -> tuple[list, dict]:
    """The kernels' window and document arguments: [win, ds, ds's row stride] (q standing in for what is not given:
    never read) and the constexprs saying which is."""
    ds = doc_start if doc_start is not None else q
    args = [window if window is not None else q, ds, ds.stride(0) if doc_start is not None else 0]
    return args, {"WINDOW": window is not None, "DOC": doc_start is not None}


def attention_forward(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    n_head: int,
    *,
    tuner: Tuner,
    window: torch.Tensor | None = None,
    doc_start: torch.Tensor | None = None,
) -> None:
    """window (1,), doc_start (B,T) int32: the narrower mask (ops/attention.py); doc_start's rows may be strided."""
    B, T, C = q.shape
    HS = C // n_head
    (win, ds, sds), flags = _mask_args(q, window, doc_start)

    def launch(meta: dict) -> None:
        k_attention_fwd[(triton.cdiv(T, meta["BM"]), B * n_head)](
            out,
            lse,
            q,
            k,
            v,
            win,
            ds,
            T,
            C,
            n_head,
            HS,
            sds,
            LOG2E / math.sqrt(HS),
            BD=_bd(HS),
            IEEE=q.dtype == torch.float32,
            **flags,
            **meta,
        )

    _launch("fwd", q.dtype, T, HS, launch, tuner, window is not None or doc_start is not None)


def attention_backward(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    n_head: int,
    *,
    delta: torch.Tensor,
    tuner: Tuner,
    window: torch.Tensor | None = None,
    doc_start: torch.Tensor | None = None,
    qkrope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """delta: fp32 scratch of at least B*NH*T elements; window, doc_start: the forward's. qkrope (rstd (2, B*T, NH),
    rope (2, T', hs/2) fp32): q, k are the qkrope op's outputs and dq, dk come out as the gradients w.r.t. its input
    (ops/attention.py), by the way the warm-up timed fastest for this shape (outside it, untimed, and in the
    interpreter: the first): "fused", qkrope's backward in k_attention_bwd's dq and dk epilogues (head sizes that
    fill their tile, hs == _bd(hs), only); "pass", the kernel without it, then kernels/qkrope.py's pass over dq, dk.
    The fused epilogue rounds each tile's sum to dq's dtype before the qkrope backward, as the pass reads it, and then
    runs the same function (norm_rotate_row_bwd): the interpreter gives the two ways' same bits (tested), but on a GPU
    the sums over a head's lanes follow each kernel's tile layout, so the ways may differ in the last bit there (not
    bit for bit by construction): the step's bits follow the recorded choice, as every tuned way's do."""
    B, T, C = q.shape
    HS = C // n_head
    BMD = 16 if INTERPRET else 64
    k_attention_bwd_delta[(triton.cdiv(T, BMD), B * n_head)](delta, out, dout, T, C, n_head, HS, BM=BMD, BD=_bd(HS))
    (win, ds, sds), flags = _mask_args(q, window, doc_start)
    bounded = window is not None or doc_start is not None
    rstd, rope = qkrope if qkrope is not None else (q, q)  # q stands in for what is not given: never read

    def launch(meta: dict, fused: bool) -> None:
        k_attention_bwd[(triton.cdiv(T, meta["BN1"]) + triton.cdiv(T, meta["BM2"]), B * n_head)](
            dq,
            dk,
            dv,
            q,
            k,
            v,
            dout,
            lse,
            delta,
            win,
            ds,
            rstd,
            rope,
            T,
            C,
            n_head,
            HS,
            sds,
            rope.shape[1] if fused else T,
            T.bit_length(),
            LOG2E / math.sqrt(HS),
            1.0 / math.sqrt(HS),
            BD=_bd(HS),
            IEEE=q.dtype == torch.float32,
            QKROPE=fused,
            **flags,
            **meta,
        )

    def attention(fused: bool) -> None:
        variant = ":qkrope" if fused else ""
        _launch("bwd", q.dtype, T, HS, lambda meta: launch(meta, fused), tuner, bounded, variant)

    if qkrope is None:
        attention(False)
        return
    kqkrope.check_views(n_head, q, k, dq, dk)

    def make(way: str) -> Callable[[], None]:
        if way == "fused":
            return lambda: attention(True)

        def attention_then_pass() -> None:
            attention(False)
            kqkrope.qkrope_backward(dq, dk, q, k, rstd, rope, n_head=n_head)

        return attention_then_pass

    ways = {"fused": ("fused",), "pass": ("pass",)} if _bd(HS) == HS else {"pass": ("pass",)}
    key = f"{T}:{n_head}x{HS}:{q.dtype}" + (":bounded" if bounded else "")
    tuner.launch("attention_qkrope", key, ways, make)


@triton.jit
def k_attention_cached(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    win_ptr,
    ds_ptr,
    t,
    pos,
    sqb,
    sob,
    skb,
    sds,
    C,
    NH,
    HS,
    qk_scale,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
    WINDOW: tl.constexpr,
    DOC: tl.constexpr,
):
    # q, out: (B, t, C) rows (batch strides sqb, sob); k, v: the cache (B, Tmax, C) (batch stride skb); query i
    # sits at position pos + i and sees keys 0 .. pos + i (from its first key where WINDOW or DOC: win (1,) int32,
    # ds (B, t) int32 of row stride sds, the queries' document starts)
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, head = bh // NH, bh % NH
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    qmask = (offs_m < t)[:, None] & (offs_d < HS)[None, :]
    rows = offs_m[:, None].to(tl.int64) * C + head * HS + offs_d[None, :]
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + rows, mask=qmask, other=0.0)
    kv = b.to(tl.int64) * skb + head * HS
    hi = tl.minimum(pos + (pid_m + 1) * BM, pos + t)  # past the last key a query of this block sees
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, BD), dtype=tl.float32)
    lo = 0
    if WINDOW or DOC:
        last = tl.minimum(offs_m, t - 1)  # rows past t (never stored) take the last row's bound
        first = _first_keys(win_ptr, ds_ptr, b.to(tl.int64) * sds + last, pos + last, WINDOW, DOC)
        lo = tl.min(first, axis=0) // BN * BN  # the keys before it: seen by no query of the block
    for start in range(lo, hi, BN):
        cols = start + tl.arange(0, BN)
        kt = tl.load(
            k_ptr + kv + cols[None, :].to(tl.int64) * C + offs_d[:, None],
            mask=(offs_d < HS)[:, None] & (cols < hi)[None, :],
            other=0.0,
        )
        s = _dot(q, kt, IEEE)
        seen = (cols[None, :] <= pos + offs_m[:, None]) & (cols < hi)[None, :]
        if WINDOW or DOC:
            seen = seen & (cols[None, :] >= first[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # causal alone: finite, key 0 is seen by every query
        shift = m_new
        if WINDOW or DOC:  # a row that has seen no key yet: shift by 0 (not -inf), its maximum still -inf
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * qk_scale - shift[:, None])
        alpha = tl.math.exp2(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + kv + cols[:, None].to(tl.int64) * C + offs_d[None, :],
            mask=(cols < hi)[:, None] & (offs_d < HS)[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    tl.store(out_ptr + b.to(tl.int64) * sob + rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)


def attention_forward_cached(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int,
    n_head: int,
    *,
    window: torch.Tensor | None = None,
    doc_start: torch.Tensor | None = None,
) -> None:
    """out (B,t,C) = attention of q (B,t,C) at positions pos .. pos + t - 1 over k_cache, v_cache (B,Tmax,C);
    window (1,), doc_start (B,t) int32 (rows may be strided): the narrower mask (ops/attention.py)."""
    B, t, C = q.shape
    HS = C // n_head
    (win, ds, sds), flags = _mask_args(q, window, doc_start)
    # keys a tile: 64, or 32 where a key row is over 256 bytes (fp32 at head size 128: 140 KiB a block at 64, over
    # sm_86 and sm_89's 99 KiB)
    BM, BN = 16, 16 if INTERPRET else (64 if _bd(HS) * q.element_size() <= 256 else 32)
    k_attention_cached[(triton.cdiv(t, BM), B * n_head)](
        out,
        q,
        k_cache,
        v_cache,
        win,
        ds,
        t,
        pos,
        q.stride(0),
        out.stride(0),
        k_cache.stride(0),
        sds,
        C,
        n_head,
        HS,
        LOG2E / math.sqrt(HS),
        BM=BM,
        BN=BN,
        BD=_bd(HS),
        IEEE=q.dtype == torch.float32,
        **flags,
    )


@triton.jit
def _later(a, b):
    return tl.maximum(a, b)


@triton.jit
def k_doc_starts(out_ptr, tok_ptr, n, so, st, eot, BLOCK: tl.constexpr):
    # out: (B, n) int32 rows of stride so; tok: (B, n) int32 rows of stride st; one program a row, BLOCK positions at
    # a time, the running maximum of the <|endoftext|> positions carried from block to block
    r = tl.program_id(0).to(tl.int64)
    carry = tl.zeros((), tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tok = tl.load(tok_ptr + r * st + offs, mask=offs < n, other=eot + 1)
        at = tl.maximum(tl.associative_scan(tl.where(tok == eot, offs, 0), 0, _later), carry)
        tl.store(out_ptr + r * so + offs, at, mask=offs < n)
        carry = tl.max(at, axis=0)


def doc_starts(out: torch.Tensor, tokens: torch.Tensor, eot: int) -> None:
    """out (B, n) int32 = per row, the position of the last token == eot at or before each position (0 where none):
    each query's document start (ops/attention.py); rows of out and tokens may be strided."""
    B, n = tokens.shape
    k_doc_starts[(B,)](out, tokens, n, out.stride(0), tokens.stride(0), eot, BLOCK=16 if INTERPRET else 1024)
