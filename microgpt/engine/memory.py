"""The memory plan: every byte the training step (or the inference step) touches, as a table, allocated once.

A plan is a list of Buf(name, shape, role, kind). Roles group buffers by lifetime and purpose:

    params, grads, adam_m, adam_v   fp32, one flat array each, in the canonical parameter order
    compute_params                  the weights in the compute dtype (bf16/fp16/fp8 runs on the GPU), same order;
                                    AdamW writes it
    (the precision's own)           any role ROLES does not name is a precision's (Precision.rows; fp8's
                                    "fp8_weights": its E4M3 weight copies), placed here, labelled by its name
    optim                           decay mask, grad-norm partial sums, the step's host values (hyper, loss scale)
                                    and what it reports back (report), the evaluation's loss sum; Muon's scratch
    tables                          constant tables the model reads (the modern block's rotary cos and sin)
    acts                            saved activations: written in forward, read in backward
    scratch                         per-layer temporaries and activation gradients, reused by every layer
    inputs                          the tokens and targets of every micro-batch of a step (and the attention
                                    window: the step's, written before it; the model's at inference)
    kv_cache                        inference: every layer's keys and values of every position (the inference
                                    plan's; its activations are one layer's, reused by every layer), and with
                                    model.doc_mask every position's token (where its document starts is read there)
    kernel                          the backend's launcher scratch (the triton backend's; none on NumPy)
    rounding                        the arena's size rounded up to ARENA_GRANULE, as PyTorch's caching allocator
                                    rounds a large allocation (so the plan is what the device reports allocated)
    runtime                         bytes the device runtime allocates itself (cuBLAS's workspace): counted, not
                                    carved from the arena

Kinds give the element type: "f32" (always float32), "compute" (the precision's compute dtype: float32 on the NumPy
backend, bf16/fp16 on the GPU, bf16 in fp8 runs), "i32", "u8", "f8" (E4M3). The plan's rows are the model's
(params.py's table), the precision's (`Precision.rows`) and the backend's own. The Arena makes ONE allocation for
every role but "runtime" and carves each buffer out of it as a view: each (role, kind) group is contiguous and
256-byte aligned, so a flat grads array makes the gradient norm and AdamW one call each, and the parameter-shaped
groups are exactly the checkpoint's layout. Nothing is allocated during training, and the plan printed before the
first step is the memory used.

Shapes: B micro-batch, T seq_len, C d_model, L n_layer, NH n_head, V vocab_size, N = B*T, U n_micro.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from microgpt.config import INT_MAX, ModelConfig, TrainConfig
from microgpt.engine import params
from microgpt.errors import InputError

ALIGN = 256  # bytes: every group and every unpacked view starts on a 256-byte boundary
ARENA_GRANULE = 2 << 20  # bytes: the arena's size is a multiple of this (torch rounds large blocks up to 2 MiB)
# the roles in arena order; "precision" stands for the precision's own roles (those ROLES does not name: roles_of)
ROLES = ("params", "grads", "adam_m", "adam_v", "compute_params", "precision", "optim", "tables", "acts", "scratch",
         "inputs", "kv_cache", "kernel", "rounding", "runtime")  # fmt: skip
PACKED = ("params", "grads", "adam_m", "adam_v", "compute_params")  # contiguous: the flat array IS the layout
LABELS = {"compute_params": "compute weights", "optim": "optimizer + step",
          "acts": "saved activations", "scratch": "scratch + act grads", "adam_m": "adam m", "adam_v": "adam v",
          "inputs": "step inputs", "tables": "model tables", "kv_cache": "kv cache", "kernel": "kernel scratch",
          "rounding": "allocator rounding", "runtime": "cuBLAS workspace"}  # fmt: skip
KIND_BYTES = {"f32": 4, "i32": 4, "u8": 1, "f8": 1}
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # the precisions' compute dtypes
NORM_BLOCK = 1 << 16  # elements per grad-norm partial sum (the first of the two reduction stages)
HYPER = 8  # the step's per-step host values (microgpt/ops/adamw.py: lr, bias1, bias2, gscale; the rest spare)


class PlanError(InputError):
    """A plan that cannot be allocated, or a buffer the plan does not have."""


@dataclass(frozen=True)
class Buf:
    name: str
    shape: tuple[int, ...]
    role: str
    kind: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Precision(Protocol):
    """What the plan needs of a precision (microgpt/engine/precision.py makes them): its compute dtype, whether the
    weights have a copy in it, whether the MLP's activation output has a buffer, whether its cast computes act' from
    h, its own rows, and the plan's title."""

    compute: str

    @property
    def compute_copy(self) -> bool: ...

    @property
    def act_planned(self) -> bool: ...

    @property
    def dact_in_cast(self) -> bool: ...

    def rows(self, m: ModelConfig, N: int, weight_maxima: bool = True) -> list[Buf]: ...

    def label(self) -> str: ...


CKPT_MAX_PARAMS = 2**31 - 1  # the checkpoint header's int32 n_params


def host_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say): what a NumPy arena must fit in."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


GIB = 1 << 30


def check_fits(
    bufs: list[Buf],
    prec: Precision,
    m: ModelConfig,
    room: int | None,
    device: str,
    margin: int = 0,
    hint: Callable[[], str] | None = None,
) -> list[Buf]:
    """A plan (training's or inference's), once it is known to fit: PlanError, before anything is allocated, when
    it is larger than the `room` bytes the device has for it less `margin` (what the plan leaves to others: the
    run's train.memory_margin), naming the plan's total, the device's room and what hint() says would fit; or for a
    model the checkpoint format cannot hold. (The table has a few dozen rows per layer and model.n_layer is at
    most 1024: cheap at any sizes.)"""
    total = sum(role_bytes(bufs, prec).values())
    if room is not None and total > room - margin:
        less = f" less train.memory_margin {margin / GIB:.2f} GiB" if margin else ""
        fix = hint() if hint else "lower the model's sizes (model.d_model, model.n_layer, model.seq_len)"
        raise PlanError(
            f"the memory plan needs {total:,} bytes but the device ({device}) has {max(0, room - margin):,}"
            f" bytes for it ({total / GIB:.2f} GiB against {room / GIB:.2f} GiB available{less}); {fix}"
        )
    n = params.n_params(m)
    if n > CKPT_MAX_PARAMS:
        raise PlanError(
            f"the model has {n:,} parameters; the checkpoint format holds at most {CKPT_MAX_PARAMS:,}; "
            "lower the model's sizes"
        )
    return bufs


MAX_MICRO_BATCH = 1 << 20  # the largest micro-batch the fitting search considers (sequences)


def largest_fitting(
    plan_bytes: Callable[[int], int], sequences: int, available: int, below: int | None = None
) -> tuple[int, int] | None:
    """(B, its plan's bytes) for the largest micro-batch B that divides `sequences` (the step's, so that n_micro =
    sequences / B keeps them; n_micro at most INT_MAX), is under `below` if given, and whose plan_bytes(B) fits
    `available`; None where not even B = 1 does. The divisors are tried from the largest down: a plan grows with B
    but not strictly (the loss head's logits chunk can shrink as B passes its budget). A number up to 2^20 has at
    most 240 divisors."""
    top = min(sequences, MAX_MICRO_BATCH, below - 1 if below is not None else sequences)
    for b in range(top, 0, -1):
        if sequences % b == 0 and sequences // b <= INT_MAX and (nbytes := plan_bytes(b)) <= available:
            return b, nbytes
    return None


def cpu_logits_rows(m: ModelConfig, B: int, budget_bytes: int = 8 << 20) -> int:
    """R for the (R, V) logits chunk of the loss head on the NumPy backend: fp32 rows up to an 8 MB budget (its
    matmuls run as fast in small chunks); the last chunk may be short."""
    return max(1, min(B * m.seq_len, budget_bytes // (4 * m.vocab_size)))


def gpu_logits_rows(m: ModelConfig, B: int, itemsize: int, budget_bytes: int = 512 << 20) -> int:
    """R on the GPU: N = B*T halved until a chunk of `itemsize`-byte elements fits the budget (big enough for
    full-speed GEMMs), so the chunks are equal and none is short."""
    R = B * m.seq_len
    while R > 1 and R * m.vocab_size * itemsize > budget_bytes:
        R = (R + 1) // 2
    return R


def plan(
    m: ModelConfig, t: TrainConfig, prec: Precision, R: int, backend_rows: list[Buf] | tuple[Buf, ...] = ()
) -> list[Buf]:
    """Every buffer of a training step for micro-batch t.micro_batch with a (R, V) logits chunk in precision prec,
    then the backend's own rows (launcher scratch, runtime bytes, the optimizer's scratch: engine/optim.py)."""
    B, U, T, V = t.micro_batch, t.n_micro, m.seq_len, m.vocab_size
    N = B * T
    bufs = []
    roles = ["params", "grads", "adam_m", "adam_v"] + (["compute_params"] if prec.compute_copy else [])
    for role in roles:
        kind = "compute" if role == "compute_params" else "f32"
        bufs += [Buf(name, shape, role, kind) for name, shape in params.param_shapes(m)]
    n = params.n_params(m)
    optim = [
        ("decay_mask", (n,), "u8"),  # 1 where AdamW decays (matrices), 0 for LN params
        ("norm_partials", ((n + NORM_BLOCK - 1) // NORM_BLOCK,), "f32"),
        # written by the host before each step: one row per optimizer group under Muon (engine/optim.py)
        ("hyper", (3, HYPER) if t.optimizer == "muon" else (HYPER,), "f32"),
        ("loss_scale", (1,), "f32"),  # the fp16 loss scale the loss head multiplies its gradient by (else 1)
        ("report", (2 + U,), "f32"),  # [mean loss, raw grad norm, each micro-batch's loss]: read after each step
        ("loss_sum", (2,), "f32"),  # evaluation: (sum of losses, count) of one micro-batch
    ]
    bufs += [Buf(name, shape, "optim", kind) for name, shape, kind in optim]
    bufs += prec.rows(m, N, weight_maxima=t.optimizer == "adamw")  # one AdamW call over every parameter
    acts, scratch = _block_rows(m, t, prec, B)
    bufs += [Buf(name, shape, "acts", kind) for name, shape, kind in acts]
    # compute dtype: on the GPU the logits GEMMs then run bf16/fp16 in and out (the CE kernels reduce in fp32)
    bufs += [Buf(name, shape, "scratch", "compute") for name, shape in [*scratch, ("logits", (R, V))]]
    bufs += [Buf(name, shape, "tables", "f32") for name, shape in tables(m)]
    bufs += [Buf("tokens", (U, B, T), "inputs", "i32"), Buf("targets", (U, B, T), "inputs", "i32")]
    bufs += _mask_rows(m, B, window_planned(m, t))
    return bufs + list(backend_rows)


def window_planned(m: ModelConfig, t: TrainConfig | None = None) -> bool:
    """Whether attention reads a window (the plan's `attn_window`): the model narrows it (model.attn_window), or the
    training schedule does (train.attn_window_start; t None: an inference plan, the model's window alone)."""
    return m.attn_window > 0 or (t is not None and t.attn_window_start > 0)


def _mask_rows(m: ModelConfig, B: int, window: bool) -> list[Buf]:
    """The narrower attention mask's buffers (ops/attention.py): the window (1,) int32, the host's to write (a
    training step's from optim.attn_window_at, the model's at inference), and with model.doc_mask each position's
    document start (B, T) int32, made from the tokens by every forward (doc_starts) and read by its backward."""
    rows = [Buf("attn_window", (1,), "inputs", "i32")] if window else []
    return rows + ([Buf("doc_start", (B, m.seq_len), "acts", "i32")] if m.doc_mask >= 0 else [])


Rows = list[tuple[str, tuple[int, ...], str]]


def _block_rows(m: ModelConfig, t: TrainConfig, prec: Precision, B: int) -> tuple[Rows, list[tuple[str, tuple]]]:
    """The saved activations (name, shape, kind) and the scratch (name, shape) of a micro-batch of the model's block
    family. The modern block (engine/model.py) has no norm means (its RMSNorm keeps rstd alone); it adds the embedding
    before its norm and the QK-norm's per-head rstd, and keeps ReLU^2's output as GPT-2 keeps GELU's (per layer, or
    with train.recompute_gelu one scratch that backward refills from h; neither where fp8's cast computes it), but
    keeps h only where backward needs it (pre_activation_kept)."""
    C, L, NH, T = m.d_model, m.n_layer, m.n_head, m.seq_len
    N = B * T
    modern = m.block == "modern"
    planned = prec.act_planned  # the MLP's activation has a buffer (not where fp8's cast computes it)
    saved = act_output_saved(prec, t)

    def stats(name: str, shape: tuple[int, ...]) -> Rows:
        """A norm's saved statistics: LayerNorm's mean and rstd, RMSNorm's rstd alone."""
        return [*([] if modern else [(f"{name}_mean", shape, "f32")]), (f"{name}_rstd", shape, "f32")]

    acts = [
        # modern: wte[tokens] before its RMSNorm (the norm's backward reads it), and that norm's rstd
        *([("emb", (N, C), "compute"), ("emb_rstd", (N,), "f32")] if modern else []),
        ("resid", (L + 1, N, C), "compute"),  # residual stream entering each layer; resid[L] feeds ln_f
        ("ln1", (L, N, C), "compute"),
        *stats("ln1", (L, N)),
        ("qkv", (L, 3, N, C), "compute"),  # modern: q, k as attention reads them, QK-normed and rotated in place
        # modern: the QK-norm's rstd per head (its backward recomputes the rest)
        *([("qk_rstd", (L, 2, N, NH), "f32")] if modern else []),
        ("att", (L, N, C), "compute"),  # attention output before W_O (W_O's backward needs it)
        ("att_lse", (L, B, NH, T), "f32"),  # flash-style: the only attention statistic kept
        ("resid2", (L, N, C), "compute"),  # residual stream between attention and MLP
        ("ln2", (L, N, C), "compute"),
        *stats("ln2", (L, N)),
        # the MLP's pre-activation: not the modern block's where its ReLU^2's output is saved (its act' reads that)
        *([("h", (L, N, 4 * C), "compute")] if pre_activation_kept(m, prec) or not saved else []),
        *([("a", (L, N, 4 * C), "compute")] if saved else []),  # gelu(h) or relu(h)^2, read by dW_2's GEMM
        ("lnf", (N, C), "compute"),
        *stats("lnf", (N,)),
        ("losses", (N,), "f32"),
        ("ce_lse", (N,), "f32"),
        ("dlosses", (N,), "f32"),
    ]
    scratch = [
        ("proj", (N, C)),  # output of W_O and of the MLP before the residual add
        *([("a", (N, 4 * C))] if planned and not saved else []),  # the MLP's activation, recomputed
        ("dh", (N, 4 * C)),
        ("dresid", (N, C)),  # gradient of the residual stream, updated in place from the top layer down
        ("dln", (N, C)),  # modern: also the embedding's gradient at the end (its norm's backward adds into it)
        ("datt", (N, C)),
        ("dqkv", (3, N, C)),
    ]
    kept, waiting = skip_rows(m)
    # model.skips: the kept stream that its receiving layer's add would overwrite (k = L/2: layer k-1's output is
    # layer k's input), and the receiving layers' input gradients, each waiting for backward to reach its kept stream
    acts += [("skip_kept", (N, C), "compute")] if kept else []
    scratch += [("dskip", (waiting, N, C))] if waiting else []
    return acts, scratch


def skip_rows(m: ModelConfig) -> tuple[bool, int]:
    """What a training plan adds for model.skips = k (engine/model.py says how they are used): whether skip k-1's kept
    stream needs a copy of its own, and how many receiving layers' input gradients wait for backward to reach their
    kept stream. The kept stream of skip j is the residual stream after layer j, which training saves anyway
    (resid[j+1]), unless layer j+1 receives a skip itself and adds into it in place: only skip k-1 where 2k = L. Skip
    j's input gradient (at layer L-1-j) is needed again only where backward reaches the stream after layer j, which
    has layers between them unless L-1-j = j+1 (that same skip): min(k, (L-1) // 2) of them."""
    k, L = m.skips, m.n_layer
    return k > 0 and 2 * k == L, min(k, (L - 1) // 2)


def tables(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Constant fp32 tables the model reads, filled once when the arena is made: the modern block's rotary cos and
    sin (2, T, head_dim / 2) (ops/qkrope.py rope_tables)."""
    return [("rope", (2, m.seq_len, m.head_dim // 2))] if m.block == "modern" else []


def inference_plan(
    m: ModelConfig, prec: Precision, B: int, R: int, backend_rows: list[Buf] | tuple[Buf, ...] = (), cache: bool = True
) -> list[Buf]:
    """Every buffer of the inference step (model.gpt_infer, and the decode step model.gpt_decode) for up to B
    sequences of up to seq_len tokens: the weights, the KV cache and the decode step's positions and cache rows
    (unless cache is False: a plan that only scores windows from position 0, whose batches may then be any b x t of
    at most N tokens), and one layer's activations for N = B*T rows, which every layer reuses (nothing is saved for
    a backward); then the backend's own rows."""
    C, L, NH, T, V = m.d_model, m.n_layer, m.n_head, m.seq_len, m.vocab_size
    N = B * T
    roles = ["params"] + (["compute_params"] if prec.compute_copy else [])
    bufs = [
        Buf(name, shape, role, "compute" if role == "compute_params" else "f32")
        for role in roles
        for name, shape in params.param_shapes(m)
    ]
    modern = m.block == "modern"
    bufs += [Buf("loss_sum", (2,), "optim", "f32")] + prec.rows(m, N, weight_maxima=False)
    stats = [("ln_rstd", (N,)), ("qk_rstd", (2, N, NH))] if modern else [("ln_mean", (N,)), ("ln_rstd", (N,))]
    stats += [("att_lse", (B * NH * T,)), ("losses", (N,)), ("ce_lse", (N,))]
    bufs += [Buf(name, shape, "scratch", "f32") for name, shape in stats]
    scratch = [
        ("x", (N, C)),  # the residual stream entering a layer, then leaving it
        ("x2", (N, C)),  # the residual stream between attention and MLP
        ("ln", (N, C)),  # every LayerNorm's output
        ("qkv", (3, N, C)),
        ("att", (N, C)),
        ("proj", (N, C)),
        *([("h", (N, 4 * C))] if pre_activation_kept(m, prec) else []),  # the modern block's W_1 writes a alone
        *([("a", (N, 4 * C))] if prec.act_planned else []),
        ("logits", (R, V)),  # the loss head's chunk
        ("next_logits", (B, V)),  # each sequence's next-token logits
        # model.skips: the stream after each of the first k layers, kept for a later layer's skip (x is reused)
        *([("skips", (m.skips, N, C))] if m.skips else []),
    ]
    bufs += [Buf(name, shape, "scratch", "compute") for name, shape in scratch]
    bufs += [Buf(name, shape, "tables", "f32") for name, shape in tables(m)]
    bufs += [Buf("kv", (L, 2, B, T, C), "kv_cache", "compute")] if cache else []
    bufs += [Buf("kv_tokens", (B, T), "kv_cache", "i32")] if cache and m.doc_mask >= 0 else []
    bufs += [Buf("tokens", (B, T), "inputs", "i32"), Buf("targets", (B, T), "inputs", "i32")]
    bufs += _mask_rows(m, B, window_planned(m))
    # the decode step's rows (model.gpt_decode), read on the device: a step of b rows finds their tokens, positions
    # and cache rows in decode_rows[:b], [b:2b] and [2b:3b], so that one copy brings all three
    # (infer.InferState.decode); and each row's greedy token, the argmax of its logits, which the host reads instead
    bufs += [Buf("decode_rows", (3 * B,), "inputs", "i32"), Buf("next_ids", (B,), "scratch", "i32")] if cache else []
    # a window whose rows from position 0 sit in cache rows apart: each token's position and cache row, for the one
    # decode_kv_write a layer that puts their keys and values there (model._scattered)
    bufs += [Buf("window_rows", (2 * N,), "inputs", "i32")] if cache else []
    return bufs + list(backend_rows)


def act_output_saved(prec: Precision, t: TrainConfig) -> bool:
    """Whether a = act(h) (GELU's or ReLU^2's) is kept per layer from forward to backward (saved activations, L x
    (N, 4C)): W_2's weight gradient reads the forward's own a, and the activation's backward pass writes dh alone. With
    train.recompute_gelu the plan has one (N, 4C) scratch instead, and backward recomputes a from h; where the
    precision casts the activation straight to its operand (fp8 on the GPU: Precision.act_planned) there is
    neither."""
    return prec.act_planned and not t.recompute_gelu


def pre_activation_kept(m: ModelConfig, prec: Precision) -> bool:
    """Whether the MLP writes h = x @ W_1 into a buffer of its own, where the plan has a = act(h) (act_output_saved):
    GELU's backward reads h (the GPT-2 block), and so does fp8's cast of W_1's output gradient (Precision.dact_in_cast,
    either block), which on the GPU also computes a from h (Precision.act_planned False). The modern block's ReLU^2
    elsewhere reads its derivative from a (2 sqrt(a): ops/relu2.py), so W_1's GEMM writes a alone and h has no buffer,
    L x (N, 4C) less in training (2.4 GB in bf16 for ANDREA-120M-MODERN at micro-batch 32) and one (N, 4C) less at
    inference. With train.recompute_gelu a is not saved and training keeps h again (the recomputed a comes from it)."""
    return m.block != "modern" or not prec.act_planned or prec.dact_in_cast


def kind_sizes(prec: Precision) -> dict[str, int]:
    """Bytes per element of each kind in a precision."""
    return {**KIND_BYTES, "compute": COMPUTE_BYTES[prec.compute]}


def _round(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def roles_of(bufs: list[Buf]) -> list[str]:
    """The plan's roles in arena order: ROLES, with the precision's own (the roles ROLES does not name, from its
    rows) in the order the plan first lists them where ROLES says "precision"."""
    own = list(dict.fromkeys(b.role for b in bufs if b.role not in ROLES))
    at = ROLES.index("precision")
    return [*ROLES[:at], *own, *ROLES[at + 1 :]]


def layout(bufs: list[Buf], sizes: dict[str, int]) -> tuple[dict[tuple[str, str], int], dict[str, int], int]:
    """Where everything lies in the arena: the byte offset of every buffer (by (role, name)), the bytes of every
    role (alignment included) and the arena's size. Groups of one (role, kind) follow the roles' order (roles_of),
    each starting on ALIGN bytes; parameter-shaped roles are packed, other views start on ALIGN bytes; the whole is
    rounded up to ARENA_GRANULE. "runtime" rows take no arena bytes."""
    offsets: dict[tuple[str, str], int] = {}
    order = roles_of(bufs)
    role_sizes = {role: 0 for role in order}
    groups: dict[tuple[str, str], list[Buf]] = {}
    for b in bufs:
        if b.role != "runtime":
            groups.setdefault((b.role, b.kind), []).append(b)
    end = 0
    for role, kind in sorted(groups, key=lambda key: order.index(key[0])):
        start = end
        for b in groups[(role, kind)]:
            offsets[(role, b.name)] = end
            size = b.numel * sizes[kind]
            end += size if role in PACKED else _round(size)
        end = _round(end)
        role_sizes[role] += end - start
    total = -(-end // ARENA_GRANULE) * ARENA_GRANULE
    role_sizes["rounding"] = total - end
    return offsets, role_sizes, total


def role_bytes(bufs: list[Buf], prec: Precision) -> dict[str, int]:
    """Bytes per role, alignment included: they add up to the arena plus the runtime's rows."""
    sizes = kind_sizes(prec)
    _, out, _ = layout(bufs, sizes)
    out["runtime"] = sum(b.numel * sizes[b.kind] for b in bufs if b.role == "runtime")
    return out


def format_plan(bufs: list[Buf], prec: Precision) -> str:
    """The table printed before the first step: every role's bytes and their total."""
    sizes = role_bytes(bufs, prec)
    total = sum(sizes.values())
    lines = [f"memory plan ({prec.label()} compute, fp32 master weights)", f"{'buffer':<22}{'bytes':>16}{'MiB':>12}"]
    for role in sizes:
        if sizes[role] or role in ("params", "grads", "adam_m", "adam_v"):
            label = LABELS.get(role, role.replace("_", " "))
            lines.append(f"{label:<22}{sizes[role]:>16,}{sizes[role] / 2**20:>12.2f}")
    lines.append(f"{'total':<22}{total:>16,}{total / 2**20:>12.2f}")
    return "\n".join(lines)


class Device(Protocol):
    """What the Arena needs of a backend: element sizes, one zeroed byte allocation, and typed views into it."""

    kind_bytes: dict[str, int]

    def alloc(self, nbytes: int) -> Any: ...

    def view(self, pool: Any, offset: int, shape: tuple[int, ...], kind: str) -> Any: ...


class Arena:
    """One allocation for the whole plan; `self[name]` is a view with the planned shape."""

    def __init__(self, bufs: list[Buf], device: Device):
        self.bufs = bufs
        offsets, _, self.nbytes = layout(bufs, device.kind_bytes)
        try:
            self.pool = device.alloc(self.nbytes)
        except MemoryError as e:
            raise PlanError(
                f"the memory plan needs {self.nbytes:,} bytes in one allocation, which failed ({e}); "
                "lower train.micro_batch or the model's sizes"
            ) from None
        self.views = {
            key: device.view(self.pool, off, b.shape, b.kind)
            for b in bufs
            if (key := (b.role, b.name)) in offsets
            for off in [offsets[key]]
        }
        self._by_name = {name: view for (role, name), view in self.views.items() if role not in PACKED}
        self._flat = {}  # the packed roles as one flat array each, n_params long
        n = sum(b.numel for b in bufs if b.role == "params")
        for role in PACKED:
            first = next((b for b in bufs if b.role == role), None)
            if first is not None:
                self._flat[role] = device.view(self.pool, offsets[(role, first.name)], (n,), first.kind)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def get(self, name: str) -> Any:
        """The buffer, or None where this plan has none (a row only some backends or precisions plan)."""
        return self._by_name.get(name)

    def __getitem__(self, name: str) -> Any:
        try:
            return self._by_name[name]
        except KeyError:
            raise PlanError(f"the memory plan has no buffer {name!r}") from None

    def flat(self, role: str) -> Any:
        """The flat array of a parameter-shaped role: n_params long, in the canonical order."""
        return self._flat[role]
