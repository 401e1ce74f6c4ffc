"""FIREHOSE: online data mixing. Each data source is an arm of an EXP3-style bandit whose per-source training
loss steers the sampling mixture; docs/FIREHOSE-BANDIT.md is the specification, this is its code.

    "data":   {"source": "shards", "path": "data/builtin-split"}     one subfolder per source (prep --per-source)
    "mixing": {"policy": "firehose", "reward": "improvement", "prior": "uniform", "warmup_steps": 20}

Layout: data.path holds no shards of its own but one subfolder per source, each a shard set (train_*.bin,
val_*.bin, masks) with the tokenizer.json at the top; the arms are those subfolders, sorted by name.

One source per micro-batch: micro-batch `micro` of step `step` comes from source i drawn with
u = rng(seed, step, micro) against the current weights, and it is that source's k-th micro-batch, k = the
number drawn from it before (its own epochs and shuffles, loader.Loader.batch_at). So a batch is a pure function
of the seed and the mixture state (weights and draw counts), which every checkpoint's sidecar carries under
"mixing": resume is bit-exact. Every data-parallel rank draws the same source (same seed, step and weights) and
reads its own rows of it; the bandit learns from the per-micro-batch losses averaged over ranks, so the weights
stay identical everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from microgpt.config import ConfigError, Experiment, check_type
from microgpt.data import shards
from microgpt.data.loader import ONE, Loader, MicroSchedule, Validation, open_split
from microgpt.data.sources import SourceError

POLICIES = ("fixed", "firehose")
REWARDS = ("improvement", "loss", "excess")
PRIORS = ("tokens", "uniform")
DRAW_KEY = 0xF12E  # keeps the source draws apart from the window shuffles (0xDA7A) of the same seed


@dataclass
class MixingConfig:
    """The experiment's "mixing" section (docs/FIREHOSE-BANDIT.md explains each field)."""

    policy: str = "fixed"  # fixed: the prior, always | firehose: the bandit
    prior: Any = "tokens"  # "tokens" (each source's share of train tokens: prep's mixture) | "uniform" | {name: w}
    reward: str = "improvement"  # improvement | loss | excess
    eta: float = 2.0  # inverse temperature of the softmax over normalized smoothed rewards
    smoothing: float = 0.9  # alpha: smoothed reward and reward scale, per update
    baseline_decay: float = 0.9  # beta: each source's running loss baseline, per observation
    min_explore: float = 0.05  # the exploration floor never drops below this (capped at 1/K)
    warmup_steps: int = 20  # optimizer steps on the prior weights before the bandit steers
    update_every: int = 1  # optimizer steps between bandit updates
    importance_weighting: bool = False  # EXP3's r / p (Albalak et al.); off: see the spec
    max_epochs: int = 0  # > 0: a source whose windows would be used more often than this is an error (ran dry)


TYPES = {"policy": str, "prior": (str, dict), "reward": str, "eta": float, "smoothing": float, "baseline_decay": float,
         "min_explore": float, "warmup_steps": int, "update_every": int, "importance_weighting": bool,
         "max_epochs": int}  # fmt: skip


def parse(raw: Any, where: str = "experiment") -> MixingConfig:
    """The "mixing" section, checked field by field; ConfigError names the file (where) and the field."""
    cfg = MixingConfig()
    if raw is None:
        return cfg
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: mixing must be a JSON object, got {type(raw).__name__}")
    for name, value in raw.items():
        if name not in TYPES:
            raise ConfigError(f"{where}: unknown field 'mixing.{name}' (known: {', '.join(TYPES)})")
        setattr(cfg, name, check_type(where, f"mixing.{name}", value, TYPES[name]))
    _check_values(cfg, where)
    return cfg


def _check_values(c: MixingConfig, where: str) -> None:
    bad = None
    if c.policy not in POLICIES:
        bad = f"mixing.policy must be one of {', '.join(POLICIES)}, got {c.policy!r}"
    elif c.reward not in REWARDS:
        bad = f"mixing.reward must be one of {', '.join(REWARDS)}, got {c.reward!r}"
    elif isinstance(c.prior, str) and c.prior not in PRIORS:
        bad = f"mixing.prior must be 'tokens', 'uniform' or {{source: weight}}, got {c.prior!r}"
    elif isinstance(c.prior, dict) and not c.prior:
        bad = "mixing.prior must name at least one source"
    elif isinstance(c.prior, dict) and not all(_positive(w) for w in c.prior.values()):
        bad = f"mixing.prior weights must be numbers > 0, got {c.prior!r}"
    elif not c.eta > 0:
        bad = f"mixing.eta must be > 0, got {c.eta}"
    elif not (0 <= c.smoothing < 1 and 0 <= c.baseline_decay < 1 and 0 <= c.min_explore < 1):
        bad = "mixing.smoothing, mixing.baseline_decay and mixing.min_explore must be in [0, 1)"
    elif c.warmup_steps < 0 or c.update_every < 1 or c.max_epochs < 0:
        bad = "mixing.warmup_steps and mixing.max_epochs must be >= 0, mixing.update_every >= 1"
    if bad:
        raise ConfigError(f"{where}: {bad}")


def _positive(w: Any) -> bool:
    return isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w > 0


# --- the bandit ------------------------------------------------------------------------------------------------
class Bandit:
    """Weights over K sources from smoothed, normalized rewards (docs/FIREHOSE-BANDIT.md, "Policy").
    All arithmetic is float64 in a fixed order, so the same observations give the same bits everywhere."""

    def __init__(self, cfg: MixingConfig, names: list[str], prior: np.ndarray):
        K = len(names)
        self.cfg, self.names, self.prior = cfg, names, prior / prior.sum()
        self.weights = self.prior.copy()
        self.rewards = np.zeros(K)  # smoothed normalized rewards R
        self.rewarded = np.zeros(K, dtype=bool)
        self.baseline = np.full(K, np.nan)  # running per-source loss (EMA over its observations)
        self.floor = np.full(K, np.nan)  # lowest baseline so far (the "excess" reward's reference)
        self.scale = 0.0  # running mean |reward|: makes eta unit-free across rewards and runs
        self.t = 0  # bandit updates so far
        self.pend_sum, self.pend_n = np.zeros(K), np.zeros(K, dtype=np.int64)  # observations since the update

    def observe(self, i: int, loss: float) -> None:
        self.pend_sum[i] += loss
        self.pend_n[i] += 1

    def update(self, steps_done: int) -> None:
        """Fold the pending observations into the rewards, then recompute the weights (prior while warming up)."""
        c = self.cfg
        for i in np.flatnonzero(self.pend_n):
            r = self._reward(int(i), float(self.pend_sum[i] / self.pend_n[i]))
            if r is None:
                continue
            self.scale = abs(r) if self.scale == 0 else c.smoothing * self.scale + (1 - c.smoothing) * abs(r)
            x = r / self.scale if self.scale > 0 else 0.0
            if c.importance_weighting:
                x /= self.weights[i]
            self.rewards[i] = x if not self.rewarded[i] else c.smoothing * self.rewards[i] + (1 - c.smoothing) * x
            self.rewarded[i] = True
        self.pend_sum[:], self.pend_n[:] = 0.0, 0
        self.t += 1  # counted through the warm-up too, so the hand-over from the prior is smooth
        if c.policy == "firehose" and steps_done >= c.warmup_steps:
            self.weights = self.policy()

    def _reward(self, i: int, loss: float) -> float | None:
        """The reward for one observation of source i (its mean loss over the interval); None: no reference yet."""
        kind, b, f = self.cfg.reward, self.baseline[i], self.floor[i]
        if kind == "loss":
            r = loss  # Albalak et al. 2023: favours whatever is hardest, noise included
        elif kind == "improvement":
            r = None if math.isnan(b) else b - loss  # below its running baseline: the source is being learned
        else:
            r = None if math.isnan(f) else loss - f  # above the best it reached: left to learn, or forgotten
        beta = self.cfg.baseline_decay
        self.baseline[i] = loss if math.isnan(b) else beta * b + (1 - beta) * loss
        self.floor[i] = self.baseline[i] if math.isnan(f) else min(f, self.baseline[i])
        return r

    def explore(self) -> float:
        """The uniform exploration share of each source: sqrt(ln K / (K t)), never above 1/K nor below min_explore."""
        K = len(self.names)
        if K == 1:
            return 1.0
        decay = math.sqrt(math.log(K) / (K * max(1, self.t)))
        return min(1.0 / K, max(self.cfg.min_explore, decay))

    def policy(self) -> np.ndarray:
        """(1 - K eps) softmax(log prior + eta R) + eps."""
        K, eps = len(self.names), self.explore()
        z = np.log(self.prior) + self.cfg.eta * self.rewards
        p = np.exp(z - z.max())
        return (1 - K * eps) * (p / p.sum()) + eps

    def state(self) -> dict[str, Any]:
        nan = lambda a: [None if math.isnan(x) else x for x in a.tolist()]  # noqa: E731 (JSON has no NaN)
        return {
            "weights": self.weights.tolist(),
            "rewards": self.rewards.tolist(),
            "rewarded": self.rewarded.tolist(),
            "baseline": nan(self.baseline),
            "floor": nan(self.floor),
            "scale": self.scale,
            "t": self.t,
            "pending_sum": self.pend_sum.tolist(),
            "pending_n": self.pend_n.tolist(),
        }

    def load_state(self, s: dict[str, Any]) -> None:
        f64 = lambda a: np.array([np.nan if x is None else x for x in a], dtype=np.float64)  # noqa: E731
        self.weights, self.rewards, self.baseline, self.floor = (
            f64(s[k]) for k in ("weights", "rewards", "baseline", "floor")
        )
        self.rewarded = np.array(s["rewarded"], dtype=bool)
        self.scale, self.t = float(s["scale"]), int(s["t"])
        self.pend_sum, self.pend_n = f64(s["pending_sum"]), np.array(s["pending_n"], dtype=np.int64)
        if self.cfg.policy == "fixed":  # e.g. a phase that stops steering: the prior, whatever the checkpoint held
            self.weights = self.prior.copy()


# --- the sources -----------------------------------------------------------------------------------------------
class MixtureLoader:
    """Training batches from several sources, one source per micro-batch (see the module docstring).

    A loader.Batches. Unlike Loader, steps are read in order: batch(step, ...) for the step after the last
    end_step()."""

    def __init__(
        self,
        folder: Path,
        names: list[str],
        loaders: list[Loader],
        bandit: Bandit,
        seed: int,
        micro: MicroSchedule,
        max_epochs: int,
    ):
        self.folder, self.names, self.loaders, self.bandit = folder, names, loaders, bandit
        self.seed, self.micro, self.max_epochs = seed, micro, max_epochs
        self.draws = np.zeros(len(names), dtype=np.int64)  # micro-batches taken from each source so far
        self.next_step = 0
        self._plan: tuple[int, list[tuple[int, int]]] | None = None

    def source_of(self, step: int, micro: int) -> int:
        """The source of (step, micro): u = rng(seed, step, micro) against the cumulative weights."""
        u = np.random.default_rng([self.seed, step, micro, DRAW_KEY]).random()
        cum = np.cumsum(self.bandit.weights)
        return min(int(np.searchsorted(cum, u * cum[-1], side="right")), len(cum) - 1)

    def plan(self, step: int) -> list[tuple[int, int]]:
        """[(source, its micro-batch index)] for the micro-batches of `step`."""
        if self._plan is not None and self._plan[0] == step:
            return self._plan[1]
        if step != self.next_step:
            raise RuntimeError(f"mixture: batches for step {step} asked, but the mixture stands at {self.next_step}")
        taken, out = self.draws.copy(), []
        for micro in range(self.micro.count(step)):
            i = self.source_of(step, micro)
            ld, k = self.loaders[i], int(taken[i])
            if self.max_epochs and ((k + 1) * ld.global_B - 1) // ld.n_windows >= self.max_epochs:
                raise SourceError(
                    f"source '{self.names[i]}' ran dry at step {step + 1}: its {ld.n_windows} windows "
                    f"were all used mixing.max_epochs={self.max_epochs} times; add data or raise it"
                )
            out.append((i, k))
            taken[i] += 1
        self._plan = (step, out)
        return out

    def batch(self, step: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= micro < self.micro.count(step):
            raise ValueError(f"batch(step={step}, micro={micro}): need 0 <= micro < {self.micro.count(step)}")
        i, k = self.plan(step)[micro]
        return self.loaders[i].batch_at(k)

    def end_step(self, step: int, micro_losses: list[float], dp: Any = None) -> dict[str, Any]:
        """After optimizer step `step` (0-based): count its draws, feed the losses to the bandit (the mean over
        ranks under data parallel, so every rank computes the same weights); the step record's extra fields."""
        plan = self.plan(step)
        losses = np.asarray(micro_losses, dtype=np.float64)
        if dp is not None:
            losses = dp.gather(losses.tolist()).sum(axis=0) / dp.world_size
        per: dict[int, list[float]] = {}
        for (i, _), loss in zip(plan, losses.tolist()):
            self.draws[i] += 1
            self.bandit.observe(i, loss)
            per.setdefault(i, []).append(loss)
        if (step + 1) % self.bandit.cfg.update_every == 0:
            self.bandit.update(step + 1)
        self.next_step, self._plan = step + 1, None
        return {
            "source_loss": {self.names[i]: sum(v) / len(v) for i, v in sorted(per.items())},
            "mixture": self.weights(),
        }

    def weights(self) -> dict[str, float]:
        return dict(zip(self.names, self.bandit.weights.tolist()))

    def state(self) -> dict[str, Any]:
        """What a checkpoint's sidecar keeps under "mixing"."""
        return {
            "policy": self.bandit.cfg.policy,
            "sources": self.names,
            "step": self.next_step,
            "draws": self.draws.tolist(),
            **self.bandit.state(),
        }

    def load_state(self, s: dict[str, Any] | None, step: int, where: str) -> None:
        """Continue from a checkpoint of `step`; without saved state (a run without mixing) start afresh there."""
        self.next_step, self._plan = step, None
        if not s:
            return
        try:
            self._load_state(s, step, where)
        except SourceError:  # an InputError is a ValueError too: it already says what is wrong
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # a sidecar edited by hand, or corrupt
            raise SourceError(f"{where}: field 'mixing' is malformed ({type(e).__name__})") from None
        n = len(self.names)
        arrays = (self.draws, self.bandit.weights, self.bandit.rewards, self.bandit.floor)
        if any(np.shape(a) != (n,) for a in arrays) or not (
            np.isfinite(self.bandit.weights).all() and (self.bandit.weights >= 0).all()
        ):
            raise SourceError(f"{where}: field 'mixing' does not hold one finite weight >= 0 per source")

    def _load_state(self, s: dict[str, Any], step: int, where: str) -> None:
        gone = [n for n in s["sources"] if n not in self.names]
        new = [n for n in self.names if n not in s["sources"]]
        if gone:
            raise SourceError(f"{where}: source '{gone[0]}' of the checkpoint's mixture is missing from {self.folder}")
        if new:
            raise SourceError(f"{where}: source '{new[0]}' in {self.folder} is not in the checkpoint's mixture")
        if s["sources"] != self.names or int(s["step"]) != step:
            raise SourceError(f"{where}: field 'mixing' does not match the checkpoint (sources or step)")
        self.draws = np.array(s["draws"], dtype=np.int64)
        self.bandit.load_state(s)


def source_dirs(folder: Path) -> list[Path]:
    """The per-source layout: no train shards at the top, one subfolder per source holding some."""
    if not folder.is_dir() or shards.list_shards(folder, "train"):
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and shards.list_shards(p, "train"))


def prior_weights(cfg: MixingConfig, names: list[str], loaders: list[Loader], folder: Path) -> np.ndarray:
    if cfg.prior == "uniform":
        return np.ones(len(names))
    if cfg.prior == "tokens":  # the mixture prep would have written into one shard set
        return np.array([ld.n_windows for ld in loaders], dtype=np.float64)
    missing = [n for n in cfg.prior if n not in names]
    if missing:
        raise SourceError(f"mixing.prior: source '{missing[0]}' is missing from {folder} (no {missing[0]}/train_*.bin)")
    unnamed = [n for n in names if n not in cfg.prior]
    if unnamed:
        raise SourceError(f"mixing.prior: {folder / unnamed[0]} is a source but mixing.prior does not name it")
    return np.array([float(cfg.prior[n]) for n in names])


def make_loaders(
    exp: Experiment, folder: Path, dirs: list[Path], B: int, shard: tuple[int, int]
) -> tuple[MixtureLoader, Validation]:
    """(train, val) over one shard set per source (experiment.make_loaders calls this for the per-source layout);
    val_loss is the prior-weighted mean of the sources' own val losses."""
    cfg = parse(exp.extra.get("mixing"))
    if not dirs:
        raise SourceError(
            f"mixing.policy 'firehose': {folder} holds one shard set; the bandit needs one subfolder "
            "per source (microgpt prep --per-source)"
        )
    names, t = [d.name for d in dirs], exp.train
    train, val = [], []
    for d in dirs:
        for split, out, n in (("train", train, MicroSchedule.of(t)), ("val", val, ONE)):
            parts, masks = open_split(d, split, exp)
            out.append(Loader(parts, B, exp.model.seq_len, t.seed, n, masks, f"{d} {split}", shard))
    prior = prior_weights(cfg, names, train, folder)
    bandit = Bandit(cfg, names, prior)
    weights = dict(zip(names, (prior / prior.sum()).tolist()))
    mixture = MixtureLoader(folder, names, train, bandit, t.seed, MicroSchedule.of(t), cfg.max_epochs)
    return mixture, Validation(dict(zip(names, val)), weights, per_source=True)
