"""Every launch the launchers of kernels/ make for a model's shapes, captured instead of run: what the compile sweep
(targets.py) compiles for each architecture.

`launches(shape, dtype)` calls the real launchers -- a training step's, the inference step's, the optimizer's
(AdamW's, and Muon's for a modern-block shape) and precision fp8's -- on tensors of the "meta" device (shapes and
strides, no memory), with a `Catalogue` standing in for the runtime's tuner that hands over every candidate of every
choice in turn, while each Triton kernel of kernels/ records its launches instead of running them (`capture`). A
Launch is the kernel with the arguments and keywords it was given, and where it came from: a fixed launch, or
candidate `index` of one choice (`group`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from microgpt.fp8 import OSLOT, SLOT, Fp8Weight, Priming
from microgpt.kernels import (
    adamw,
    argmax,
    attention,
    crossentropy,
    decode,
    embedding,
    fp8,
    fp8_cast,
    gelu,
    gemm,
    gemm_tma,
    gradclip,
    layernorm,
    linear,
    muon,
    qkrope,
    relu2,
    rmsnorm,
    skip,
    symmetric,
)
from microgpt.ops.adamw import SEGMENT_BLOCK
from microgpt.ops.muon import MuonGroup, muon_groups

KERNEL_MODULES = (adamw, argmax, attention, crossentropy, decode, embedding, fp8_cast, gelu, gemm, gemm_tma, gradclip,
                  layernorm, muon, qkrope, relu2, rmsnorm, skip, symmetric)  # fmt: skip
SWEEP_SMS = 132  # the multiprocessors the LayerNorm backward's grid is sized for here (a runtime argument only)
ADAMW_ARGS = (0.9, 0.95, 1e-8, 0.1, 1.0)  # AdamW's beta1, beta2, eps, weight decay and clip norm (runtime values)


@dataclass(frozen=True)
class Shape:
    """One micro-batch of a model: B sequences of T tokens, C = d_model, NH heads, V the vocabulary, L layers, and the
    block family (model.block: "gpt2" or "modern")."""

    name: str
    B: int
    T: int
    C: int
    NH: int
    V: int
    L: int
    block: str = "gpt2"


@dataclass(frozen=True)
class Launch:
    kernel: JITFunction
    label: str  # "<tuning table> <candidate>" for a tuned launch, "fixed" for one launch configuration
    group: int  # the tuned choice it is a candidate of (one call of choose: one table and key); -1: fixed
    index: int  # its place among that choice's candidates: 0 is the default outside the warm-up
    fp8: bool  # an fp8 precision's kernel (compiled for TARGETS with fp8 only)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @property
    def tma(self) -> bool:
        """It reads through host tensor descriptors (TMA: compiled for sm_90 and newer only)."""
        return any(isinstance(arg, TensorDescriptor) for arg in self.args)


class Catalogue:
    """The runtime's tuner as the sweep needs it: every candidate of a choice is launched in turn (and captured),
    labelled by its table and name; the first is the choice."""

    is_open = False

    def __init__(self) -> None:
        self.label, self.group, self.index, self.groups = "fixed", -1, 0, 0

    def choose(self, table: str, key: str, candidates: dict[str, Callable[[], None]]) -> str:
        self.group, self.groups = self.groups, self.groups + 1
        for self.index, (name, fn) in enumerate(candidates.items()):
            self.label = f"{table} {name}"
            fn()
        self.label, self.group, self.index = "fixed", -1, 0
        return next(iter(candidates))

    def launch(
        self, table: str, key: str, configs: dict[str, tuple[Any, ...]], make: Callable[..., Callable[[], None]]
    ) -> None:
        self.choose(table, key, {name: make(*cfg) for name, cfg in configs.items()})


def jit_kernels() -> dict[str, JITFunction]:
    """Every Triton kernel (k_*) of kernels/, by name."""
    return {
        name: fn
        for module in KERNEL_MODULES
        for name, fn in vars(module).items()
        if name.startswith("k_") and isinstance(fn, JITFunction)
    }


@contextmanager
def capture(catalogue: Catalogue, fp8: bool) -> Iterator[list[Launch]]:
    """While open, a launch of any kernel of kernels/ is recorded (with the catalogue's label; fp8: as precision
    fp8's) and not run."""
    got: list[Launch] = []
    kernels = jit_kernels().values()

    def recorder(kernel: JITFunction) -> Callable[..., None]:
        def run(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            got.append(Launch(kernel, catalogue.label, catalogue.group, catalogue.index, fp8, args, kwargs))

        return run

    for kernel in kernels:
        kernel.run = recorder(kernel)  # an instance attribute: k[grid](...) calls self.run
    try:
        yield got
    finally:
        for kernel in kernels:
            del kernel.run


def launches(s: Shape, dtype: torch.dtype) -> list[Launch]:
    """Every launch one training step (and an inference step) makes for a micro-batch of shape s with activations
    in dtype, every candidate of every tuned launch included; for bf16 and fp16 also the fp8 precision's (casts
    from that dtype and from the fp32 masters, the interpreter's scaled GEMM tile)."""
    cat = Catalogue()
    with capture(cat, False) as got:
        if s.block == "modern":
            _modern_launches(s, dtype, cat)
            _modern_linears(s, dtype, cat)
            _muon_step_launches(s, dtype, cat)
        else:
            _training_launches(s, dtype, cat)
    if dtype == torch.float32:
        return got
    with capture(cat, True) as got8:
        _fp8_launches(s, dtype, cat)
    return got + got8


def _meta(dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    return lambda *shape, dt=dtype: torch.empty(shape, dtype=dt, device="meta")


def _training_launches(s: Shape, dtype: torch.dtype, cat: Catalogue) -> None:
    """The launches of model.gpt_forward, gpt_backward and gpt_infer, and of the optimizer step, as the triton
    backend makes them (the arguments' dtypes as the plan gives them: f32 grads and statistics)."""
    e, f32, i32 = _meta(dtype), torch.float32, torch.int32
    B, T, C, V, N = s.B, s.T, s.C, s.V, s.B * s.T
    mm = linear.Matmul(gemm.Gemm(cat, None, tma=True))  # the MLP's choices offer the TMA tiles, as on sm_90
    tok, x, stat = e(B, T, dt=i32), e(N, C), e(N, dt=f32)
    embedding.embedding_forward(e(B, T, C), tok, e(V, C), e(T, C))
    embedding.embedding_backward(e(V, C, dt=f32), e(T, C, dt=f32), e(B, T, C), tok, order=e(N, dt=i32), tuner=cat)
    layernorm.layernorm_forward(e(N, C), stat, stat, x, e(C), e(C), tuner=cat)
    layernorm.residual_layernorm_forward(e(N, C), e(N, C), stat, stat, x, x, e(C), e(C), tuner=cat)
    partials = e(layernorm.scratch_numel(C, SWEEP_SMS), dt=f32)
    layernorm.layernorm_backward(
        e(N, C), e(C, dt=f32), e(C, dt=f32), x, x, e(C), stat, stat, partials=partials, tuner=cat
    )
    mm.forward(e(3, N, C), x, e(3, C, C))
    mm.backward(e(N, C), e(3, C, C, dt=f32), e(3, N, C), x, e(3, C, C))
    mm.forward(e(N, 4 * C), x, e(C, 4 * C), act_out=e(N, 4 * C))
    mm.backward(e(N, 4 * C), e(4 * C, C, dt=f32), x, e(N, 4 * C), e(4 * C, C), dx_act_of=e(N, 4 * C))  # W_2's: dh
    mm.backward(e(N, C), e(C, 4 * C, dt=f32), e(N, 4 * C), x, e(C, 4 * C))
    _tma_gemm_launches(s, dtype, cat)
    _attention_launches(s, e, cat)
    rows, at = e(B, C), e(B, dt=i32)  # the decode step of B rows (model.gpt_decode)
    decode.decode_embedding(rows, at, at, e(V, C), e(T, C))
    decode.decode_kv_write(e(B, T, C), e(B, T, C), rows, rows, at, at)
    _decode_attention_launch(s, e, rows, at)
    _loss_head_launches(s, e, mm, cat, 0.0)
    tg = e(N, dt=i32)
    argmax.argmax_rows(e(B, dt=i32), e(B, V))  # the decode step's greedy pick
    crossentropy.loss_weights(stat, tg, e(1, dt=f32))
    crossentropy.loss_sum(e(2, dt=f32), stat, tg)
    crossentropy.loss_sum(e(2, dt=f32), stat, tg, 0.5, accumulate=True)
    n = V * C  # a flat array's length: only whether it divides by 16 reaches the compiled kernels
    flat = e(n, dt=f32)
    gradclip.grad_norm_partial(e(triton.cdiv(n, 1 << 16), dt=f32), flat, 1 << 16)
    gradclip.grad_norm_final(e(1, dt=f32), e(triton.cdiv(n, 1 << 16), dt=f32))
    compute = e(n) if dtype != f32 else None
    mask, hyper, norm = e(n, dt=torch.uint8), e(8, dt=f32), e(1, dt=f32)
    adamw.adamw_step(flat, flat, flat, flat, mask, compute, hyper, norm, *ADAMW_ARGS, tuner=cat)
    gelu.gelu_forward(e(N, 4 * C), e(N, 4 * C))  # train.recompute_gelu's pass


def _tma_gemm_launches(s: Shape, dtype: torch.dtype, cat: Catalogue) -> None:
    """The plain GEMM's TMA tiles (gemm_tma.TILES), as candidates of the router's mm beside the pointer tile (off CUDA
    the router runs the pointer tile alone, so the linears above never reach them): for each layout a step's 2D GEMMs
    with 16-bit outputs take (the tiles' condition, gemm_tma.tma_fits: the fp32 weight gradients are not theirs), at
    the MLP's widths (every site binds alike): the forward x @ w, and the input gradient dy @ w^T written and added
    into (the QKV projection's sum over its weights)."""
    if dtype == torch.float32:
        return
    e, C, N = _meta(dtype), s.C, s.B * s.T
    x, w, dy = e(N, C), e(C, 4 * C), e(N, 4 * C)
    for out, a, b, acc in ((e(N, 4 * C), x, w, False), (e(N, C), dy, w.t(), False), (e(N, C), dy, w.t(), True)):
        ways = {"triton": lambda out=out, a=a, b=b, acc=acc: gemm.triton_mm(out, a, b, acc)}
        ways |= {t: lambda t=t, out=out, a=a, b=b, acc=acc: gemm_tma.tma_mm(out, a, b, acc, t) for t in gemm_tma.TILES}
        cat.choose("gemm", "", ways)


def _attention_launches(s: Shape, e: Callable[..., torch.Tensor], cat: Catalogue, bounded: bool = False) -> None:
    """Attention's training forward and backward, and its forward over the cache, at the shape's head size; bounded
    (the modern block): also each with the window and document starts (model.attn_window, model.doc_mask; each alone
    binds the constexprs WINDOW, DOC otherwise), the document starts' scan, and the backward through qkrope (its
    ways: the kernel with qkrope's backward in its epilogues, QKROPE, and the kernel then qkrope's pass)."""
    B, T, C, NH, N = s.B, s.T, s.C, s.NH, s.B * s.T
    q, lse = e(B, T, C), e(B, NH, T, dt=torch.float32)
    masks = [{}]
    if bounded:
        win, ds = e(1, dt=torch.int32), e(B, T, dt=torch.int32)
        masks += [{"window": win}, {"doc_start": ds}, {"window": win, "doc_start": ds}]
        attention.doc_starts(ds, ds, 0)
    for mask in masks:
        attention.attention_forward(q, lse, q, q, q, NH, tuner=cat, **mask)
        delta = e(N * NH, dt=torch.float32)
        attention.attention_backward(q, q, q, q, q, q, q, q, lse, NH, delta=delta, tuner=cat, **mask)
        if bounded:
            qkrope = (e(2, N, NH, dt=torch.float32), e(2, T, C // NH // 2, dt=torch.float32))  # rstd, rope
            attention.attention_backward(q, q, q, q, q, q, q, q, lse, NH, delta=delta, tuner=cat, **mask, qkrope=qkrope)
        cached = {k: v[:, :1] if k == "doc_start" else v for k, v in mask.items()}
        attention.attention_forward_cached(e(B, 1, C), e(B, 1, C), q, q, T - 1, NH, **cached)


def _decode_attention_launch(
    s: Shape, e: Callable[..., torch.Tensor], rows: torch.Tensor, at: torch.Tensor, bounded: bool = False
) -> None:
    """The decode step's attention of B rows (rows (B, C), at (B,) int32) over a (B, T, C) cache; bounded: also with
    the modern block's window and document starts (each alone, and both), and the document starts' two kernels."""
    B, T, C, NH = s.B, s.T, s.C, s.NH
    cache = e(B, T, C)
    partials = e(decode.partials_numel(B, T, C, NH, SWEEP_SMS), dt=torch.float32)
    masks = [{}]
    if bounded:
        win = e(1, dt=torch.int32)
        masks += [{"window": win}, {"doc_start": at}, {"window": win, "doc_start": at}]
        decode.decode_doc_starts(at, e(B, T, dt=torch.int32), at, at, at, 0)
    for mask in masks:
        decode.decode_attention(rows, rows, cache, cache, at, at, NH, sm_count=SWEEP_SMS, partials=partials, **mask)


def _loss_head_launches(
    s: Shape, e: Callable[..., torch.Tensor], mm: linear.Matmul, cat: Catalogue, softcap: float
) -> None:
    """The loss head's forward, backward and fused pair over the (N, V) logits chunk, and the inference step's
    next-token logits, at the logit soft-cap softcap (0: GPT-2's, none)."""
    f32, B, C, V, N = torch.float32, s.B, s.C, s.V, s.B * s.T
    x, stat, logits, tg, head = e(N, C), e(N, dt=f32), e(N, V), e(N, dt=torch.int32), e(V, C)
    kw = {"mm": mm, "tuner": cat, "softcap": softcap}
    crossentropy.crossentropy_forward(stat, stat, x, head, tg, logits, **kw)
    crossentropy.crossentropy_backward(x, e(V, C, dt=f32), stat, x, head, tg, stat, logits, **kw)
    crossentropy.crossentropy_forward_backward(stat, stat, x, e(V, C, dt=f32), stat, x, head, tg, logits, **kw)
    crossentropy.head_logits(e(B, V), e(B, C), head, mm=mm, softcap=softcap)


SOFTCAP = 15.0  # the modern block's logit soft-cap (issue 46's default): a constexpr of the loss head's kernels


def _modern_launches(s: Shape, dtype: torch.dtype, cat: Catalogue) -> None:
    """The launches of the modern block's own ops (issue 46), as the triton backend makes them: the embedding without
    a position table (and the decode step's), the value embeddings' add, the skip pair (model.skips: forward in place,
    backward with its partial sums), RMSNorm (plain and fused with the residual add) and its backward, ReLU^2 and its
    backward, and the loss head with its logit soft-cap; attention at D = C / NH (128: its own candidates,
    kernels/attention.py configs) in training, over the cache and in the decode step; qkrope and its decode twin. Its
    linears are `_modern_linears`', its optimizer step `_muon_step_launches`', its fp8 `_fp8_launches`' (s.block
    "modern")."""
    e, f32, i32 = _meta(dtype), torch.float32, torch.int32
    B, T, C, NH, V, N = s.B, s.T, s.C, s.NH, s.V, s.B * s.T
    mm = linear.Matmul(gemm.Gemm(cat, None))
    tok, x, stat, h = e(B, T, dt=i32), e(N, C), e(N, dt=f32), e(N, 4 * C)
    embedding.embedding_forward(e(B, T, C), tok, e(V, C))
    embedding.embedding_backward(e(V, C, dt=f32), None, e(B, T, C), tok, order=e(N, dt=i32), tuner=cat)
    embedding.embedding_add_forward(x, tok, e(V, C))  # the value embeddings (their backward: the one above)
    skip.skip_forward(x, x, x, e(1))  # in place on a layer's input; the decode step's at B rows binds alike
    skip.skip_backward(x, e(1, dt=f32), x, x, e(1), partials=e(skip.scratch_numel(SWEEP_SMS), dt=f32))
    rmsnorm.rmsnorm_forward(x, stat, x, tuner=cat)
    rmsnorm.residual_rmsnorm_forward(x, x, stat, x, x, tuner=cat)
    rmsnorm.rmsnorm_backward(x, x, x, stat, tuner=cat)
    relu2.relu2_forward(h, h)  # in place: W_1's GEMM writes into a where h is not kept
    relu2.relu2_backward(h, h)  # dh from a
    _attention_launches(s, e, cat, bounded=True)  # at D = C / NH (128), its own candidates
    qkv, rope, qstat = e(3, N, C), e(2, T, C // NH // 2, dt=f32), e(2, N, NH, dt=f32)  # qkrope on the projection's
    qk = qkv[0].view(B, T, C), qkv[1].view(B, T, C)  # q, k (B, T, C) views, as the model hands them in
    qkrope.qkrope_forward(*qk, qstat, rope, n_head=NH)
    qkrope.qkrope_forward(qkv[0, :1].view(1, 1, C), qkv[1, :1].view(1, 1, C), qstat, rope, n_head=NH, pos=T - 1)
    qkrope.qkrope_backward(*qk, *qk, qstat, rope, n_head=NH)
    rows, at = e(B, C), e(B, dt=i32)  # the decode step of B rows
    decode.decode_embedding(rows, at, at, e(V, C))
    decode.decode_qkrope(rows, rows, at, rope, n_head=NH)
    _decode_attention_launch(s, e, rows, at, bounded=True)
    _loss_head_launches(s, e, mm, cat, SOFTCAP)  # over the untied lm_head


def _modern_linears(s: Shape, dtype: torch.dtype, cat: Catalogue) -> None:
    """The modern block's four GEMM sites (engine/params.py site_shapes: w_qkv (3, C, C), w_o, w_1, w_2) through the
    GEMM router, forward and backward at N rows, and the decode step's forward at B rows (off CUDA the router runs
    w_qkv's batched GEMM as one tile GEMM a weight, as the interpreter does; on a GPU it is cuBLAS's). At N rows they
    bind as GPT-2's sites do at ANDREA-120M's shape: the Triton tile's binary depends on the operands' dtypes and
    strides and on which sizes are 1 or divide by 16, and N, C, 4C are GPT-2's there; w_1's forward and w_2's input
    gradient bind the MLP's tiles with ReLU^2 in their epilogues (GPT-2's: GELU). The decode step's B rows, and its
    RMSNorms over them, bind to binaries of their own."""
    e, f32 = _meta(dtype), torch.float32
    B, C, N = s.B, s.C, s.B * s.T
    mm = linear.Matmul(gemm.Gemm(cat, None, tma=True))  # the MLP's choices offer the TMA tiles, as on sm_90
    for G, Cin, OC in ((3, C, C), (1, C, C), (1, C, 4 * C), (1, 4 * C, C)):
        lead = (G,) if G > 1 else ()  # a site of one weight is a 2D matrix (the parameters' named view)
        w, y = e(*lead, Cin, OC), e(*lead, N, OC)
        if OC == 4 * C:  # w_1: a = relu2(h) with its GEMM, a alone (h not kept), and h too (train.recompute_gelu)
            mm.forward(None, e(N, Cin), w, act_out=e(N, OC), act="relu2")
            mm.forward(y, e(N, Cin), w, act_out=e(N, OC), act="relu2")
        else:
            mm.forward(y, e(N, Cin), w)
        dact = dict(act="relu2", dx_act_out=e(N, Cin)) if Cin == 4 * C else {}  # w_2: dh *= 2 sqrt(a) with its GEMM
        mm.backward(e(N, Cin), e(*lead, Cin, OC, dt=f32), y, e(N, Cin), w, **dact)
        mm.forward(e(*lead, B, OC), e(B, Cin), w)
    _tma_gemm_launches(s, dtype, cat)
    rows, rstd = e(B, C), e(B, dt=f32)  # the decode step's embedding norm and the block's norms over B rows
    rmsnorm.rmsnorm_forward(rows, rstd, rows, tuner=cat)
    rmsnorm.residual_rmsnorm_forward(rows, rows, rstd, rows, rows, tuner=cat)


def modern_muon_groups(s: Shape) -> tuple[MuonGroup, ...]:
    """Muon's groups at a modern shape: the block matrices at their offsets in engine/params.py's canonical order
    (wte (V, C); per layer w_q, w_k, w_v, w_o (C, C), w_1 (C, 4C), w_2 (4C, C); lm_head (V, C)), grouped by
    ops/muon.py's rule: engine/optim.groups of the model (kernels/ sits below engine/: tests/kernels/test_targets.py
    checks that the two agree)."""
    C = s.C
    at, matrices = s.V * C, []
    for _ in range(s.L):
        for rows, cols in [(C, C)] * 4 + [(C, 4 * C), (4 * C, C)]:
            matrices.append((at, rows, cols))
            at += rows * cols
    return muon_groups(matrices)


def _muon_step_launches(s: Shape, dtype: torch.dtype, cat: Catalogue) -> None:
    """The rest of the modern optimizer step (engine/step.py under train.optimizer "muon"), on the step's own views:
    the loss sums into report (the mean at report[0], micro-batch i's at report[2 + i:], four of them: every
    alignment a float can have in 16 bytes, which the kernels are specialised on), the gradient norm into report[1:2],
    AdamW over the embedding and over the untied head with their rows of hyper (no segment maxima: Muon's plans
    record none), and Muon over its groups (modern_muon_groups) with its row, its scratch as kernels/muon.py plans
    it. Of Muon's Newton-Schulz products (Gemm.addmm) the two symmetric ones launch kernels/symmetric.py's tile on
    these meta tensors, as a fixed launch (the GEMM router's Triton ways are: off CUDA they are the only way), at
    each group's shapes; the third is torch's here (cuBLASLt's on a GPU), and nothing of it is swept."""
    e, f32, i32 = _meta(dtype), torch.float32, torch.int32
    C, V, N = s.C, s.V, s.B * s.T
    report, losses, tg = e(2 + 4, dt=f32), e(N, dt=f32), e(N, dt=i32)
    crossentropy.loss_weights(e(N, dt=f32), tg, e(1, dt=f32))
    for i in range(4):
        crossentropy.loss_sum(report, losses, tg, 0.25, accumulate=True)
        crossentropy.loss_sum(report[2 + i :], losses, tg, 1.0, accumulate=True)
    groups = modern_muon_groups(s)
    n = sum(len(grp.offsets) * grp.size for grp in groups) + 2 * V * C
    p, g, m, v, norm = e(n, dt=f32), e(n, dt=f32), e(n, dt=f32), e(n, dt=f32), report[1:2]
    compute = e(n) if dtype != f32 else None
    partials = e(triton.cdiv(n, 1 << 16), dt=f32)
    gradclip.grad_norm_partial(partials, g, 1 << 16)
    gradclip.grad_norm_final(norm, partials)
    hyper, mask = e(3, 8, dt=f32), e(n, dt=torch.uint8)  # rows: AdamW's embedding, AdamW's head, Muon's
    for row, (lo, hi) in enumerate(((0, V * C), (n - V * C, n))):
        adamw.adamw_step(
            p[lo:hi],
            g[lo:hi],
            m[lo:hi],
            v[lo:hi],
            mask[lo:hi],
            None if compute is None else compute[lo:hi],
            hyper[row],
            norm,
            0.8,
            0.95,
            1e-10,
            0.0,
            1.0,
        )
    kinds = {"compute": dtype, "f32": f32, "i32": i32}
    scratch = {b.keyword: e(b.numel, dt=kinds[b.kind]) for b in muon.muon_scratch(groups)}
    muon.muon_step(p, g, m, compute, hyper[2], norm, groups=groups, max_norm=1.0, gemm=gemm.Gemm(cat, None), **scratch)


def _fp8_launches(s: Shape, dtype: torch.dtype, cat: Catalogue) -> None:
    """precision fp8's launches: each site's casts (input, GELU'd input, output gradient, GELU's backward), primed
    and not, the weights' and the head's casts (one weight, and a site over L layers taking AdamW's amaxes), the
    slots' roll, AdamW recording those amaxes; and the scaled GEMM tile (k_mm_scaled), which only the interpreter
    runs (on a GPU the E4M3 GEMMs are cuBLASLt's), compiled all the same. The modern block (s.block "modern") casts
    every site's operands as they are (ReLU^2 is its own pass: no GELU on the way), and under Muon, which records no
    amaxes, the weights' and the untied head's casts take their own amax launches; W_O's casts bind as W_1's input's
    and W_2's gradient's do."""
    e, f32, f8 = _meta(dtype), torch.float32, torch.float8_e4m3fn
    C, V, N, L, modern = s.C, s.V, s.B * s.T, s.L, s.block == "modern"
    scratch = {name: e(N * 4 * C, dt=f8) for name in ("fp8_x", "fp8_g", "fp8_gt")} | {"fp8_wgrad": e(4 * C * C)}
    mm = fp8.Matmul(gemm.Gemm(cat, None), None, scratch)
    for G, Cin, OC in ((3, C, C), (1, C, 4 * C), (1, 4 * C, C)):
        w = Fp8Weight(
            "site",
            e(G, Cin, OC, dt=f32),
            e(Cin, G * OC, dt=f8),
            e(G, OC, Cin, dt=f8),
            e(SLOT, dt=f32),
            e(OSLOT, dt=f32),
            e(OSLOT, dt=f32),
            Priming(True),
            e(Cin * N, dt=f8),
        )
        for priming in (True, False):
            w.priming.on = priming
            act = "relu2" if modern else "gelu"
            act_in = Cin == 4 * C  # W_2's input is act(h), cast as the activation computes it
            mm.forward(e(G, N, OC), None if act_in else e(N, Cin), w, act_of=e(N, Cin) if act_in else None, act=act)
            mm.backward(
                e(N, Cin),
                e(G, Cin, OC, dt=f32),
                e(G, N, OC),
                None,
                w,
                dact_of=e(N, OC) if OC == 4 * C else None,
                act=act,
            )
        mm.cast_weights([w])
        # a site over its layers, as the step casts it: taking AdamW's amaxes (a site's every fourth), or its own
        take = None if modern else e(4 * L, dt=f32)[::4]
        fp8_cast.cast(
            cat,
            e(L, G, Cin, OC, dt=f32),
            e(L, 4 * SLOT, dt=f32)[:, :SLOT],
            e(L, Cin, G * OC, dt=f8),
            e(L, G, OC, Cin, dt=f8),
            prime=True,
            hist=0,
            take=take,
        )
        if not modern:
            mm.cast_weights([w], e(1, dt=f32))  # after AdamW, which recorded its amax
    fp8_cast.cast(cat, e(V, C, dt=f32), e(SLOT, dt=f32), e(V, C, dt=f8), None, prime=True, hist=0)  # the head's weight
    if not modern:  # after AdamW
        fp8_cast.cast(cat, e(V, C, dt=f32), e(SLOT, dt=f32), e(V, C, dt=f8), None, hist=0, take=e(1, dt=f32))
    fp8_cast.cast(cat, e(N, C), e(SLOT, dt=f32), e(N, C, dt=f8), None, prime=True, hist=0)  # the head's lnf
    mm.roll(e(L, 4, 2, OSLOT, dt=f32), True)
    mm.roll(e(L, 4, 2, OSLOT, dt=f32), False)
    if modern:
        return
    n = V * C  # AdamW over the parameters, recording the E4M3 weights' amaxes (its segment maxima: ops/adamw.py)
    flat = e(n, dt=f32)
    table = e(triton.cdiv(n, SEGMENT_BLOCK), 4, dt=torch.int32)
    mask, hyper, norm = e(n, dt=torch.uint8), e(8, dt=f32), e(1, dt=f32)
    adamw.adamw_step(
        flat, flat, flat, flat, mask, e(n), hyper, norm, *ADAMW_ARGS, segment_table=table, segment_max=e(49, dt=f32)
    )


# the shapes the sweep compiles for: one micro-batch of each recipe (tests/kernels/test_targets.py checks them
# against experiments/); the modern block's at ANDREA-120M's size: 6 heads of 128 (issue 46)
ANDREA = (Shape("ANDREA-12M", 16, 512, 384, 6, 4096, 6), Shape("ANDREA-120M", 8, 1024, 768, 12, 50304, 12))
MODERN = (Shape("ANDREA-120M-MODERN", 8, 1024, 768, 6, 50304, 12, "modern"),)
