"""Causal self-attention, flash style. q, k, v, out: (B,T,C) with heads interleaved as (B,T,NH,hs); lse (B,NH,T) fp32.

Forward keeps only out and the row log-sum-exp lse = log(sum_j exp(q.k_j / sqrt(hs))) (natural log): never a
TxT matrix in memory. Backward recomputes P = exp(S - lse) tile by tile:
    delta = rowsum(dout * out)                      (k_attention_bwd_delta, into a (B,NH,T) fp32 scratch)
    dv += P.T @ dout ; dk += dS.T @ q * scale       (programs owning a K/V block, looping over q blocks)
    dq += dS @ k * scale, dS = P * (dout @ v.T - delta)   (programs owning a q block, looping over K/V blocks)
Both halves run in one launch and each output tile has one owner: no atomics, deterministic.
Exponentials run in base 2 with the scale folded in (exp2 is the native instruction).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from microgpt.kernels import tuning

LOG2E = 1.4426950408889634


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
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    dmask = offs_d < HS
    q = tl.load(q_ptr + base + offs_m[:, None] * C + offs_d[None, :], mask=(offs_m < T)[:, None] & dmask[None, :],
                other=0.0)  # fmt: skip
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, BD), dtype=tl.float32)
    diag = pid_m * BM  # K/V blocks before this are entirely visible to every row of the tile
    hi = tl.minimum(diag + BM, T)
    for start_n in range(0, hi, BN):
        cols = start_n + offs_n
        kt = tl.load(k_ptr + base + cols[None, :] * C + offs_d[:, None], mask=dmask[:, None] & (cols < T)[None, :],
                     other=0.0)  # fmt: skip
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, kt) * qk_scale
        if start_n + BN > diag:  # only the diagonal tiles need the causal mask
            s = tl.where((offs_m[:, None] >= cols[None, :]) & (cols < T)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + base + cols[:, None] * C + offs_d[None, :], mask=(cols < T)[:, None] & dmask[None, :],
                    other=0.0)  # fmt: skip
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = acc / l_i[:, None]
    mmask = offs_m < T
    tl.store(out_ptr + base + offs_m[:, None] * C + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & dmask[None, :])  # fmt: skip
    tl.store(lse_ptr + bh.to(tl.int64) * T + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=mmask)


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
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _bwd_dkdv(
    dk_ptr,
    dv_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    dout_ptr,
    lse_ptr,
    delta_ptr,
    base,
    row_base,
    start_n,
    T,
    C,
    HS,
    qk_scale,
    sm_scale,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    kv_mask = (offs_n < T)[:, None] & (offs_d < HS)[None, :]
    kv_off = base + offs_n[:, None] * C + offs_d[None, :]
    k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
    dk = tl.zeros((BN, BD), dtype=tl.float32)
    dv = tl.zeros((BN, BD), dtype=tl.float32)
    for start_m in range(start_n, T, BM):  # q rows before start_n never see this block
        offs_m = start_m + tl.arange(0, BM)
        mmask = offs_m < T
        qt = tl.load(q_ptr + base + offs_m[None, :] * C + offs_d[:, None], mask=(offs_d < HS)[:, None] & mmask[None, :],
                     other=0.0)  # fmt: skip
        do = tl.load(dout_ptr + base + offs_m[:, None] * C + offs_d[None, :],
                     mask=mmask[:, None] & (offs_d < HS)[None, :], other=0.0)  # fmt: skip
        lse = tl.load(lse_ptr + row_base + offs_m, mask=mmask, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_ptr + row_base + offs_m, mask=mmask, other=0.0)
        pt = tl.math.exp2(_dot(k, qt, IEEE) * qk_scale - lse[None, :])  # (BN, BM) = P.T
        pt = tl.where((offs_m[None, :] >= offs_n[:, None]) & mmask[None, :], pt, 0.0)
        dv += _dot(pt.to(do.dtype), do, IEEE)
        dpt = _dot(v, tl.trans(do), IEEE)
        dst = pt * (dpt - delta[None, :])
        dk += _dot(dst.to(qt.dtype), tl.trans(qt), IEEE)
    dk_old = tl.load(dk_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
    dv_old = tl.load(dv_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
    tl.store(dk_ptr + kv_off, (dk_old + dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + kv_off, (dv_old + dv).to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq(
    dq_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    dout_ptr,
    lse_ptr,
    delta_ptr,
    base,
    row_base,
    start_m,
    T,
    C,
    HS,
    qk_scale,
    sm_scale,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
):
    offs_m = start_m + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    mmask = offs_m < T
    q_mask = mmask[:, None] & (offs_d < HS)[None, :]
    q_off = base + offs_m[:, None] * C + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    do = tl.load(dout_ptr + q_off, mask=q_mask, other=0.0)
    lse = tl.load(lse_ptr + row_base + offs_m, mask=mmask, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + row_base + offs_m, mask=mmask, other=0.0)
    dq = tl.zeros((BM, BD), dtype=tl.float32)
    for start_n in range(0, tl.minimum(start_m + BM, T), BN):
        offs_n = start_n + tl.arange(0, BN)
        kv_mask = (offs_d < HS)[:, None] & (offs_n < T)[None, :]
        kt = tl.load(k_ptr + base + offs_n[None, :] * C + offs_d[:, None], mask=kv_mask, other=0.0)
        vt = tl.load(v_ptr + base + offs_n[None, :] * C + offs_d[:, None], mask=kv_mask, other=0.0)
        p = tl.math.exp2(_dot(q, kt, IEEE) * qk_scale - lse[:, None])
        p = tl.where((offs_m[:, None] >= offs_n[None, :]) & (offs_n < T)[None, :], p, 0.0)
        ds = p * (_dot(do, vt, IEEE) - delta[:, None])
        dq += _dot(ds.to(kt.dtype), tl.trans(kt), IEEE)
    dq_old = tl.load(dq_ptr + q_off, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(dq_ptr + q_off, (dq_old + dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=q_mask)


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
    n_kv_blocks,
    BM1: tl.constexpr,
    BN1: tl.constexpr,
    BM2: tl.constexpr,
    BN2: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
):
    # dq, dk, dv, q, k, v, dout: (B, T, C); lse, delta: (B, NH, T) fp32
    # programs [0, n_kv_blocks) own dk/dv blocks, the rest own dq blocks
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    base = (bh // NH).to(tl.int64) * T * C + (bh % NH) * HS
    row_base = bh.to(tl.int64) * T
    if pid < n_kv_blocks:
        _bwd_dkdv(dk_ptr, dv_ptr, q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, base, row_base, pid * BN1, T, C,
                  HS, qk_scale, sm_scale, BM1, BN1, BD, IEEE)  # fmt: skip
    else:
        _bwd_dq(dq_ptr, q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, base, row_base, (pid - n_kv_blocks) * BM2,
                T, C, HS, qk_scale, sm_scale, BM2, BN2, BD, IEEE)  # fmt: skip


def _bd(HS: int) -> int:
    return max(16, triton.next_power_of_2(HS))  # tl.dot needs every tile dimension >= 16 on the GPU


def _fwd_config(dtype: torch.dtype) -> dict:
    if tuning.INTERPRET:
        return dict(BM=16, BN=16)
    if dtype == torch.float32:
        return dict(BM=64, BN=32, num_warps=4, num_stages=2)
    return dict(BM=128, BN=64, num_warps=4, num_stages=3)


def _bwd_config(dtype: torch.dtype) -> dict:
    if tuning.INTERPRET:
        return dict(BM1=16, BN1=32, BM2=32, BN2=16)
    if dtype == torch.float32:
        return dict(BM1=16, BN1=64, BM2=64, BN2=16, num_warps=4, num_stages=2)
    return dict(BM1=32, BN1=128, BM2=128, BN2=32, num_warps=4, num_stages=3)


def attention_forward(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      n_head: int) -> None:  # fmt: skip
    B, T, C = q.shape
    HS = C // n_head
    cfg = _fwd_config(q.dtype)
    grid = (triton.cdiv(T, cfg["BM"]), B * n_head)
    k_attention_fwd[grid](out, lse, q, k, v, T, C, n_head, HS, LOG2E / math.sqrt(HS),
                          BD=_bd(HS), IEEE=q.dtype == torch.float32, **cfg)  # fmt: skip


def attention_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dout: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, n_head: int, *,
                       delta: torch.Tensor) -> None:  # fmt: skip
    """delta: fp32 scratch of at least B*NH*T elements."""
    B, T, C = q.shape
    HS = C // n_head
    BD = _bd(HS)
    BMD = 16 if tuning.INTERPRET else 64
    k_attention_bwd_delta[(triton.cdiv(T, BMD), B * n_head)](delta, out, dout, T, C, n_head, HS, BM=BMD, BD=BD)
    cfg = _bwd_config(q.dtype)
    n_kv = triton.cdiv(T, cfg["BN1"])
    grid = (n_kv + triton.cdiv(T, cfg["BM2"]), B * n_head)
    k_attention_bwd[grid](dq, dk, dv, q, k, v, dout, lse, delta, T, C, n_head, HS, LOG2E / math.sqrt(HS),
                          1.0 / math.sqrt(HS), n_kv, BD=BD, IEEE=q.dtype == torch.float32, **cfg)  # fmt: skip
