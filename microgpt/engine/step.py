"""The optimizer step: one function for both backends. The NumPy backend runs it as it is; on a GPU the same
function is captured once as a CUDA graph and replayed (one launch per step from Python).

    for each micro-batch: forward (with the loss head's backward) ; backward     adds into the grads (+=)
    all-reduce the grads over ranks (data parallel)                              their sum, layer by layer
                                                                                 during the last backward
    norm = ||g||                                                                 of the raw sum, two fixed passes
    AdamW with g * gscale * min(1, max_norm / (norm * gscale + 1e-6))            gscale = 1/(count*world*scale)
    and the compute copy of the weights refreshed, the grads zeroed              in the same pass
    the precision's end of each micro-batch (fp8: the operands' amaxes into       max over ranks first
    their histories) and its weights after AdamW (fp8: the E4M3 copies)           one cast per site over the
                                                                                 layers; AdamW took the amaxes

The gradient scale (mean over micro-batches and ranks, and the fp16 loss scale divided out) and the clip are
folded into AdamW's read of the gradients (microgpt/ops/adamw.py), so the gradients are read twice per step (norm,
AdamW) rather than four times. A step runs `count` micro-batches: train.n_micro, or fewer during a batch-size
warmup (data/loader.py MicroSchedule); the mean loss and gscale divide by the step's own count, and the plan's
buffers keep their n_micro rows (a step of fewer uses the first count). On a GPU each count the run takes is its
own CUDA graph, all captured at the first step. Everything the device needs from the host sits in planned buffers
written before each run: the tokens and targets of every micro-batch, `hyper` (lr, bias corrections, gscale), the
loss scale and the attention window of the step (where the model narrows attention: its schedule's). The run
writes `report` = [mean loss, raw grad norm, each micro-batch's loss], which the host reads once: the step's only
synchronization.
"""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from microgpt.data.loader import MicroSchedule
from microgpt.engine import model, optim
from microgpt.engine.collectives import GradReduce
from microgpt.engine.memory import NORM_BLOCK
from microgpt.engine.state import TrainState


def optimizer_step(S: TrainState, dp: Any = None, count: int | None = None) -> None:
    """One optimizer step on the state's device over its first `count` micro-batches (default train.n_micro), from
    the inputs, hyper and loss scale already in its buffers."""
    K, m, t, A = S.K, S.m, S.t, S.arena
    count = t.n_micro if count is None else count
    report = A["report"]
    K.zero_(report)
    reduce = GradReduce(dp, m, S.g) if dp is not None else None  # the sum over ranks; gscale makes it the mean
    for i in range(count):
        tokens, targets = A["tokens"][i], A["targets"][i]
        model.gpt_forward(K, m, S.P_compute, A, tokens, targets, S.G)
        K.loss_sum(report, A["losses"], targets.reshape(-1), 1.0 / count, True)
        K.loss_sum(report[2 + i :], A["losses"], targets.reshape(-1), 1.0, True)
        last = reduce is not None and i == count - 1
        model.gpt_backward(K, m, S.P_compute, S.G, A, tokens, reduce.layer_done if last else None)
        S.prec.end_micro_batch(dp)
    if reduce is not None:
        reduce.finish()
    norm = report[1:2]
    K.grad_norm_partial(A["norm_partials"], S.g, NORM_BLOCK)
    K.grad_norm_final(norm, A["norm_partials"])
    max_norm = t.grad_clip if t.grad_clip > 0 else math.inf
    for part, hyper in _adamw_parts(S):  # every parameter, or under Muon the embedding and the head at their lrs
        pc = None if S.p_compute is None else S.p_compute[part]
        args = (S.p[part], S.g[part], S.adam_m[part], S.adam_v[part], A["decay_mask"][part], pc, hyper, norm)
        K.adamw_step(*args, t.beta1, t.beta2, t.eps, t.weight_decay, max_norm)
    if t.optimizer == "muon":
        S.muon(S.p, S.g, S.adam_m, S.p_compute, A["hyper"][optim.HYPER_ROWS["muon"]], norm, max_norm=max_norm)
    S.prec.cast_weights(updated=True)  # fp8: the E4M3 copies of the updated masters


def set_window(S: TrainState, step: int) -> None:
    """The attention window of `step` (optim.attn_window_at: the schedule's, a pure function of the step) into the
    plan's buffer, which the step's attention reads, where the plan has one (memory.window_planned)."""
    if "attn_window" in S.arena:
        S.K.copy_in(S.arena["attn_window"], np.array([optim.attn_window_at(step, S.m, S.t)], np.int32))


def _adamw_parts(S: TrainState) -> list[tuple[slice, Any]]:
    """What AdamW updates, as (part of the flat arrays, its hyper row): all of them under train.optimizer "adamw";
    under "muon" the ranges outside the block matrices (optim.adamw_ranges), each with its group's row."""
    if S.t.optimizer != "muon":
        return [(slice(None), S.arena["hyper"])]
    return [(slice(lo, hi), S.arena["hyper"][optim.HYPER_ROWS[g]]) for g, lo, hi in optim.adamw_ranges(S.m)]


@dataclass
class StepResult:
    loss: float  # mean over the micro-batches (this rank's)
    grad_norm: float  # of the mean gradient, before clipping
    micro_losses: list[float]  # each micro-batch's mean loss (the data mixture's reward)


class Step:
    """optimizer_step as the trainer calls it: batches and host values in, one run (a graph replay on the GPU),
    the report out. The first call prepares the runs (backend.prepare), one for each micro-batch count the run
    takes from its step on (MicroSchedule.counts: n_micro alone without a batch warmup): on a GPU a warm-up run with
    gscale = inf, which compiles and tunes everything and updates nothing, then the capture."""

    def __init__(self, S: TrainState, dp: Any = None, graph: bool = True) -> None:
        """graph=False runs the step function itself every call after the warm-up (dev/profile_step.py compares).
        With data parallel on GPUs the graph holds the NCCL all-reduces too: every rank replays one graph."""
        self.S, self.dp, self.graph = S, dp, graph
        self.world = dp.world_size if dp is not None else 1
        self.micro = MicroSchedule.of(S.t)
        self.runs: dict[int, Callable[[], None]] = {}  # micro-batch count -> its prepared run

    def __call__(self, batches: list[tuple[np.ndarray, np.ndarray]], lr: float) -> StepResult:
        """Run optimizer step S.step (0-based) on its (tokens, targets) batches (MicroSchedule.count of them: n_micro
        without a batch warmup) at learning rate lr."""
        S, K, A = self.S, self.S.K, self.S.arena
        count = len(batches)
        if count != self.micro.count(S.step):
            raise ValueError(f"step {S.step} reads {self.micro.count(S.step)} micro-batches, got {count}")
        K.copy_in(A["tokens"][:count], np.stack([x for x, _ in batches]))
        K.copy_in(A["targets"][:count], np.stack([y for _, y in batches]))
        K.copy_in(A["loss_scale"], np.array([S.scaler.scale]))
        set_window(S, S.step)
        gscale = 1.0 / (count * self.world * S.scaler.scale)
        if count not in self.runs:
            self._prepare(lr, self.micro.counts(S.step) if not self.runs else [count])
        self._hyper(lr, gscale)
        if S.prec.priming:  # fp8's first step of a fresh run: its casts prime the amax histories first
            optimizer_step(S, self.dp, count)
        else:
            self.runs[count]()
        loss, raw_norm, *micro = K.to_numpy(A["report"]).tolist()
        S.scaler.update(math.isfinite(raw_norm))
        S.step += 1
        return StepResult(loss, raw_norm * gscale, micro[:count])

    def _prepare(self, lr: float, counts: list[int]) -> None:
        """backend.prepare on the steady-state step of each count (a step not priming the precision's state); what
        the precision keeps is put back as it was after them (fp8's amax slots: the warm-ups' casts and rolls must
        leave no trace in the run's scales)."""
        S = self.S
        snap = S.prec.snapshot()
        S.prec.steady()
        self._hyper(lr, math.inf)
        for count in counts:
            self.runs[count] = S.K.prepare(functools.partial(optimizer_step, S, self.dp, count), self.graph)
        S.prec.restore(snap)

    def release(self) -> None:
        """Drop the prepared runs (on a GPU, the CUDA graphs, freed now); the next call prepares them again."""
        self.runs = {}
        gc.collect()

    def _hyper(self, lr: float, gscale: float) -> None:
        """hyper = [lr, 1 - beta1^t, 1 - beta2^t, gscale] for AdamW's step t = S.step + 1; under Muon one such row
        per AdamW group and Muon's [lr, momentum, gscale, weight decay] (optim.hyper_rows)."""
        buf = self.S.arena["hyper"]
        rows = optim.hyper_rows(lr, self.S.t, self.S.step, gscale)
        hyper = np.zeros((len(rows), buf.shape[-1]))  # float64: the buffer rounds it once
        for i, row in enumerate(rows):
            hyper[i, : len(row)] = row
        self.S.K.copy_in(buf, hyper)
