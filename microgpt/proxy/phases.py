"""Phases and proxy settings: the two experiment sections the training proxy owns, and the run schedule.

An experiment may list phases; each runs as an ordinary `microgpt train` of a complete experiment the
proxy derives from the base one (written to <out>/phases/<name>.json, so the run folder says exactly
what the engine ran). The step counter is global: phase i covers steps (start_i, end_i], and a phase
starts by resuming from the previous phase's final checkpoint (weights and Adam moments carry over).

    "phases": [
      {"name": "pretrain", "steps": 800},
      {"name": "polish", "steps": 200, "lr": 3e-4, "min_lr": 3e-5, "loss_mask": true,
       "data": {"source": "shards", "path": "data/megachat"}, "train": {"eval_every": 20}}
    ]

    name          required; [a-z0-9_-], unique. Entering any phase after the first archives the
                  samples and state files (docs/ANDREA.md section 6)
    steps         required; optimizer steps IN this phase (end = start + steps; the engine gets
                  train.steps = end)
    lr, min_lr, warmup_steps   shorthand for the same train.* fields
    loss_mask     shorthand for data.loss_mask (train only on assistant tokens; needs mask shards)
    data, train   objects merged field by field over the base sections (the model cannot change)

Without "phases" the run is one phase named "train" of train.steps steps. `--steps N` caps the run at
global step N (a phase past N is not run; the one N falls in ends at N).

The engine's lr schedule (warmup, cosine to min_lr at train.steps) counts from train.schedule_start;
each phase sets it to the phase's start, so a phase's warmup and decay are its own.

    "proxy": {"sample_every": 100, "prompts": ["def ", ...], "sample_tokens": 64, "temperature": 0.8,
              "hang_timeout_s": 900, ...}      (all optional; ProxySettings below gives defaults)
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from microgpt import config, data
from microgpt.config import ConfigError
from microgpt.data import hellaswag_file as hellaswag
from microgpt.errors import check_number

PHASE_FIELDS = {"name": str, "steps": int, "lr": float, "min_lr": float, "warmup_steps": int, "loss_mask": bool,
                "data": dict, "train": dict}  # fmt: skip
TRAIN_SHORTHANDS = ("lr", "min_lr", "warmup_steps")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
OWN_SECTIONS = ("phases", "proxy")  # read here, never passed to the engine
TIMES = ("hang_timeout_s", "startup_timeout_s", "silence_timeout_s", "stop_timeout_s", "flush_s", "sample_timeout_s")


@dataclass
class ProxySettings:
    """The "proxy" section. Times in seconds."""

    sample_every: int = -1  # sample at the first checkpoint at or after every N steps; -1: train.ckpt_every; 0: off
    prompts: list[Any] = field(default_factory=lambda: ["def ", "import ", "class "])  # str, or chat messages
    sample_tokens: int = 64
    temperature: float = 0.8
    sample_timeout_s: float = 300.0
    hang_timeout_s: float = 900.0  # no JSON line but heartbeats for this long after the first step: hung, restart
    startup_timeout_s: float = 1800.0  # the same before the first step (imports, compile, autotune)
    silence_timeout_s: float = 300.0  # no line at all, not even the engine's heartbeat: stopped or frozen, restart
    max_restarts: int = 5  # consecutive failures without a new checkpoint before giving up
    backoff_s: float = 5.0  # wait before restart k: backoff_s * 2**(k-1), at most backoff_max_s
    backoff_max_s: float = 300.0
    stop_timeout_s: float = 600.0  # after forwarding SIGTERM, wait this long for the checkpoint, then SIGKILL
    flush_s: float = 1.0  # rewrite .loss.json at most this often (and at every checkpoint, eval and exit)


@dataclass
class Phase:
    name: str
    start: int  # global step the phase starts from
    end: int  # global step the phase ends at (the engine's train.steps)
    engine: dict[str, Any]  # the complete experiment the engine runs


@dataclass
class Schedule:
    run: str
    phases: list[Phase]
    settings: ProxySettings
    config_hash: str

    def phase_at(self, step: int) -> int | None:
        """Index of the phase that runs the step after `step`; None when the run is complete."""
        return next((i for i, p in enumerate(self.phases) if p.end > step), None)

    @property
    def final_step(self) -> int:
        return self.phases[-1].end


def load_settings(raw: Any, src: str) -> ProxySettings:
    where = f"{src}: proxy"
    settings = config.build_section(ProxySettings, raw, where)
    for name, hi in (("sample_tokens", config.MAX_TOKENS), ("max_restarts", config.INT_MAX)):
        check_number(getattr(settings, name), f"{where}.{name}", 0, hi, integer=True, error=ConfigError)
    check_number(settings.temperature, f"{where}.temperature", 0, error=ConfigError)
    for name in TIMES:
        check_number(getattr(settings, name), f"{where}.{name}", 0, lo_open=True, error=ConfigError)
    for name in ("backoff_s", "backoff_max_s"):
        check_number(getattr(settings, name), f"{where}.{name}", 0, error=ConfigError)
    for i, prompt in enumerate(settings.prompts):
        if not (isinstance(prompt, str) or _is_chat(prompt)):
            raise ConfigError(f"{where}.prompts[{i}]: a prompt is a string or a list of {{role, content}} messages")
    return settings


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(
        isinstance(m, dict) and set(m) == {"role", "content"} and all(isinstance(v, str) for v in m.values())
        for m in prompt
    )


def _check_phase(raw: Any, where: str, seen: set[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a phase must be a JSON object, got {type(raw).__name__}")
    for name, value in raw.items():
        if name not in PHASE_FIELDS:
            raise ConfigError(f"{where}: unknown phase field '{name}' (known: {', '.join(PHASE_FIELDS)})")
        config.check_type(where, name, value, PHASE_FIELDS[name])
    for name in ("name", "steps"):
        if name not in raw:
            raise ConfigError(f"{where}: missing phase field '{name}'")
    if not NAME_RE.match(raw["name"]):
        raise ConfigError(f"{where}: phase name {raw['name']!r} must match {NAME_RE.pattern}")
    if raw["name"] in seen:
        raise ConfigError(f"{where}: phase name {raw['name']!r} is used twice")
    if raw["steps"] <= 0:
        raise ConfigError(f"{where}: phase steps must be > 0, got {raw['steps']}")
    for name in ("steps", "log_every"):
        if name in raw.get("train", {}):
            raise ConfigError(f"{where}: train.{name} is set by the proxy (use the phase's own 'steps')")
    seen.add(raw["name"])
    return raw


def _phase_engine(base: dict[str, Any], ph: dict[str, Any], start: int, end: int) -> dict[str, Any]:
    eng = copy.deepcopy(base)
    eng["train"].update(ph.get("train", {}))
    eng["data"].update(ph.get("data", {}))
    for name in TRAIN_SHORTHANDS:
        if name in ph:
            eng["train"][name] = ph[name]
    if "loss_mask" in ph:
        eng["data"]["loss_mask"] = ph["loss_mask"]
    eng["train"]["steps"] = end
    eng["train"]["log_every"] = 1  # the history holds every step, so every step must be reported
    if "schedule_start" not in ph.get("train", {}):
        eng["train"]["schedule_start"] = start  # the phase's warmup and cosine are its own
    return eng


def _check_paths(data: dict[str, Any], where: str) -> None:
    """Missing inputs fail before anything is written or spawned, with the field that names them.
    (A "builtin" data.path is where the built-in corpus gets built on first use: it may not exist yet.)"""
    if data.get("source") == "shards" and data.get("path") and not Path(data["path"]).is_dir():
        raise ConfigError(f"{where}: data.path {data['path']!r} does not exist (a folder of train_*.bin shards)")
    tok = data.get("tokenizer")
    if tok and tok != "bytes" and not Path(tok).is_file():
        raise ConfigError(f"{where}: data.tokenizer {tok!r} does not exist")


def make_schedule(
    raw: Any, src: str, steps: int | None = None, seed: int | None = None, sets: Sequence[str] = (), **train: Any
) -> Schedule:
    """Validate the experiment, its phases and proxy settings; ConfigError (one line) on anything wrong.
    The overrides are read by config.apply_overrides, as `microgpt train` reads them, except `steps` (> 0, checked
    with the flags): here it caps the run. `sets` and `seed` are part of the experiment (its config hash); `train`
    (backend, precision) is not: a stopped run may continue on another backend, from the same fp32 checkpoint."""
    raw, exp = config.apply_overrides(raw, src, sets, seed=seed, **train)
    settings = load_settings(raw.get("proxy", {}), src)
    base = {k: v for k, v in exp.to_dict().items() if k not in OWN_SECTIONS}
    phases_raw = raw.get("phases")
    implicit = phases_raw is None
    if implicit:
        phases_raw = [{"name": "train", "steps": steps or exp.train.steps}]
    if not isinstance(phases_raw, list) or not phases_raw:
        raise ConfigError(f"{src}: phases must be a non-empty list of phase objects")
    phases, seen, start = [], set(), 0
    for i, ph in enumerate(phases_raw):
        where = src if implicit else f"{src}: phases[{i}]"
        ph = _check_phase(ph, where, seen)
        end = start + ph["steps"] if steps is None else min(start + ph["steps"], steps)
        if end <= start:
            break
        eng = _phase_engine(base, ph, start, end)
        exp_i = data.validate(config.from_dict(eng, where if implicit else f"{where} ({ph['name']})"), where)
        data.check_data(exp_i, src, where)  # the data exist and fit the model, or the prep command that makes them
        _check_paths(exp_i.to_dict()["data"], where)
        hellaswag.check(exp_i, where)
        phases.append(Phase(ph["name"], start, end, eng))
        start = end
    if settings.sample_every < 0:
        settings.sample_every = exp.train.ckpt_every
    digest = hashlib.sha256(json.dumps({"experiment": raw, "seed": seed}, sort_keys=True).encode()).hexdigest()
    return Schedule(exp.name, phases, settings, digest[:16])


def load_schedule(path: str | Path, **overrides: Any) -> Schedule:
    return make_schedule(config.read_raw(path), str(path), **overrides)
