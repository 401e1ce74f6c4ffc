"""The decode step's position-dependent ops in Triton (ops/decode.py specifies them): b rows, one token each, row i at
position positions[i] of KV-cache row slots[i], both read from device memory so that a captured CUDA graph of the
step serves every position. Shapes: tokens, positions, slots (b,) int32; q, k, v, out (b, C) rows (row strides
given: q, k, v are views of the (3, b, C) projection); caches (B, T, C).

Decode attention is flash-decoding: one query a (row, head) is too little work for a program, so the keys are split
over the sequence. k_decode_attention_split: program (row, head, split s) runs the online softmax over keys s*chunk
.. min((s+1)*chunk, positions[i]+1) and writes its partial row [acc (hs), m, l] (acc unnormalized, m the running
max in base 2 with the scale folded in, l the sum of exp2(score - m)) into the planned fp32 scratch; a split past
the row's length writes nothing. k_decode_attention_combine: program (row, head) reads the row's live splits as
one block and reduces them in a fixed order (tl.max and tl.sum over the same block shape every time): the result
never depends on which program ran first. The number of splits is fixed by (b, T, NH, the device's SM count)
(`split_plan`), not by the rows' positions, which the host does not read, so a captured graph holds one launch
configuration for every step: as many splits as make WAVES programs a multiprocessor (at batch 1, ANDREA-120M on
132 SMs: 16 splits of one 64-key tile each; at batch 32, 3), and one from the batch where the rows and heads alone
make that many. The splits cover the cache's length T: at a short position
the later splits are idle. Scores and sums are fp32 (q, k, v loaded in the compute dtype and widened).
With a window or document starts (ops/decode.py: WINDOW and DOC constexprs, the values read from device memory) a row's
keys begin at its first visible one: the splits wholly before it are idle too, and the combine skips them.
decode_doc_starts is two launches, the token writes and then each row's scan of its cache row, so that a row reads
the tokens the step's other rows of its cache row wrote.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from microgpt.kernels.qkrope import EPS, check_views, launch_config, norm_rotate_row, rope_row, row_offsets
from microgpt.kernels.tuning import INTERPRET

LOG2E = 1.4426950408889634
BN = 16 if INTERPRET else 64  # keys a tile; a split covers a whole number of tiles
WAVES = 8  # programs a multiprocessor the splits aim for: a memory-bound loop wants many warps in flight
MAX_SPLITS = 64  # the combine reads every split of a row as one block


@triton.jit
def k_decode_embedding(out_ptr, tok_ptr, pos_ptr, wte_ptr, wpe_ptr, C, BLOCK_C: tl.constexpr, POS: tl.constexpr):
    # out: (b, C); tok, pos: (b,) int32; wte: (V, C); wpe: (Tmax, C), read (with pos) only with POS
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    tok = tl.load(tok_ptr + n).to(tl.int64)
    e = tl.load(wte_ptr + tok * C + cols, mask=mask).to(tl.float32)
    if POS:
        pos = tl.load(pos_ptr + n).to(tl.int64)
        e += tl.load(wpe_ptr + pos * C + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + n * C + cols, e.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_decode_kv_write(kc_ptr, vc_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, srow, sb, st, C, BLOCK_C: tl.constexpr):
    # k, v: (b, C) rows of stride srow; kc, vc: (B, T, C) of strides (sb, st, 1)
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    dst = tl.load(slot_ptr + n).to(tl.int64) * sb + tl.load(pos_ptr + n).to(tl.int64) * st + cols
    tl.store(kc_ptr + dst, tl.load(k_ptr + n * srow + cols, mask=mask), mask=mask)
    tl.store(vc_ptr + dst, tl.load(v_ptr + n * srow + cols, mask=mask), mask=mask)


@triton.jit
def _first_key(i, n, win_ptr, ds_ptr, WINDOW: tl.constexpr, DOC: tl.constexpr):
    # row i's first visible key: max(0, n - window, doc_start[i]) for its n = positions[i] + 1 keys
    first = n * 0
    if WINDOW:
        first = tl.maximum(first, n - tl.load(win_ptr))
    if DOC:
        first = tl.maximum(first, tl.load(ds_ptr + i))
    return first


@triton.jit
def k_decode_attention_split(
    part_ptr,
    q_ptr,
    kc_ptr,
    vc_ptr,
    pos_ptr,
    slot_ptr,
    win_ptr,
    ds_ptr,
    sq,
    sb,
    st,
    NH,
    HS,
    chunk,
    qk_scale,
    BN: tl.constexpr,
    BD: tl.constexpr,
    WINDOW: tl.constexpr,
    DOC: tl.constexpr,
):
    # part: (b, NH, S, HS + 2) fp32 rows [acc, m, l]; q: (b, C) rows of stride sq; kc, vc: (B, T, C) of strides
    # (sb, st, 1); qk_scale = log2(e) / sqrt(HS); win (1,), ds (b,) int32, read with WINDOW, DOC
    i, h, s = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    n = tl.load(pos_ptr + i) + 1  # keys 0 .. positions[i]
    lo = tl.maximum(s * chunk, _first_key(i, n, win_ptr, ds_ptr, WINDOW, DOC))
    hi = tl.minimum(s * chunk + chunk, n)
    if lo < hi:
        offs_d = tl.arange(0, BD)
        dmask = offs_d < HS
        q = tl.load(q_ptr + i * sq + h * HS + offs_d, mask=dmask, other=0.0).to(tl.float32)
        base = tl.load(slot_ptr + i).to(tl.int64) * sb + h * HS
        m_i = tl.max(tl.full((BN,), float("-inf"), tl.float32), axis=0)
        l_i = tl.sum(tl.zeros((BN,), tl.float32), axis=0)
        acc = tl.zeros((BD,), tl.float32)
        for start in range(lo, hi, BN):
            cols = start + tl.arange(0, BN)
            cmask = cols < hi
            kv = base + cols[:, None].to(tl.int64) * st + offs_d[None, :]
            kmask = cmask[:, None] & dmask[None, :]
            k = tl.load(kc_ptr + kv, mask=kmask, other=0.0).to(tl.float32)
            score = tl.where(cmask, tl.sum(k * q[None, :], axis=1) * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(score, axis=0))  # finite: every tile holds a live key
            p = tl.math.exp2(score - m_new)
            alpha = tl.math.exp2(m_i - m_new)
            v = tl.load(vc_ptr + kv, mask=kmask, other=0.0).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new
        row = part_ptr + ((i * NH + h) * tl.num_programs(2) + s) * (HS + 2)
        tl.store(row + offs_d, acc, mask=dmask)
        tl.store(row + HS, m_i)
        tl.store(row + HS + 1, l_i)


@triton.jit
def k_decode_attention_combine(
    out_ptr,
    part_ptr,
    pos_ptr,
    win_ptr,
    ds_ptr,
    so,
    NH,
    HS,
    chunk,
    S,
    BS: tl.constexpr,
    BD: tl.constexpr,
    WINDOW: tl.constexpr,
    DOC: tl.constexpr,
):
    # out: (b, C) rows of stride so; part: (b, NH, S, HS + 2) fp32, splits first // chunk .. ceil(n / chunk) - 1 live
    i, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    n = tl.load(pos_ptr + i) + 1
    live = tl.cdiv(n, chunk)
    splits = tl.arange(0, BS)
    smask = (splits < live) & (splits >= _first_key(i, n, win_ptr, ds_ptr, WINDOW, DOC) // chunk)
    offs_d = tl.arange(0, BD)
    dmask = offs_d < HS
    rows = part_ptr + ((i * NH + h) * S + splits) * (HS + 2)
    m = tl.load(rows + HS, mask=smask, other=float("-inf"))
    weight = tl.math.exp2(m - tl.max(m, axis=0))  # 0 for the idle splits
    total = tl.sum(tl.load(rows + HS + 1, mask=smask, other=0.0) * weight, axis=0)
    acc = tl.load(rows[:, None] + offs_d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / total
    tl.store(out_ptr + i * so + h * HS + offs_d, out.to(out_ptr.dtype.element_ty), mask=dmask)


def _block_c(C: int) -> int:
    return min(1024, triton.next_power_of_2(C))


def decode_embedding(
    out: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor | None = None
) -> None:
    """out (b,C) = wte[tokens] + wpe[positions] (wpe None: wte[tokens], the modern block's)."""
    b, C = out.shape
    BC = _block_c(C)
    pos = wpe is not None
    k_decode_embedding[(b, triton.cdiv(C, BC))](
        out, tokens, positions, wte, wpe if pos else wte, C, BLOCK_C=BC, POS=pos
    )


def decode_kv_write(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """k_cache, v_cache (B,T,C)[slots[i], positions[i]] = k[i], v[i] (b,C; k and v of one row stride)."""
    b, C = k.shape
    BC = _block_c(C)
    k_decode_kv_write[(b, triton.cdiv(C, BC))](
        k_cache, v_cache, k, v, positions, slots, k.stride(0), k_cache.stride(0), k_cache.stride(1), C, BLOCK_C=BC
    )


def split_plan(b: int, T: int, n_head: int, sm_count: int) -> tuple[int, int]:
    """(splits, keys a split) of decode attention for b rows over a cache of T positions on sm_count
    multiprocessors: as many splits as make b * n_head * splits programs reach WAVES a multiprocessor, at most one
    a tile of BN keys and MAX_SPLITS, at least one; each a whole number of tiles."""
    want = triton.cdiv(WAVES * sm_count, b * n_head)
    splits = max(1, min(want, triton.cdiv(T, BN), MAX_SPLITS))
    chunk = triton.cdiv(triton.cdiv(T, splits), BN) * BN
    return triton.cdiv(T, chunk), chunk


def partials_numel(B: int, T: int, C: int, n_head: int, sm_count: int) -> int:
    """fp32 elements of decode attention's `partials` scratch for any batch of up to B rows (split_plan)."""
    return max(b * n_head * split_plan(b, T, n_head, sm_count)[0] for b in range(1, B + 1)) * (C // n_head + 2)


def decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    n_head: int,
    *,
    partials: torch.Tensor,
    sm_count: int,
    window: torch.Tensor | None = None,
    doc_start: torch.Tensor | None = None,
) -> None:
    """out (b,C) = attention of q (b,C) over positions 0 .. positions[i] of cache rows slots[i] of k_cache, v_cache
    (B,T,C) (from the first key window (1,) and doc_start (b,) leave, where given). partials: fp32 scratch of at
    least partials_numel elements; sm_count: the device's multiprocessors."""
    b, C = q.shape
    T, HS = k_cache.shape[1], C // n_head
    S, chunk = split_plan(b, T, n_head, sm_count)
    BD = triton.next_power_of_2(HS)
    win, ds = (x if x is not None else positions for x in (window, doc_start))  # positions: never read
    flags = {"WINDOW": window is not None, "DOC": doc_start is not None}
    k_decode_attention_split[(b, n_head, S)](
        partials,
        q,
        k_cache,
        v_cache,
        positions,
        slots,
        win,
        ds,
        q.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        n_head,
        HS,
        chunk,
        LOG2E / math.sqrt(HS),
        BN=BN,
        BD=BD,
        num_warps=4,
        **flags,
    )
    BS = triton.next_power_of_2(S)
    k_decode_attention_combine[(b, n_head)](
        out, partials, positions, win, ds, out.stride(0), n_head, HS, chunk, S, BS=BS, BD=BD, num_warps=1, **flags
    )


@triton.jit
def k_decode_qkrope(q_ptr, k_ptr, pos_ptr, rope_ptr, sq, sk, H, D, T, eps, BH: tl.constexpr, BD2: tl.constexpr):
    # q, k: (b, C) rows of strides sq, sk, rewritten; pos: (b,) int32; rope: (2, T, D/2) fp32. k_qkrope_fwd's row
    # function on the same tile: one row here is that forward at its position bit for bit
    i = tl.program_id(0).to(tl.int64)
    off, mask = row_offsets(H, D, BH, BD2)
    half = D // 2
    c, s = rope_row(rope_ptr, tl.load(pos_ptr + i).to(tl.int64), D, T, BD2)
    for which in tl.static_range(2):
        if which == 0:
            row = q_ptr + i * sq
        else:
            row = k_ptr + i * sk
        x1 = tl.load(row + off, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(row + half + off, mask=mask, other=0.0).to(tl.float32)
        y1, y2, _ = norm_rotate_row(x1, x2, c, s, D, eps)
        tl.store(row + off, y1.to(row.dtype.element_ty), mask=mask)
        tl.store(row + half + off, y2.to(row.dtype.element_ty), mask=mask)


def decode_qkrope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor, *, n_head: int
) -> None:
    """q, k (b,C) <- rope(rmsnorm_head(.)) in place, row i at position positions[i] (b,) int32; rope (2, T, D/2)
    fp32."""
    b = q.shape[0]
    D = check_views(n_head, q, k)
    k_decode_qkrope[(b,)](
        q, k, positions, rope, q.stride(0), k.stride(0), n_head, D, rope.shape[1], EPS, **launch_config(n_head, D)
    )


@triton.jit
def k_decode_tok_write(tc_ptr, tok_ptr, pos_ptr, slot_ptr, stc):
    # tc: (B, T) int32 rows of stride stc; tok, pos, slot: (b,) int32
    i = tl.program_id(0).to(tl.int64)
    at = tl.load(slot_ptr + i).to(tl.int64) * stc + tl.load(pos_ptr + i)
    tl.store(tc_ptr + at, tl.load(tok_ptr + i))


@triton.jit
def k_decode_doc_start(doc_ptr, tc_ptr, pos_ptr, slot_ptr, stc, eot, BLOCK: tl.constexpr):
    # doc: (b,) int32 = the last position <= positions[i] of cache row slots[i] holding eot (0 where none)
    i = tl.program_id(0).to(tl.int64)
    n = tl.load(pos_ptr + i) + 1
    row = tc_ptr + tl.load(slot_ptr + i).to(tl.int64) * stc
    last = n * 0
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tok = tl.load(row + offs, mask=offs < n, other=eot + 1)
        last = tl.maximum(last, tl.max(tl.where(tok == eot, offs, 0), axis=0))
    tl.store(doc_ptr + i, last)


def decode_doc_starts(
    doc: torch.Tensor,
    tok_cache: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    eot: int,
) -> None:
    """tok_cache (B,T)[slots[i], positions[i]] = tokens[i] for every row, then doc (b,) int32 = each row's document
    start over positions 0 .. positions[i] of its cache row (ops/decode.py)."""
    b = tokens.shape[0]
    k_decode_tok_write[(b,)](tok_cache, tokens, positions, slots, tok_cache.stride(0))
    k_decode_doc_start[(b,)](doc, tok_cache, positions, slots, tok_cache.stride(0), eot, BLOCK=16 if INTERPRET else 256)
