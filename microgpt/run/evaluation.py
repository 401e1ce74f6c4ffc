"""Evaluation during a run: the validation loss every train.eval_every steps and at the last, HellaSwag where
train.hellaswag asks (microgpt/use/hellaswag.py), on the training state's own arena and weights.

val_loss scores the same windows at every evaluation: the first eval_batches x micro_batch (x ranks) of each
source; a mixture adds each source's own loss, and val_loss is their prior-weighted mean (data/loader.py). Attention
reads the window of the step just run (train.attn_window_start's schedule: optim.attn_window_at), and document
starts as training does (model.doc_mask).
"""

from __future__ import annotations

from typing import Any

from microgpt import data
from microgpt.config import Experiment
from microgpt.engine import model
from microgpt.engine.state import TrainState
from microgpt.engine.step import set_window
from microgpt.use import hellaswag


class Evaluation:
    """The run's evaluations over state S; `last` is the latest validation loss ({"val_loss", "val_step"}), which
    every checkpoint's sidecar carries."""

    def __init__(self, S: TrainState, exp: Experiment, val_data: Any, dp: Any, rank: int, world: int):
        self.S, self.t, self.val_data, self.dp, self.world = S, S.t, val_data, dp, world
        self.hellaswag = hellaswag.DuringTraining.make(exp, rank, world)  # None without it
        self.last: dict[str, Any] = {}

    def evaluate(self) -> dict[str, Any]:
        """{"val_loss": ...}; a mixture adds each source's own val loss, and val_loss is their prior-weighted mean."""
        return self.val_data.record({name: self._val_loss(ld) for name, ld in self.val_data.sources.items()})

    def due(self, step: int) -> dict[str, Any]:
        """The fields of the eval record due after step `step` (val loss, HellaSwag; both at the last); {}: none."""
        last, ev = self.t.steps, {}
        set_window(self.S, max(0, step - 1))  # the window of the step just run: the model as it is trained
        if step % self.t.eval_every == 0 or step == last:
            ev = self.evaluate()
            self.last = {"val_loss": ev["val_loss"], "val_step": step}
        if self.hellaswag is not None and self.hellaswag.due(step, last):
            ev.update(self.hellaswag(self.S, self.dp))
        return ev

    def _val_loss(self, loader: data.Loader) -> float:
        S, K, A = self.S, self.S.K, self.S.arena
        total, count = 0.0, 0
        for i in range(self.t.eval_batches):
            x, y = loader.val_batch(i)
            K.copy_in(A["tokens"][0], x)
            K.copy_in(A["targets"][0], y)
            model.gpt_forward(K, S.m, S.P_compute, A, A["tokens"][0], A["targets"][0])
            S.prec.end_eval()  # fp8: evaluation scales by the amax histories and leaves nothing in them
            K.loss_sum(A["loss_sum"], A["losses"], A["targets"][0].reshape(-1))
            s, c = K.to_numpy(A["loss_sum"]).tolist()
            total, count = total + s, count + int(c)
        if self.dp is not None:
            total, count = self.dp.sum_scalars(total, count)
        return total / max(1, count)

    def windows(self) -> str:
        """Which validation windows val_loss scores: the first eval_batches x micro-batch (x ranks) of each source,
        the same at every evaluation. `microgpt eval --data` scores all of them by default, so its loss differs."""
        n = self.t.eval_batches * self.t.micro_batch * self.world
        sources = self.val_data.sources
        if len(sources) == 1:
            return scored_windows(n, next(iter(sources.values())).n_windows)
        short = sum(ld.n_windows < n for ld in sources.values())
        wraps = f" ({short} with fewer wrap around them: some windows scored twice or more)" if short else ""
        return f"the first {n:,} val windows of each of {len(sources)} sources" + wraps


def scored_windows(n: int, total: int) -> str:
    """The n windows val_loss scores, of a split of `total`, in words. Past the split's end the windows wrap around
    (Loader.val_batch), so some are scored twice or more: the line says which and how often."""
    if n <= total:
        return f"the first {n:,} of {total:,} val windows"
    times, extra = divmod(n, total)
    again = f", the first {extra:,} of them {'twice' if times == 1 else f'{times + 1} times'}" if extra else ""
    each = {1: "", 2: " twice each"}.get(times, f" {times} times each")
    return f"all {total:,} val windows{each}{again}: the {n:,} asked wrap around the split"
