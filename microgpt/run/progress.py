"""The terminal's lines of a run: a step's progress (with the elapsed time and the ETA) and an evaluation's. The
log's records hold every field; these lines are for the person watching."""

from __future__ import annotations

import time
from typing import Any

from microgpt.use import hellaswag


class Clock:
    """The run's training time (a step record's elapsed_s: across resumes and under `run`, the time the dashboard
    shows) and the ETA of the rest: this process's mean time per step so far (evaluations and checkpoints included)
    times the steps left. A resumed process counts its rate from the step it resumed at."""

    def __init__(self, step: int, steps: int):
        self.t0, self.step0, self.steps = time.monotonic(), step, steps

    def __call__(self, step: int, elapsed_s: float) -> str:
        eta = (time.monotonic() - self.t0) / max(1, step - self.step0) * (self.steps - step)
        return f"{hms(elapsed_s)} elapsed, ETA {hms(eta)}"


def hms(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def step_line(rec: dict[str, Any], steps: int, clock: Clock) -> str:
    """The terminal's progress line; the log's step record holds every field."""
    return (
        f"step {rec['step']:>6}/{steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
        f"norm {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s | "
        f"{clock(rec['step'], rec['elapsed_s'])}"
    )


def eval_line(step: int, steps: int, ev: dict[str, Any], windows: str) -> str:
    """The evaluation on the terminal, under the step line it follows: the validation loss (a mixture adds each
    source's) and HellaSwag's accuracy, where each was scored."""
    per_source = [f"{name} {loss:.4f}" for name, loss in ev.get("source_val_loss", {}).items()]
    parts = [f"val_loss {ev['val_loss']:.4f}", *per_source, windows] if "val_loss" in ev else []
    parts += [hellaswag.progress(ev)] if "hellaswag" in ev else []
    return f"eval {step:>6}/{steps} | " + " | ".join(parts)
