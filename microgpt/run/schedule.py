"""The learning-rate schedule: linear warmup, cosine decay to a floor (llm.c's get_learning_rate with min_lr), and
which schedule a resumed run keeps."""

from __future__ import annotations

import math
from typing import Any


def schedule_end(t: Any) -> int:
    """The step the lr schedule ends at: train.schedule_steps, or train.steps when that is 0."""
    return t.schedule_steps or t.steps


def lr_at(step: int, t: Any) -> float:
    """Linear warmup to t.lr over warmup_steps, then cosine decay to t.min_lr at schedule_end(t); past it, t.min_lr.
    step is 0-based.

    The schedule starts at t.schedule_start (0 for a plain run; a phase's first step under the proxy), so a
    polish phase gets its own warmup and cosine instead of the tail of the pretraining one. A run trained past
    its schedule's end (`--steps` beyond a finished run: a resume keeps the schedule, keep_schedule) continues at
    the schedule's final lr, never back up.
    """
    step, steps = step - t.schedule_start, schedule_end(t) - t.schedule_start
    warmup = min(t.warmup_steps, steps)
    if step < warmup:
        return t.lr * (step + 1) / warmup
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
