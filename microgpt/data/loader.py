"""Batches for training: the batch for (step, micro) is a pure function of (seed, step, micro) (and, for a
mixture, of the mixture state a checkpoint carries).

`Batches` is what the trainer reads training batches through; `Validation` what it evaluates on. Two kinds
implement Batches: `Loader` here (one shard set) and `mixing.MixtureLoader` (FIREHOSE: one shard set per
source, one source per micro-batch). microgpt/data/experiment.py builds the pair for an experiment.

Batches: each split is cut into windows of T+1 tokens at stride T (x = w[:-1], y = w[1:]) that never
cross a shard boundary. Row r of micro-batch `micro` of step `step` takes global position
p = ((step * n_micro) + micro) * B + r, i.e. window perm_e[p mod W] of epoch e = p // W, where perm_e is
a permutation drawn from (seed, e). So every window (every token) of an epoch is visited exactly once,
each epoch is reshuffled, and any batch is computed without the ones before it: resume is bit-exact.
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

from microgpt.config import ConfigError, Experiment
from microgpt.data import shards

Pair = tuple[np.ndarray, np.ndarray]  # (x, y) int32 (B, T); y = -1 where the loss is masked


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
        n_micro: int = 1,
        masks: list[np.ndarray] | None = None,
        where: str = "data",
        shard: tuple[int, int] = (0, 1),
    ):
        self.parts, self.masks = parts, masks
        self.B, self.T, self.seed, self.n_micro = batch_size, seq_len, seed, n_micro
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
        if not 0 <= micro < self.n_micro or step < 0:
            raise ValueError(f"batch(step={step}, micro={micro}): need step >= 0 and 0 <= micro < {self.n_micro}")
        return self.batch_at(step * self.n_micro + micro)

    def batch_at(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k-th micro-batch of this loader's sequence (batch(step, micro) is batch_at(step * n_micro + micro));
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
