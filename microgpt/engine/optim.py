"""The optimizers' side of the step that is not an op: the lr schedule, and what each optimizer group reads.

train.optimizer "adamw" updates every parameter with AdamW (ops/adamw.py) at the schedule's lr. "muon" (the modern
block's) gives every block matrix to Muon (ops/muon.py: Newton-Schulz orthogonalised Nesterov momentum, its
momentum in the checkpoint's m, v zero there) and keeps AdamW for the rest: the embedding at train.lr and the untied
head at train.head_lr. The schedule scales every group's lr alike.
"""

from __future__ import annotations

import math
from typing import Any


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


def muon_momentum(step: int, t: Any) -> float:
    """Muon's momentum at 0-based step: from train.muon_momentum_start up to train.muon_momentum, linearly over
    train.muon_momentum_warmup steps of the schedule (a fresh momentum buffer is noisy; high momentum then would
    carry that noise)."""
    done = min(1.0, max(0, step - t.schedule_start) / max(1, t.muon_momentum_warmup))
    return t.muon_momentum_start + (t.muon_momentum - t.muon_momentum_start) * done


def group_lrs(lr: float, t: Any) -> dict[str, float]:
    """Each group's lr at this step, from the schedule's lr (lr_at): the schedule's factor lr / t.lr times each
    group's peak: "adamw" (the embedding, and every parameter under train.optimizer "adamw"), "head" (the modern
    block's untied head: train.head_lr, or train.lr when 0) and "muon"."""
    f = lr / t.lr
    return {"adamw": lr, "head": f * (t.head_lr or t.lr), "muon": f * t.muon_lr}
