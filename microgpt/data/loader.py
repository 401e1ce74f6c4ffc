"""Batches for training: the batch for (step, micro) is a pure function of (seed, step, micro) (and, for a
mixture, of the mixture state a checkpoint carries).

`Batches` is what the trainer reads training batches through; `Validation` what it evaluates on. Two kinds
implement Batches: `Loader` here (one shard set) and `mixing.MixtureLoader` (FIREHOSE: one shard set per
source, one source per micro-batch). microgpt/data/experiment.py builds the pair for an experiment.

Batches: each split is cut into windows of T+1 tokens at stride T (x = w[:-1], y = w[1:]) that never
cross a shard boundary. Step `step` reads count(step) micro-batches (`MicroSchedule`: train.n_micro, fewer during
a batch-size warmup), and row r of its micro-batch `micro` takes global position
p = (before(step) + micro) * B + r, before(step) the micro-batches of the steps before it (step * n_micro without
a warmup), i.e. window perm_e[p mod W] of epoch e = p // W, where perm_e is a permutation drawn from (seed, e). So
every window (every token) of an epoch is visited exactly once, each epoch is reshuffled, and any batch is computed
without the ones before it (before(step) has a closed form): resume is bit-exact.
With data.loss_mask, targets are -1 wherever the loss-mask shard is 0 (train on assistant tokens only).

Data parallel (microgpt/engine/collectives.py): `shard=(rank, world_size)` makes B the per-process micro-batch of
a global micro-batch of world_size * B rows, of which this process reads rows [rank*B, (rank+1)*B); so N
processes with micro-batch b read exactly the rows of one process with micro-batch N*b (validation alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from microgpt.config import ConfigError, Experiment, TrainConfig
from microgpt.data import shards

Pair = tuple[np.ndarray, np.ndarray]  # (x, y) int32 (B, T); y = -1 where the loss is masked


@dataclass(frozen=True)
class MicroSchedule:
    """How many micro-batches each optimizer step reads: U = train.n_micro, or fewer during a batch-size warmup of
    W = train.batch_warmup_steps steps from u0 = train.batch_warmup_start (D = U - u0 added, one at a time):

        count(s)  = u0 + floor(s D / W)   for s < W;   U from s = W on
        before(s) = u0 s + sum over k = 1 .. D of max(0, s - j_k),   j_k = ceil(k W / D)

    j_k is the first step that reads u0 + k micro-batches, so before(s), the micro-batches of steps 0 .. s-1, is
    u0 s plus, for each added micro-batch, the steps since it joined: U s - (j_1 + .. + j_D) once s >= W, and U s
    without a warmup (W = 0 reads as u0 = U, D = 0). The lr, Muon's momentum, evaluations and checkpoints count
    steps, not micro-batches."""

    n_micro: int
    warmup_steps: int = 0
    start: int = 1  # micro-batches at step 0 (the warmup's u0); unused when warmup_steps is 0

    @classmethod
    def of(cls, t: TrainConfig) -> MicroSchedule:
        return cls(t.n_micro, t.batch_warmup_steps, t.batch_warmup_start)

    @property
    def first(self) -> int:
        """u0: the micro-batches of step 0 (U without a warmup)."""
        return self.start if self.warmup_steps else self.n_micro

    def _joins(self) -> list[int]:
        """j_1 .. j_D: the step at which each added micro-batch joins."""
        W, D = self.warmup_steps, self.n_micro - self.first
        return [-(-k * W // D) for k in range(1, D + 1)]

    def count(self, step: int) -> int:
        """The micro-batches optimizer step `step` (0-based) reads."""
        if step >= self.warmup_steps:
            return self.n_micro
        return self.first + step * (self.n_micro - self.first) // self.warmup_steps

    def before(self, step: int) -> int:
        """The micro-batches of steps 0 .. step - 1: the closed form above."""
        return self.first * step + sum(max(0, step - j) for j in self._joins())

    def counts(self, step: int) -> list[int]:
        """The distinct counts of steps `step`, step + 1, ... (ascending): what a run resumed at `step` reads."""
        joins = [0, *self._joins(), None]
        return [
            self.first + k
            for k, (j, nxt) in enumerate(zip(joins, joins[1:]))
            if nxt is None or (j < nxt and nxt > step)
        ]


ONE = MicroSchedule(1)  # one micro-batch a step: the validation loaders'


class Batches(Protocol):
    """The training side of a run's data, as the trainer calls it."""

    def batch(self, step: int, micro: int) -> Pair:
        """Micro-batch `micro` of optimizer step `step` (0-based)."""
        ...

    def end_step(self, step: int, micro_losses: list[float], dp: Any) -> dict[str, Any]:
        """After step `step`: learn from its per-micro-batch losses (dp: the data-parallel group, or None);
        returns the fields the step's JSON line gets ({} when there is nothing to report)."""
        ...

    def state(self) -> dict[str, Any] | None:
        """What a checkpoint's sidecar keeps under "mixing" (None: nothing)."""
        ...

    def load_state(self, state: dict[str, Any] | None, step: int, where: str) -> None:
        """Continue after a checkpoint of `step` (where: the checkpoint, for error messages)."""
        ...


@dataclass
class Validation:
    """The validation sources (name -> a Loader whose val_batch(i) gives batch i) and the weights of the reported
    mean. One source (weight 1) for a shard set; one per source for a mixture, each reported on its own too."""

    sources: dict[str, Loader]
    weights: dict[str, float]
    per_source: bool = False

    def record(self, losses: dict[str, float]) -> dict[str, Any]:
        """The eval line's fields from each source's val loss: val_loss is their weighted mean."""
        mean = sum(self.weights[name] * loss for name, loss in losses.items())
        return {"val_loss": mean, "source_val_loss": losses} if self.per_source else {"val_loss": mean}


class Loader:
    """Windows of T+1 tokens over one split's shards (memmaps); (x, y) int32 (B, T), y = -1 where masked."""

    def __init__(
        self,
        parts: list[np.ndarray],
        batch_size: int,
        seq_len: int,
        seed: int,
        micro: MicroSchedule = ONE,
        masks: list[np.ndarray] | None = None,
        where: str = "data",
        shard: tuple[int, int] = (0, 1),
    ):
        self.parts, self.masks = parts, masks
        self.B, self.T, self.seed, self.micro = batch_size, seq_len, seed, micro
        rank, world = shard
        if not 0 <= rank < world:
            raise ValueError(f"shard={shard}: need 0 <= rank < world_size")
        self.row0, self.global_B = rank * batch_size, world * batch_size  # this rank's rows of the global batch
        counts = np.array([max(0, (len(p) - 1) // seq_len) for p in parts], dtype=np.int64)
        self.n_windows = int(counts.sum())
        if self.n_windows == 0:
            n = sum(len(p) for p in parts)
            raise ConfigError(f"{where}: {n} tokens, no shard holds seq_len + 1 = {seq_len + 1}")
        self.first = np.concatenate([[0], np.cumsum(counts)])  # first global window of each part
        self._perms: dict[int, np.ndarray] = {}  # memo only: at most two epochs (a batch may straddle one)

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            self._perms[epoch] = np.random.default_rng([self.seed, epoch, 0xDA7A]).permutation(self.n_windows)
        return self._perms[epoch]

    def _windows(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        part = np.searchsorted(self.first, g, side="right") - 1
        off = (g - self.first[part]) * self.T
        x = np.empty((len(g), self.T), dtype=np.int32)
        y = np.empty((len(g), self.T), dtype=np.int32)
        for r, (k, o) in enumerate(zip(part, off)):
            w = self.parts[k][o : o + self.T + 1]
            x[r], y[r] = w[:-1], w[1:]
            if self.masks is not None:
                y[r][self.masks[k][o + 1 : o + self.T + 1] == 0] = -1
        return x, y

    def _positions_at(self, k: int) -> np.ndarray:
        p = k * self.global_B + self.row0 + np.arange(self.B, dtype=np.int64)
        epoch, idx = np.divmod(p, self.n_windows)
        return np.array([self._perm(int(e))[i] for e, i in zip(epoch, idx)], dtype=np.int64)

    def batch(self, step: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
        """The training batch of optimizer step `step` (0-based), micro-batch `micro`."""
        if step < 0 or not 0 <= micro < self.micro.count(step):
            raise ValueError(
                f"batch(step={step}, micro={micro}): need step >= 0 and 0 <= micro < {self.micro.count(max(0, step))}"
            )
        return self.batch_at(self.micro.before(step) + micro)

    def batch_at(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k-th micro-batch of this loader's sequence (batch(step, micro) is batch_at(before(step) + micro));
        mixing.MixtureLoader reads each source's sequence at its own pace."""
        return self._windows(self._positions_at(k))

    def end_step(self, step: int, micro_losses: list[float], dp: Any = None) -> dict[str, Any]:
        """Nothing to learn from the losses: one source, no mixture."""
        return {}

    def state(self) -> dict[str, Any] | None:
        return None  # batches depend on (seed, step, micro) only: nothing to checkpoint

    def load_state(self, state: dict[str, Any] | None, step: int, where: str) -> None:
        """Nothing to restore (a mixture's saved state, when a run leaves its mixture, is not needed)."""

    def val_batch(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """The i-th validation batch: consecutive windows in file order, the same for every run."""
        rows = np.arange(self.B, dtype=np.int64) + i * self.global_B + self.row0
        return self._windows(rows % self.n_windows)


def open_split(folder: Path, split: str, exp: Experiment) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """One split's token shards in folder (memmaps, ids checked against model.vocab_size) and, with
    data.loss_mask, their mask shards."""
    paths = shards.list_shards(folder, split)
    if not paths:
        raise ConfigError(
            f"data.path: {folder} has no {split} shards ({split}_000000.bin, x_{split}_000000.bin or x_{split}.bin; "
            "run `microgpt prep`)"
        )
    parts = [shards.open_shard(p, "tokens", exp.model.vocab_size) for p in paths]
    if not exp.data.loss_mask:
        return parts, None
    missing = [shards.mask_path(p) for p in paths if not shards.mask_path(p).exists()]
    if missing:
        raise ConfigError(f"data.loss_mask: {missing[0]} is missing (prepare with `microgpt prep --loss-mask`)")
    return parts, [shards.open_mask(p, len(t)) for p, t in zip(paths, parts)]
