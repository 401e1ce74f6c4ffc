"""Cross-entropy fused with the LM head: logits = x @ wte.T, R rows at a time through the caller's (R,V) scratch, and
optionally soft-capped: logits = softcap * tanh(z / softcap) (ops/crossentropy.py gives the math).

x:(N,C), wte:(V,C), targets:(N,) int32 (< 0 ignored: loss 0, no gradient), losses, lse, dlosses: (N,) fp32.
Forward per chunk: logits = x_r @ wte.T (GEMM), then k_crossentropy_fwd: one program per row, an online
max/sum over V in blocks (capped logits: a sum against the cap, their bound) gives lse and loss = lse -
logit[target]. Only lse (4 bytes a row) is saved.
Backward per chunk recomputes the logits (one GEMM: cheaper in memory than keeping (N,V)), k_crossentropy_bwd
turns them in place into dlogits = (softmax - onehot) * dloss, then dx_r += dlogits @ wte; dwte += dlogits.T @ x_r.
Training calls crossentropy_forward_backward instead (microgpt.ops.crossentropy says why): per chunk one logits
GEMM, k_crossentropy_fwd with GRAD (lse and loss, then a second pass over the row writes dlogits in place), and
the two gradient GEMMs: the recomputing GEMM is gone, and every value equals the two-call path bit for bit.
The logits GEMM and the two gradient GEMMs are the precision's Matmul `mm` (microgpt/engine/precision.py: fp8 runs the
logits GEMM on E4M3 operands, x cast at its own amax, and the gradient GEMMs on the compute copy); the row kernel's
launch configuration is the runtime's tuner's choice (`tuner`).
The soft-cap is applied where the row kernels load the chunk's logits (the scratch keeps the GEMM's z until a lane
overwrites it with its own gradient), as a constexpr SOFTCAP: at 0 (GPT-2) the kernels compile as they did without it.
The gradient pass recomputes tanh(z / softcap) from z and multiplies by its slope 1 - tanh^2: nothing more is stored.
z / softcap is taken as z times the constant 1 / softcap: one division an element fewer for the multi-function
unit, which the capped rows' exponentials and tanh's division already keep busy; it rounds apart from NumPy's
z / softcap by at most an ulp, inside the pair's tolerance.
head_logits caps its logits in place after the GEMM (k_crossentropy_softcap, one elementwise pass).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import triton
import triton.language as tl

from microgpt.kernels.gelu import tanh
from microgpt.kernels.linear import Matmul
from microgpt.kernels.tuning import INTERPRET, Tuner


@triton.jit
def _load_logits(ptr, cols, V, SOFTCAP: tl.constexpr):
    # a block of one row's logits in fp32, capped where SOFTCAP; -inf past V
    x = tl.load(ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    if SOFTCAP > 0:
        x = tl.where(cols < V, SOFTCAP * tanh(x * (1.0 / SOFTCAP)), float("-inf"))
    return x


@triton.jit
def _dlogits_row(ptr, lse, tgt, dloss, V, BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr):
    # one row of logits at ptr, in place -> (softmax - onehot(tgt)) * dloss, times the cap's slope where SOFTCAP
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
        if SOFTCAP > 0:
            t = tanh(x * (1.0 / SOFTCAP))
            g = (tl.exp(SOFTCAP * t - lse) - tl.where(cols == tgt, 1.0, 0.0)) * dloss * (1.0 - t * t)
        else:
            g = (tl.exp(x - lse) - tl.where(cols == tgt, 1.0, 0.0)) * dloss
        tl.store(ptr + cols, g.to(ptr.dtype.element_ty), mask=cols < V)


@triton.jit
def capped_sum(ptr, tgt, V, BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr):
    # one row's lse and (in the target's lane) its capped target logit, for SOFTCAP <= CAP_MAX_LIMIT: a capped logit
    # lies in [-SOFTCAP, SOFTCAP], so SOFTCAP bounds the row's max and each lane sums exp(x - SOFTCAP) as it loads
    # (one exponential an element, each term in [exp(-2 SOFTCAP), 1]: a normal fp32 under the limit), and the lanes
    # meet once, at the end: no max to reduce across the program block by block
    s = tl.zeros((BLOCK_V,), dtype=tl.float32)
    picked = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = _load_logits(ptr, cols, V, SOFTCAP)  # -inf past V: exp gives 0
        picked = tl.where(cols == tgt, x, picked)
        s += tl.exp(x - SOFTCAP)
    return SOFTCAP + tl.log(tl.sum(s, axis=0)), picked


@triton.jit
def k_crossentropy_fwd(
    loss_ptr,
    lse_ptr,
    logits_ptr,
    tgt_ptr,
    dloss_ptr,
    V,
    GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PER_BLOCK: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
    CAP_MAX: tl.constexpr = False,
):
    # loss, lse, tgt, dloss: (r,) for this chunk; logits: (r, V), with GRAD turned into dlogits in place; SOFTCAP > 0:
    # the logits are capped as they are loaded.
    # The online max is kept per lane (two exponentials an element) or, PER_BLOCK, per block of BLOCK_V (one
    # exponential an element and two a block); the two sum in another order. CAP_MAX (a cap of at most
    # CAP_MAX_LIMIT): no running max at all, SOFTCAP is the row's bound (capped_sum).
    # The target's logit is picked out of the blocks the sums load (a lane keeps it where its column is the
    # target): a load of its own after them would race with GRAD's in-place stores, which another warp may already
    # be making past the last reduction (it read a dlogit now and then: a loss that did not repeat, issue 35).
    row = tl.program_id(0).to(tl.int64)
    ptr = logits_ptr + row * V
    tgt = tl.load(tgt_ptr + row)
    if CAP_MAX:
        lse, picked = capped_sum(ptr, tgt, V, BLOCK_V, SOFTCAP)
    elif PER_BLOCK:
        cols = tl.arange(0, BLOCK_V)  # the first block holds a logit: its max is finite
        x = _load_logits(ptr, cols, V, SOFTCAP)
        picked = tl.where(cols == tgt, x, 0.0)
        mx = tl.max(x, axis=0)
        total = tl.sum(tl.exp(x - mx), axis=0)
        for v0 in range(BLOCK_V, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            x = _load_logits(ptr, cols, V, SOFTCAP)
            picked = tl.where(cols == tgt, x, picked)
            m_new = tl.maximum(mx, tl.max(x, axis=0))
            total = total * tl.exp(mx - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            mx = m_new
        lse = mx + tl.log(total)
    else:
        m = tl.full((BLOCK_V,), float("-inf"), dtype=tl.float32)
        s = tl.zeros((BLOCK_V,), dtype=tl.float32)
        picked = tl.zeros((BLOCK_V,), dtype=tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            x = _load_logits(ptr, cols, V, SOFTCAP)
            picked = tl.where(cols == tgt, x, picked)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
            s = tl.where(m == float("-inf"), 0.0, s)  # lanes that saw only padding stay empty, not NaN
        mx = tl.max(m, axis=0)
        lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), axis=0))
    logit = tl.sum(picked, axis=0)  # one lane holds the target's logit, the others 0 (x + 0 is x, bit for bit)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(tgt >= 0, lse - logit, 0.0))
    if GRAD:
        _dlogits_row(ptr, lse, tgt, tl.where(tgt >= 0, tl.load(dloss_ptr + row), 0.0), V, BLOCK_V, SOFTCAP)


@triton.jit
def k_crossentropy_bwd(logits_ptr, dloss_ptr, lse_ptr, tgt_ptr, V, BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr = 0.0):
    # logits: (r, V) in place -> dlogits (the gradient of z where SOFTCAP); dloss, lse, tgt: (r,)
    row = tl.program_id(0).to(tl.int64)
    tgt = tl.load(tgt_ptr + row)
    dloss = tl.where(tgt >= 0, tl.load(dloss_ptr + row), 0.0)
    _dlogits_row(logits_ptr + row * V, tl.load(lse_ptr + row), tgt, dloss, V, BLOCK_V, SOFTCAP)


@triton.jit
def k_crossentropy_softcap(ptr, n, SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    # ptr: (n,) logits, in place -> SOFTCAP * tanh(logits / SOFTCAP)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(ptr + offs, mask=mask).to(tl.float32)
    tl.store(ptr + offs, (SOFTCAP * tanh(x * (1.0 / SOFTCAP))).to(ptr.dtype.element_ty), mask=mask)


def _block_v(V: int, block: int = 4096) -> int:
    return min(triton.next_power_of_2(V), 1024 if INTERPRET else block)


# k_crossentropy_fwd's launch configurations (max per block, BLOCK_V, warps), timed once per GPU and shape in the
# warm-up (tuning.launch); the first is the default outside it. They differ in the order of a row's sum, so in the
# last bits of lse (the per-block max also needs one exponential an element where the per-lane max needs two).
# Capped logits (softcap up to CAP_MAX_LIMIT) keep no max (capped_sum): their configurations differ in BLOCK_V and
# warps only.
CAP_MAX_LIMIT = 40.0  # exp(-2 * 40) ~ 1.8e-35, still a normal fp32: every term of capped_sum's row sum counts
ROW_CONFIGS = {"lane4096w8": (False, 4096, 8), "block4096w8": (True, 4096, 8), "block8192w16": (True, 8192, 16),
               "block2048w4": (True, 2048, 4), "block4096w16": (True, 4096, 16), "block8192w8": (True, 8192, 8),
               "block16384w16": (True, 16384, 16)}  # fmt: skip


def row_launch(
    losses: torch.Tensor,
    lse: torch.Tensor,
    logits: torch.Tensor,
    targets: torch.Tensor,
    dlosses: torch.Tensor | None,
    V: int,
    per_block: bool,
    block: int,
    warps: int,
    softcap: float = 0.0,
) -> Callable[[], None]:
    """k_crossentropy_fwd on a chunk of logits (r, V) under one configuration of ROW_CONFIGS, as a closure: loss and
    lse per row and, given dlosses, dlogits in place."""
    r, grad, bv = logits.shape[0], dlosses is not None, _block_v(V, block)
    dloss = dlosses if grad else lse  # without GRAD the kernel never reads its dloss pointer: lse stands in
    return lambda: k_crossentropy_fwd[(r,)](
        losses,
        lse,
        logits,
        targets,
        dloss,
        V,
        GRAD=grad,
        BLOCK_V=bv,
        PER_BLOCK=per_block,
        SOFTCAP=float(softcap),
        CAP_MAX=0 < softcap <= CAP_MAX_LIMIT,
        num_warps=warps,
    )


def _row_kernel(
    losses: torch.Tensor,
    lse: torch.Tensor,
    logits: torch.Tensor,
    targets: torch.Tensor,
    dlosses: torch.Tensor | None,
    V: int,
    tuner: Tuner,
    softcap: float,
) -> None:
    """k_crossentropy_fwd under the configuration the warm-up chose for this chunk's shape. Under the warm-up the
    configurations run several times on one chunk (turning its dlogits into others: values the warm-up discards)."""

    def make(*config):
        return row_launch(losses, lse, logits, targets, dlosses, V, *config, softcap=softcap)

    # one choice with and without the gradient: the forward alone gives the lse the fused call gives
    cap = f":c{softcap:g}" if softcap else ""  # GPT-2's keys as they were
    tuner.launch("crossentropy_row", f"{logits.shape[0]}:{V}:{logits.dtype}{cap}", ROW_CONFIGS, make)


def _chunks(
    x2: torch.Tensor, wte: torch.Tensor, logits: torch.Tensor, mm: Matmul
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(r0, r, lg) for each chunk of rows r0 .. r0 + r in order, lg (r, V) the leading rows of the scratch holding
    its logits, computed by the precision's head GEMM."""
    chunk_logits = mm.logits(x2, wte)
    N, R = x2.shape[0], logits.shape[0]
    for r0 in range(0, N, R):
        r = min(R, N - r0)
        lg = logits[:r]
        chunk_logits(lg, r0, r)
        yield r0, r, lg


def crossentropy_forward(
    losses: torch.Tensor,
    lse: torch.Tensor,
    x: torch.Tensor,
    wte: torch.Tensor,
    targets: torch.Tensor,
    logits: torch.Tensor,
    *,
    mm: Matmul,
    tuner: Tuner,
    softcap: float = 0.0,
) -> None:
    V, C = logits.shape[1], x.shape[-1]
    tg, losses, lse = targets.view(-1), losses.view(-1), lse.view(-1)
    for r0, _, lg in _chunks(x.view(-1, C), wte, logits, mm):
        _row_kernel(losses[r0:], lse[r0:], lg, tg[r0:], None, V, tuner, softcap)


def crossentropy_backward(
    dx: torch.Tensor,
    dwte: torch.Tensor,
    dlosses: torch.Tensor,
    x: torch.Tensor,
    wte: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    logits: torch.Tensor,
    *,
    mm: Matmul,
    tuner: Tuner,
    softcap: float = 0.0,
) -> None:
    V, C = logits.shape[1], x.shape[-1]
    x2, dx2, tg = x.view(-1, C), dx.view(-1, C), targets.view(-1)
    dlosses, lse = dlosses.view(-1), lse.view(-1)
    for r0, r, lg in _chunks(x2, wte, logits, mm):
        k_crossentropy_bwd[(r,)](
            lg, dlosses[r0:], lse[r0:], tg[r0:], V, BLOCK_V=_block_v(V), SOFTCAP=float(softcap), num_warps=8
        )
        mm.logits_backward(dx2[r0 : r0 + r], dwte, lg, x2[r0 : r0 + r], wte)


def crossentropy_forward_backward(
    losses: torch.Tensor,
    lse: torch.Tensor,
    dx: torch.Tensor,
    dwte: torch.Tensor,
    dlosses: torch.Tensor,
    x: torch.Tensor,
    wte: torch.Tensor,
    targets: torch.Tensor,
    logits: torch.Tensor,
    *,
    mm: Matmul,
    tuner: Tuner,
    softcap: float = 0.0,
) -> None:
    """crossentropy_forward, then crossentropy_backward with dlosses, without recomputing any chunk's logits."""
    V, C = logits.shape[1], x.shape[-1]
    x2, dx2, tg = x.view(-1, C), dx.view(-1, C), targets.view(-1)
    losses, lse, dlosses = losses.view(-1), lse.view(-1), dlosses.view(-1)
    for r0, r, lg in _chunks(x2, wte, logits, mm):
        _row_kernel(losses[r0:], lse[r0:], lg, tg[r0:], dlosses[r0:], V, tuner, softcap)
        mm.logits_backward(dx2[r0 : r0 + r], dwte, lg, x2[r0 : r0 + r], wte)


CAP_BLOCK = 2048  # elements a program of head_logits' cap: one elementwise pass, one launch configuration


def head_logits(out: torch.Tensor, x: torch.Tensor, wte: torch.Tensor, *, mm: Matmul, softcap: float = 0.0) -> None:
    """out (b,V) = x (b,C) @ wte.T, capped where softcap: the next-token logits of the inference step's last positions
    (no loss). out: contiguous rows."""
    mm.logits(x, wte)(out, 0, x.shape[0])
    if softcap:
        n = out.numel()
        k_crossentropy_softcap[(triton.cdiv(n, CAP_BLOCK),)](
            out, n, SOFTCAP=float(softcap), BLOCK=CAP_BLOCK, num_warps=4
        )


@triton.jit
def k_loss_weights(dloss_ptr, tgt_ptr, scale_ptr, N, BLOCK: tl.constexpr):
    # dloss: (N,) = scale / count where target >= 0, else 0 (the gradient of the mean loss); one program
    count = tl.zeros((BLOCK,), dtype=tl.int32)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        count += (tl.load(tgt_ptr + offs, mask=offs < N, other=-1) >= 0).to(tl.int32)
    w = tl.load(scale_ptr) / tl.maximum(tl.sum(count, axis=0), 1).to(tl.float32)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        valid = tl.load(tgt_ptr + offs, mask=offs < N, other=-1) >= 0
        tl.store(dloss_ptr + offs, tl.where(valid, w, 0.0), mask=offs < N)


@triton.jit
def k_loss_sum(out_ptr, loss_ptr, tgt_ptr, N, weight, ACCUM: tl.constexpr, BLOCK: tl.constexpr):
    # ACCUM: out[0] += weight * mean loss over non-ignored rows; else out[0] = sum of losses, out[1] = count
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    count = tl.zeros((BLOCK,), dtype=tl.int32)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        s += tl.load(loss_ptr + offs, mask=offs < N, other=0.0)
        count += (tl.load(tgt_ptr + offs, mask=offs < N, other=-1) >= 0).to(tl.int32)
    total = tl.sum(s, axis=0)
    c = tl.sum(count, axis=0).to(tl.float32)
    if ACCUM:
        tl.store(out_ptr, tl.load(out_ptr) + weight * total / tl.maximum(c, 1.0))
    else:
        tl.store(out_ptr, total)
        tl.store(out_ptr + 1, c)


def loss_weights(dlosses: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor) -> None:
    """dlosses (N,) = d(mean loss over targets >= 0) / d(per-token loss), times scale[0] (the fp16 loss scale)."""
    k_loss_weights[(1,)](dlosses, targets, scale, targets.numel(), BLOCK=1024, num_warps=4)


def loss_sum(
    out: torch.Tensor, losses: torch.Tensor, targets: torch.Tensor, weight: float = 0.0, accumulate: bool = False
) -> None:
    """out[:2] = (sum of losses, count of targets >= 0), or with accumulate out[0] += weight * their mean."""
    k_loss_sum[(1,)](out, losses, targets, targets.numel(), float(weight), ACCUM=accumulate, BLOCK=1024, num_warps=4)
