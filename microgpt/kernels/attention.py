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

attention_forward_cached is the inference step's (microgpt/engine/model.py gpt_infer, ops/attention.py says what it
computes): queries at positions pos .. pos + t - 1 against the KV cache's keys and values of positions 0 .. pos +
t - 1, one program per (sequence, head, block of queries) over the cached keys with the same online softmax. It is
the plain first version: a decode step (t = 1) fills one row of its 16-row tile and does not split the keys over
programs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

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
    MASK: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
):
    offs_d = tl.arange(0, BD)
    dmask = offs_d < HS
    for start_n in range(lo, hi, BN):
        cols = start_n + tl.arange(0, BN)
        kt = tl.load(
            k_ptr + base + cols[None, :] * C + offs_d[:, None], mask=dmask[:, None] & (cols < T)[None, :], other=0.0
        )
        s = _dot(q, kt, IEEE)
        if MASK:
            s = tl.where((offs_m[:, None] >= cols[None, :]) & (cols < T)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])  # the scale and the shift as one FMA per score
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + base + cols[:, None] * C + offs_d[None, :], mask=(cols < T)[:, None] & dmask[None, :], other=0.0
        )
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def k_attention_fwd(
    out_ptr,
    lse_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    T,
    C,
    NH,
    HS,
    qk_scale,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
):
    # out, q, k, v: (B, T, C) head h at columns [h*HS, (h+1)*HS); lse: (B, NH, T) fp32; qk_scale = log2(e)/sqrt(HS)
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
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_ptr, v_ptr, base, offs_m, 0, diag, T, C, HS, qk_scale, False, BN, BD, IEEE
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
        True,
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
    MASK: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
):
    # rows >= T load as zeros (q, dout, lse, delta): their terms vanish without a mask
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
            pt = tl.where((offs_m[None, :] >= offs_n[:, None]) & mmask[None, :], pt, 0.0)
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
    MASK: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
):
    offs_d = tl.arange(0, BD)
    for start_n in range(lo, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        kv_mask = (offs_d < HS)[:, None] & (offs_n < T)[None, :]
        kt = tl.load(k_ptr + base + offs_n[None, :] * C + offs_d[:, None], mask=kv_mask, other=0.0)
        vt = tl.load(v_ptr + base + offs_n[None, :] * C + offs_d[:, None], mask=kv_mask, other=0.0)
        p = tl.math.exp2(_dot(q, kt, IEEE) * qk_scale - lse[:, None])
        if MASK:
            p = tl.where((offs_m[:, None] >= offs_n[None, :]) & (offs_n < T)[None, :], p, 0.0)
        ds = p * (_dot(do, vt, IEEE) - delta[:, None])
        dq += _dot(ds.to(kt.dtype), tl.trans(kt), IEEE)
    return dq


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
    T,
    C,
    NH,
    HS,
    qk_scale,
    sm_scale,
    BM1: tl.constexpr,
    BN1: tl.constexpr,
    BM2: tl.constexpr,
    BN2: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
):
    # dq, dk, dv, q, k, v, dout: (B, T, C); lse, delta: (B, NH, T) fp32
    # programs [0, cdiv(T, BN1)) own dk/dv tiles, the rest own dq tiles; BN1 % BM1 == 0 and BM2 % BN2 == 0
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    base = (bh // NH).to(tl.int64) * T * C + (bh % NH) * HS
    row_base = bh.to(tl.int64) * T
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
            True,
            BM1,
            BD,
            IEEE,
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
            T,
            T,
            C,
            HS,
            qk_scale,
            False,
            BM1,
            BD,
            IEEE,
        )
        tl.store(dk_ptr + kv_off, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
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
        dq = _dq_tiles(
            dq, q, do, lse, delta, k_ptr, v_ptr, base, offs_m, 0, start_m, T, C, HS, qk_scale, False, BN2, BD, IEEE
        )
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
            True,
            BN2,
            BD,
            IEEE,
        )
        tl.store(dq_ptr + q_off, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=q_mask)


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


def _launch(half: str, dtype: torch.dtype, T: int, HS: int, launch, tuner: Tuner) -> None:
    """launch(config) for one half under the config of this dtype and (T, hs): fixed in fp32 and the interpreter,
    else the fastest that fits the device, timed once inside the tuning window (on the warm-up step's buffers) and
    cached on disk (tuning.py; the candidates are named by their index in `configs(half, HS)`, the default
    first)."""
    if INTERPRET or dtype == torch.float32:
        launch(FIXED["interpret" if INTERPRET else "fp32"][half == "bwd"])
        return
    configs_, first = configs(half, HS)
    order = [first, *(i for i in range(len(configs_)) if i != first)]
    candidates = {str(i): (configs_[i],) for i in order}  # named by index; the first is the default
    tuner.launch(f"attention_{half}", f"{T}:{HS}:{dtype}", candidates, lambda cfg: lambda: launch(cfg))


def _bd(HS: int) -> int:
    return max(16, triton.next_power_of_2(HS))  # tl.dot needs every tile dimension >= 16 on the GPU


def attention_forward(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    n_head: int,
    *,
    tuner: Tuner,
) -> None:
    B, T, C = q.shape
    HS = C // n_head

    def launch(meta: dict) -> None:
        k_attention_fwd[(triton.cdiv(T, meta["BM"]), B * n_head)](
            out,
            lse,
            q,
            k,
            v,
            T,
            C,
            n_head,
            HS,
            LOG2E / math.sqrt(HS),
            BD=_bd(HS),
            IEEE=q.dtype == torch.float32,
            **meta,
        )

    _launch("fwd", q.dtype, T, HS, launch, tuner)


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
) -> None:
    """delta: fp32 scratch of at least B*NH*T elements."""
    B, T, C = q.shape
    HS = C // n_head
    BMD = 16 if INTERPRET else 64
    k_attention_bwd_delta[(triton.cdiv(T, BMD), B * n_head)](delta, out, dout, T, C, n_head, HS, BM=BMD, BD=_bd(HS))

    def launch(meta: dict) -> None:
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
            T,
            C,
            n_head,
            HS,
            LOG2E / math.sqrt(HS),
            1.0 / math.sqrt(HS),
            BD=_bd(HS),
            IEEE=q.dtype == torch.float32,
            **meta,
        )

    _launch("bwd", q.dtype, T, HS, launch, tuner)


@triton.jit
def k_attention_cached(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    t,
    pos,
    sqb,
    sob,
    skb,
    C,
    NH,
    HS,
    qk_scale,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
):
    # q, out: (B, t, C) rows (batch strides sqb, sob); k, v: the cache (B, Tmax, C) (batch stride skb); query i
    # sits at position pos + i and sees keys 0 .. pos + i
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
    for start in range(0, hi, BN):
        cols = start + tl.arange(0, BN)
        kt = tl.load(
            k_ptr + kv + cols[None, :].to(tl.int64) * C + offs_d[:, None],
            mask=(offs_d < HS)[:, None] & (cols < hi)[None, :],
            other=0.0,
        )
        s = _dot(q, kt, IEEE)
        s = tl.where((cols[None, :] <= pos + offs_m[:, None]) & (cols < hi)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # finite: key 0 is seen by every query
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
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
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int, n_head: int
) -> None:
    """out (B,t,C) = attention of q (B,t,C) at positions pos .. pos + t - 1 over k_cache, v_cache (B,Tmax,C)."""
    B, t, C = q.shape
    HS = C // n_head
    # keys a tile: 64, or 32 where a key row is over 256 bytes (fp32 at head size 128: 140 KiB a block at 64, over
    # sm_86 and sm_89's 99 KiB)
    BM, BN = 16, 16 if INTERPRET else (64 if _bd(HS) * q.element_size() <= 256 else 32)
    k_attention_cached[(triton.cdiv(t, BM), B * n_head)](
        out,
        q,
        k_cache,
        v_cache,
        t,
        pos,
        q.stride(0),
        out.stride(0),
        k_cache.stride(0),
        C,
        n_head,
        HS,
        LOG2E / math.sqrt(HS),
        BM=BM,
        BN=BN,
        BD=_bd(HS),
        IEEE=q.dtype == torch.float32,
    )
