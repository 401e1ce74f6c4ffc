"""The optimizers' side of the step that is not an op: the lr schedule, and what each optimizer group reads.

train.optimizer "adamw" updates every parameter with AdamW (ops/adamw.py) at the schedule's lr. "muon" (the modern
block's) gives every block matrix to Muon (ops/muon.py: Newton-Schulz orthogonalised Nesterov momentum, its
momentum in the checkpoint's m, v zero there) and keeps AdamW for the rest: the embedding at train.lr, and the untied
head and the skips' scalars (model.skips) at train.head_lr. The schedule scales every group's lr alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from microgpt.config import ModelConfig, TrainConfig
from microgpt.engine import params
from microgpt.engine.memory import Buf
from microgpt.ops.muon import MuonGroup, MuonScratch, muon_groups

# the rows of the step's `hyper` (memory.HYPER floats each) under train.optimizer "muon": AdamW's embedding group,
# AdamW's head group, Muon's; under "adamw" hyper is one row, the first
HYPER_ROWS = {"adamw": 0, "head": 1, "muon": 2}


def schedule_end(t: Any) -> int:
    """The step the lr schedule ends at: train.schedule_steps, or train.steps when that is 0."""
    return t.schedule_steps or t.steps


def lr_at(step: int, t: Any) -> float:
    """Linear warmup to t.lr over warmup_steps, then (train.schedule "cosine") cosine decay to t.min_lr at
    schedule_end(t), or ("warmdown") t.lr held until the last warmdown_frac of the schedule and a straight line down
    to t.min_lr at its end; past the end, t.min_lr. step is 0-based.

    The schedule starts at t.schedule_start (0 for a plain run; a phase's first step under the proxy), so a
    polish phase gets its own warmup and decay instead of the tail of the pretraining one. A run trained past
    its schedule's end (`--steps` beyond a finished run: a resume keeps the schedule, Trainer.load) continues at
    the schedule's final lr, never back up.
    """
    step, steps = step - t.schedule_start, schedule_end(t) - t.schedule_start
    warmup = min(t.warmup_steps, steps)
    if step < warmup:
        return t.lr * (step + 1) / warmup
    if t.schedule == "warmdown":
        start = max(warmup, steps - round(t.warmdown_frac * steps))
        progress = min(1.0, max(0, step - start) / max(1, steps - start))
        return t.lr + (t.min_lr - t.lr) * progress
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))


def keep_schedule(t: Any, saved: dict[str, Any]) -> None:
    """A resume keeps the lr schedule its checkpoint was trained on (`saved`: the train section of its sidecar's
    config): with --steps beyond it (a finished run trained on), the steps past its end run at its final lr (lr_at).
    Not when train.schedule_steps is set (a deliberate new schedule) or the schedule starts elsewhere (the proxy's
    next phase: a schedule of its own). Sets t.schedule_steps."""
    end = saved.get("schedule_steps") or saved.get("steps")
    if t.schedule_steps or saved.get("schedule_start", 0) != t.schedule_start or not isinstance(end, int):
        return
    if end != t.steps and end > t.schedule_start:
        t.schedule_steps = end


def muon_momentum(step: int, t: Any) -> float:
    """Muon's momentum at 0-based step: from train.muon_momentum_start up to train.muon_momentum, linearly over
    train.muon_momentum_warmup = W steps of the schedule (a fresh momentum buffer is noisy; high momentum then would
    carry that noise): mu = start + (final - start) * min(1, s / W) at s = step - train.schedule_start, so the W steps
    s = 0 .. W - 1 run below the final value; W = 0: no warmup, the final value from the first step."""
    W, s = t.muon_momentum_warmup, max(0, step - t.schedule_start)
    done = min(1.0, s / W) if W > 0 else 1.0
    return t.muon_momentum_start + (t.muon_momentum - t.muon_momentum_start) * done


def attn_window_at(step: int, m: ModelConfig, t: Any) -> int:
    """The attention window (positions a query sees, itself included) of 0-based global step `step`, a pure function
    of it (a resume repeats it): with train.attn_window_start = w0 and attn_window_every = E, min(W, w0 (1 + step //
    E)), else W throughout; W = model.attn_window, or model.seq_len where that is 0 (the whole sequence). The plan
    has the window's buffer only where the model or the schedule narrows attention (window_planned)."""
    final = m.attn_window or m.seq_len
    if not t.attn_window_start:
        return final
    return min(final, t.attn_window_start * (1 + step // t.attn_window_every))


def group_lrs(lr: float, t: Any) -> dict[str, float]:
    """Each group's lr at this step, from the schedule's lr (lr_at): the schedule's factor lr / t.lr times each
    group's peak: "adamw" (the embedding, and every parameter under train.optimizer "adamw"), "head" (the modern
    block's untied head: train.head_lr, or train.lr when 0) and "muon"."""
    f = lr / t.lr
    return {"adamw": lr, "head": f * (t.head_lr or t.lr), "muon": f * t.muon_lr}


def groups(m: ModelConfig) -> tuple[MuonGroup, ...]:
    """Muon's groups: the block matrices (params.matrices) by stored shape."""
    return muon_groups((offset, *shape) for _, offset, shape in params.matrices(m))


def scratch(m: ModelConfig, t: TrainConfig, muon_scratch: Callable[..., list[MuonScratch]]) -> list[MuonScratch]:
    """The planned buffers the optimizer needs beyond m and v, as the backend's muon_scratch lists them for this
    model's groups (Muon's Newton-Schulz scratch, and what its kernels keep), or none under AdamW alone."""
    return muon_scratch(groups(m)) if t.optimizer == "muon" else []


def rows(m: ModelConfig, t: TrainConfig, muon_scratch: Callable[..., list[MuonScratch]]) -> list[Buf]:
    """scratch() as rows of the memory plan (role "optim")."""
    return [Buf(s.buffer, (s.numel,), "optim", s.kind) for s in scratch(m, t, muon_scratch)]


def adamw_ranges(m: ModelConfig) -> list[tuple[str, int, int]]:
    """Under train.optimizer "muon": what AdamW keeps, as (hyper row, first, end) element ranges of the flat arrays:
    everything before the first block matrix (the embedding and value embeddings: "adamw") and after the last (the
    untied head: "head"), the skips' scalars apart at the head's row (train.head_lr: the recipe's small AdamW lr; a
    scalar that scales a whole residual stream moves by about lr a step, too far at the embedding's). The modern block
    has no other parameter between its matrices (params.MODERN)."""
    mats = params.matrices(m)
    first, (_, last, shape) = mats[0][1], mats[-1]
    head = ("head", last + math.prod(shape), params.n_params(m))
    if not m.skips:
        return [("adamw", 0, first), head]
    skips = params.param_offsets(m)["skip_w"]
    return [("adamw", 0, skips), ("head", skips, skips + m.skips), head]


def hyper_rows(lr: float, t: TrainConfig, step: int, gscale: float) -> list[list[float]]:
    """The step's host values, one row per group (HYPER_ROWS; the plan's `hyper` has a row each): AdamW's [lr,
    1 - beta1^n, 1 - beta2^n, gscale] for its step n = step + 1, at each AdamW group's lr; Muon's [lr, momentum,
    gscale, weight decay]."""
    lrs, n = group_lrs(lr, t), step + 1
    adam = [[lrs[group], 1 - t.beta1**n, 1 - t.beta2**n, gscale] for group in ("adamw", "head")]
    muon = [lrs["muon"], muon_momentum(step, t), gscale, t.muon_weight_decay]
    return [*adam, muon] if t.optimizer == "muon" else adam[:1]
