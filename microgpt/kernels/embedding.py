"""Token + position embedding: out(B,T,C) = wte[tokens] + wpe[:T], or wte[tokens] without a position table (wpe None:
the modern block's; a constexpr POS drops the table from both kernels, so GPT-2's compile as before).
embedding_add_forward is the forward kernel with a constexpr ADD (out += table[tokens]: the value embeddings); its
backward is embedding_backward without wpe.

Backward: dwpe[t] += sum_b dout[b,t] (not without wpe); dwte[v] += sum of dout rows whose token is v. The scatter-add is
deterministic without float atomics: k_embedding_sort ranks the unique keys (token, position) into `order`
(a stable counting sort done as an all-pairs rank, no V-sized scratch and no atomics), so equal tokens sit side
by side in position order; then one program per run of equal tokens sums its rows in that fixed order and adds
the sum to dwte once. The rank is taken within chunks of CHUNK tokens (whole sequences), all chunks in one
launch, so the sort costs O(N * CHUNK) compares instead of O(N^2), which keeps it a small part of backward at large
micro-batches (bench/RESULTS.md has its history); each pair is one compare, on the key token * S + position. The
scatter
then runs chunk after chunk (one launch each, stream-ordered, so two chunks never update one dwte row at once),
adding each chunk's per-token sums in chunk order: deterministic, and for N <= CHUNK the same sums as one sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microgpt.kernels.tuning import INTERPRET, Tuner


@triton.jit
def k_embedding_fwd(
    out_ptr, tok_ptr, wte_ptr, wpe_ptr, T, C, BLOCK_C: tl.constexpr, POS: tl.constexpr, ADD: tl.constexpr
):
    # out: (N, C); tok: (N,) int32; wte: (V, C); wpe: (Tmax, C), read only with POS; ADD: out += the rows
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    tok = tl.load(tok_ptr + n).to(tl.int64)
    e = tl.load(wte_ptr + tok * C + cols, mask=mask).to(tl.float32)
    if POS:
        e += tl.load(wpe_ptr + (n % T) * C + cols, mask=mask).to(tl.float32)
    if ADD:
        e += tl.load(out_ptr + n * C + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + n * C + cols, e.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_embedding_sort(order_ptr, tok_ptr, N, S, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, WIDE: tl.constexpr):
    # order, tok: (N,) int32; program (i, c) ranks its BLOCK_I keys among the S tokens of chunk c:
    # order[c*S + rank of (tok[c*S + i], i) in chunk c] = i (chunk-relative). The key tok * S + i is unique and
    # orders by token, then position: one compare a pair (int64 where V * S may pass 2^31: WIDE)
    lo = tl.program_id(1).to(tl.int64) * S
    n = tl.minimum(S, N - lo)
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    ki = tl.load(tok_ptr + lo + i, mask=i < n, other=0)
    ki = (ki.to(tl.int64) if WIDE else ki) * S + i
    rank = tl.zeros((BLOCK_I,), dtype=tl.int32)
    for j0 in range(0, n, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        kj = tl.load(tok_ptr + lo + j, mask=j < n, other=0)
        kj = tl.where(j < n, (kj.to(tl.int64) if WIDE else kj) * S + j, 2**62 if WIDE else 2**31 - 1)  # past n: last
        rank += tl.sum((kj[None, :] < ki[:, None]).to(tl.int32), axis=1)
    tl.store(order_ptr + lo + rank, i, mask=i < n)


@triton.jit
def k_embedding_bwd(
    dwte_ptr,
    dwpe_ptr,
    dout_ptr,
    tok_ptr,
    order_ptr,
    N,
    T,
    C,
    BLOCK_C: tl.constexpr,
    SEG: tl.constexpr,
    POS: tl.constexpr,
):
    # one chunk of N tokens (dout, tok, order point at it; order chunk-relative)
    # programs [0, N): runs of equal tokens in `order` -> dwte rows; with POS, programs [N, N+T): dwpe rows
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    if pid < N:
        tok = tl.load(tok_ptr + tl.load(order_ptr + pid))
        prev = tl.load(tok_ptr + tl.load(order_ptr + tl.maximum(pid - 1, 0)))
        if (pid == 0) | (prev != tok):  # this program starts a run
            acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
            j = pid
            more = pid >= 0  # a tensor bool: loop-carried types must not change
            while more:
                js = j + tl.arange(0, SEG)
                rows = tl.load(order_ptr + js, mask=js < N, other=0)
                same = (js < N) & (tl.load(tok_ptr + rows, mask=js < N, other=-1) == tok)
                d = tl.load(
                    dout_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :],
                    mask=same[:, None] & cmask[None, :],
                    other=0.0,
                )
                acc += tl.sum(d.to(tl.float32), axis=0)
                more = tl.sum(same.to(tl.int32), axis=0) == SEG
                j += SEG
            ptr = dwte_ptr + tok.to(tl.int64) * C + cols
            tl.store(ptr, (tl.load(ptr, mask=cmask).to(tl.float32) + acc).to(dwte_ptr.dtype.element_ty), mask=cmask)
    elif POS:
        t = pid - N
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for b in range(0, N // T):
            acc += tl.load(dout_ptr + (b * T + t).to(tl.int64) * C + cols, mask=cmask).to(tl.float32)
        ptr = dwpe_ptr + t * C + cols
        tl.store(ptr, (tl.load(ptr, mask=cmask).to(tl.float32) + acc).to(dwpe_ptr.dtype.element_ty), mask=cmask)


def _block_c(C: int) -> int:
    return min(1024, triton.next_power_of_2(C))


def embedding_forward(
    out: torch.Tensor, tokens: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor | None = None
) -> None:
    """out (B,T,C); tokens (B,T) int32; wte (V,C); wpe (Tmax,C) or None (no position table)."""
    T, C = tokens.shape[-1], wte.shape[1]
    N = tokens.numel()
    BC = _block_c(C)
    pos = wpe is not None
    k_embedding_fwd[(N, triton.cdiv(C, BC))](
        out, tokens, wte, wpe if pos else wte, T, C, BLOCK_C=BC, POS=pos, ADD=False
    )


def embedding_add_forward(out: torch.Tensor, tokens: torch.Tensor, table: torch.Tensor) -> None:
    """out (N,C) or (B,T,C), contiguous, += table[tokens]; tokens N int32 ids (any shape); table (V,C)."""
    C, N = table.shape[1], tokens.numel()
    BC = _block_c(C)
    k_embedding_fwd[(N, triton.cdiv(C, BC))](out, tokens, table, table, 1, C, BLOCK_C=BC, POS=False, ADD=True)


CHUNK = 8192  # tokens per sort chunk (rounded down to whole sequences): the sort is O(N * CHUNK)
# The sort's launch configurations (keys a program, keys a step of its loop, warps), timed once per GPU and shape
# in the warm-up (tuning.launch): each gives the same order (a rank is exact). The first is the default outside the
# warm-up; the interpreter pays per program, so it takes few, small ones.
if INTERPRET:
    SORT_CONFIGS = {"i16j16w1": (16, 16, 1)}
else:
    SORT_CONFIGS = {
        "i64j256w4": (64, 256, 4),
        "i32j256w4": (32, 256, 4),
        "i16j256w4": (16, 256, 4),
        "i16j512w4": (16, 512, 4),
        "i32j512w8": (32, 512, 8),
        "i8j512w4": (8, 512, 4),
        "i16j128w2": (16, 128, 2),
    }


def sort_tokens(order: torch.Tensor, tok: torch.Tensor, S: int, vocab: int, tuner: Tuner) -> None:
    """order[c*S : (c+1)*S] = the stable order of chunk c of tok (N,) int32 by token, chunk-relative indices."""
    N, wide = tok.numel(), vocab * S >= 2**31 - S

    def sort(bi: int, bj: int, warps: int):
        grid = (triton.cdiv(min(S, N), bi), triton.cdiv(N, S))
        return lambda: k_embedding_sort[grid](order, tok, N, S, BLOCK_I=bi, BLOCK_J=bj, WIDE=wide, num_warps=warps)

    tuner.launch("embedding_sort", f"{N}:{S}:w{int(wide)}", SORT_CONFIGS, sort)


def embedding_backward(
    dwte: torch.Tensor,
    dwpe: torch.Tensor | None,
    dout: torch.Tensor,
    tokens: torch.Tensor,
    *,
    sorted_before: bool = False,
    order: torch.Tensor,
    tuner: Tuner,
    chunk: int = CHUNK,
) -> None:
    """order: int32 scratch of at least N = B*T elements; dwpe None: no position table (no dwpe programs).
    sorted_before: an earlier call scattered the same tokens into a table of as many rows, so `order` holds their
    sort already (the value embeddings' backwards and the embedding's, one micro-batch: one sort)."""
    T, C = tokens.shape[-1], dwte.shape[1]
    N = tokens.numel()
    S = T * max(1, chunk // T)
    tok, d = tokens.reshape(N), dout.reshape(N, C)
    if not sorted_before:
        sort_tokens(order, tok, S, dwte.shape[0], tuner)
    # whole rows per program (C <= 1024): the scatter is latency-bound (order -> token -> row loads per run,
    # and runs are short: one token each on random data), so fewer, wider programs finish in fewer waves
    BC = _block_c(C)
    pos = dwpe is not None
    for n0 in range(0, N, S):
        n = min(S, N - n0)
        k_embedding_bwd[(n + T * pos, triton.cdiv(C, BC))](
            dwte, dwpe if pos else dwte, d[n0:], tok[n0:], order[n0:], n, T, C, BLOCK_C=BC, SEG=4, POS=pos, num_warps=4
        )
