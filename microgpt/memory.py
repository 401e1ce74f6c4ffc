"""The memory plan: every buffer the engine touches, as a table, allocated once at start.

A plan is a list of Buf(name, shape, role, kind). Roles group buffers by lifetime and purpose:

    params, grads, adam_m, adam_v   fp32, one flat array each, in the canonical parameter order
    optim                           the weight-decay mask and the grad-norm partial sums
    acts                            saved activations: written in forward, read in backward
    scratch                         per-layer temporaries and activation gradients, reused by every layer
    inputs                          the micro-batch's tokens and targets

Kinds give the element type: "f32" (always float32), "compute" (the run's compute dtype: float32
on the NumPy backend, bf16/fp16 on the GPU), "i32", "u8". Each (role, kind) group is ONE allocation and every
buffer is a named view into it, so nothing is allocated during training, a flat grads array makes
clipping and AdamW one call each, and the plan printed before the first step is the memory used.

Shapes: B micro-batch, T seq_len, C d_model, L n_layer, NH n_head, V vocab_size, N = B*T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from microgpt.config import ModelConfig

ALIGN = 64  # elements; activation views start on 128-byte (16-bit) or 256-byte (fp32) boundaries
ROLES = ("params", "grads", "adam_m", "adam_v", "optim", "acts", "scratch", "inputs")
KIND_BYTES = {"f32": 4, "i32": 4, "u8": 1, "compute": {"fp32": 4, "bf16": 2, "fp16": 2}}


@dataclass(frozen=True)
class Buf:
    name: str
    shape: tuple[int, ...]
    role: str
    kind: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def param_shapes(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """The canonical parameter order (docs/ANDREA.md): arena, checkpoint, optimizer and export share it."""
    C, V, T = m.d_model, m.vocab_size, m.seq_len
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte", (V, C)), ("wpe", (T, C))]
    for layer in range(m.n_layer):
        h = f"h{layer}."
        shapes += [(h + "ln1_w", (C,)), (h + "ln1_b", (C,))]
        shapes += [(h + "w_q", (C, C)), (h + "w_k", (C, C)), (h + "w_v", (C, C)), (h + "w_o", (C, C))]
        shapes += [(h + "ln2_w", (C,)), (h + "ln2_b", (C,)), (h + "w_1", (C, 4 * C)), (h + "w_2", (4 * C, C))]
    shapes += [("lnf_w", (C,)), ("lnf_b", (C,))]
    return shapes


def n_params(m: ModelConfig) -> int:
    return sum(math.prod(s) for _, s in param_shapes(m))


def default_logits_rows(m: ModelConfig, B: int, budget_bytes: int = 8 << 20) -> int:
    """Rows of the cross-entropy logits chunk: full-vocabulary fp32 logits for R rows at a time."""
    return max(1, min(B * m.seq_len, budget_bytes // (4 * m.vocab_size)))


NORM_BLOCK = 1 << 16  # elements per grad-norm partial sum (the first of the two reduction stages)


GPU_LOGITS_BUDGET = 512 << 20  # bytes: on the GPU, logits chunks big enough for full-speed GEMMs


def halved_logits_rows(m: ModelConfig, B: int, itemsize: int, budget_bytes: int = GPU_LOGITS_BUDGET) -> int:
    """The triton backend's R: N halved until an (R, V) chunk of `itemsize` bytes fits (equal chunks, none short)."""
    R = B * m.seq_len
    while R > 1 and R * m.vocab_size * itemsize > budget_bytes:
        R = (R + 1) // 2
    return R


def plan(m: ModelConfig, B: int, logits_rows: int | None = None) -> list[Buf]:
    """Every buffer of a training step for micro-batch B."""
    C, L, NH, T, V = m.d_model, m.n_layer, m.n_head, m.seq_len, m.vocab_size
    N = B * T
    R = logits_rows or default_logits_rows(m, B)
    bufs = []
    for role in ("params", "grads", "adam_m", "adam_v"):
        bufs += [Buf(name, shape, role, "f32") for name, shape in param_shapes(m)]
    n = n_params(m)
    bufs.append(Buf("decay_mask", (n,), "optim", "u8"))  # 1 where AdamW decays (matrices), 0 for LN params
    bufs.append(Buf("norm_partials", ((n + NORM_BLOCK - 1) // NORM_BLOCK,), "optim", "f32"))
    bufs.append(Buf("norm", (1,), "optim", "f32"))
    act = [
        ("resid", (L + 1, N, C), "compute"),  # residual stream entering each layer; resid[L] feeds ln_f
        ("ln1", (L, N, C), "compute"),
        ("ln1_mean", (L, N), "f32"),
        ("ln1_rstd", (L, N), "f32"),
        ("qkv", (L, 3, N, C), "compute"),
        ("att", (L, N, C), "compute"),  # attention output before W_O (W_O's backward needs it)
        ("att_lse", (L, B, NH, T), "f32"),  # flash-style: the only attention statistic kept
        ("resid2", (L, N, C), "compute"),  # residual stream between attention and MLP
        ("ln2", (L, N, C), "compute"),
        ("ln2_mean", (L, N), "f32"),
        ("ln2_rstd", (L, N), "f32"),
        ("h", (L, N, 4 * C), "compute"),  # pre-GELU activation; GELU output is recomputed in backward
        ("lnf", (N, C), "compute"),
        ("lnf_mean", (N,), "f32"),
        ("lnf_rstd", (N,), "f32"),
        ("losses", (N,), "f32"),
        ("ce_lse", (N,), "f32"),
        ("dlosses", (N,), "f32"),
    ]
    bufs += [Buf(name, shape, "acts", kind) for name, shape, kind in act]
    scratch = [
        ("proj", (N, C)),  # output of W_O and of the MLP before the residual add
        ("a", (N, 4 * C)),  # GELU output (forward and backward recompute)
        ("dh", (N, 4 * C)),
        ("dresid", (N, C)),  # gradient of the residual stream, updated in place from the top layer down
        ("dln", (N, C)),
        ("datt", (N, C)),
        ("dqkv", (3, N, C)),
    ]
    bufs += [Buf(name, shape, "scratch", "compute") for name, shape in scratch]
    # compute dtype: on the GPU the logits GEMMs then run bf16/fp16 in and out (the CE kernels reduce in fp32)
    bufs.append(Buf("logits", (R, V), "scratch", "compute"))
    bufs += [Buf("tokens", (B, T), "inputs", "i32"), Buf("targets", (B, T), "inputs", "i32")]
    return bufs


def kind_bytes(kind: str, precision: str) -> int:
    size = KIND_BYTES[kind]
    return size[precision] if isinstance(size, dict) else size


PACKED = ("params", "grads", "adam_m", "adam_v")  # contiguous: the flat array IS the checkpoint's layout


def _span(b: Buf) -> int:
    """Elements a view occupies in its allocation: packed for parameter-shaped roles, aligned otherwise."""
    return b.numel if b.role in PACKED else (b.numel + ALIGN - 1) // ALIGN * ALIGN


def group_sizes(bufs: list[Buf]) -> dict[tuple[str, str], int]:
    """Elements per (role, kind) allocation."""
    sizes: dict[tuple[str, str], int] = {}
    for b in bufs:
        sizes[(b.role, b.kind)] = sizes.get((b.role, b.kind), 0) + _span(b)
    return sizes


def role_bytes(bufs: list[Buf], precision: str) -> dict[str, int]:
    out = {role: 0 for role in ROLES}
    for (role, kind), n in group_sizes(bufs).items():
        out[role] += n * kind_bytes(kind, precision)
    return out


def format_plan(bufs: list[Buf], precision: str, extras: dict[str, int] | None = None) -> str:
    """The table printed before the first step; extras: the backend's device bytes beside the buffers."""
    sizes = role_bytes(bufs, precision)
    extras = extras or {}
    total = sum(sizes.values()) + sum(extras.values())
    label = {
        "optim": "optimizer scratch",
        "acts": "saved activations",
        "scratch": "scratch + act grads",
        "adam_m": "adam m",
        "adam_v": "adam v",
    }
    lines = [f"memory plan ({precision} compute, fp32 master weights)", f"{'buffer':<22}{'bytes':>16}{'MiB':>12}"]
    for role in ROLES:
        lines.append(f"{label.get(role, role):<22}{sizes[role]:>16,}{sizes[role] / 2**20:>12.2f}")
    for name, n in extras.items():
        lines.append(f"{name:<22}{n:>16,}{n / 2**20:>12.2f}")
    lines.append(f"{'total':<22}{total:>16,}{total / 2**20:>12.2f}")
    return "\n".join(lines)


class Arena:
    """One allocation per (role, kind); `self[name]` is a view with the planned shape.

    `alloc(numel, kind)` returns a flat zeroed array (NumPy or torch): the backend's allocator decides the
    element type of each kind.
    """

    def __init__(self, bufs: list[Buf], alloc: Callable[[int, str], Any]):
        self.bufs = bufs
        self.flat: dict[tuple[str, str], Any] = {key: alloc(n, key[1]) for key, n in group_sizes(bufs).items()}
        self.views: dict[tuple[str, str], Any] = {}
        offsets = {key: 0 for key in self.flat}
        for b in bufs:
            key = (b.role, b.kind)
            off = offsets[key]
            self.views[(b.role, b.name)] = self.flat[key][off : off + b.numel].reshape(b.shape)
            offsets[key] = off + _span(b)

    def role(self, role: str) -> dict[str, Any]:
        """name -> view for one role, in plan order (for params: the canonical order)."""
        return {b.name: self.views[(role, b.name)] for b in self.bufs if b.role == role}

    def __getitem__(self, name: str) -> Any:
        for role in ("optim", "acts", "scratch", "inputs"):
            if (role, name) in self.views:
                return self.views[(role, name)]
        raise KeyError(name)

    def flat_f32(self, role: str) -> Any:
        """The flat fp32 array of params, grads, adam_m or adam_v: n_params long, in the canonical order."""
        return self.flat[(role, "f32")]
