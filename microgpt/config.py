"""Experiment configuration: plain dataclasses, loaded from JSON, checked field by field.

An experiment file has three sections, "model", "train" and "data", plus a "name" (and optional
sections other parts of the stack own, listed in EXTRA_SECTIONS). Every field is typed; an unknown
field, a wrong type or an impossible value raises ConfigError with one line naming the file and the
field, and the CLI turns that into exit code 2.

This module is also the one loader of experiment files and the one parser of `--set section.field=value`, and it
declares the flags `microgpt train` and `microgpt run` share (add_experiment_flags), so both read an experiment
the same way and reject the same bad input with the same line.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from microgpt.errors import InputError, brief, check_finite, check_number
from microgpt.fileio import parse_json, read_json


class ConfigError(InputError):
    """A bad experiment file, field or override. str(err) is the whole one-line message."""


@dataclass
class ModelConfig:
    vocab_size: int = 2048
    d_model: int = 192
    n_layer: int = 4
    n_head: int = 6
    seq_len: int = 128
    # the block family (engine/params.py FAMILIES): "gpt2", ANDREA's (learned positions, LayerNorm, GELU, tied head),
    # or "modern" (RMSNorm, rotary positions, QK-norm, ReLU^2, untied head, logit soft-cap; no norm weights, no biases)
    block: str = "gpt2"
    softcap: float = 15.0  # modern: logits -> softcap * tanh(logits / softcap) before the loss; 0: none
    rope_base: float = 10000.0  # modern: the rotary embedding's base (angle p * base^(-2i / head_dim))
    # modern: k value-embedding tables (V, C); table j is added to the values of layer j and of layer L - k + j
    # (engine/params.py value_embed); 0: none
    value_embeds: int = 0
    # modern: k U-net skip connections; the residual stream after layer j (j < k) is added, times the learned scalar
    # skip_w[j], to the input of layer L - 1 - j (engine/params.py skip_into); 0: none
    skips: int = 0
    # modern: each query attends to the last attn_window positions at most (itself included), in training (at the
    # schedule's end: train.attn_window_start) and at inference; 0: the whole sequence (ops/attention.py)
    attn_window: int = 0
    # modern: the id of <|endoftext|> (the tokenizer's eot_id), which begins every document: a query attends to
    # nothing before its document's <|endoftext|>, in training, evaluation and inference; -1: across documents
    doc_mask: int = -1

    @property
    def head_dim(self) -> int:
        """Each attention head's width D = d_model / n_head: every block family's weights are [d_model, n_head x D].
        An experiment (or an older checkpoint's sidecar) may still name model.head_dim: 0, or this (build_section)."""
        return self.d_model // self.n_head


@dataclass
class TrainConfig:
    # sequences a micro-batch; "auto": the largest whose memory plan fits the device, n_micro then counting the
    # step's sequences (microgpt/engine/state.py auto_micro_batch; --micro-batch auto keeps the recipe's
    # micro_batch x n_micro)
    micro_batch: int | str = 16
    n_micro: int = 1
    steps: int = 300
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    schedule_start: int = 0  # the step the lr schedule counts from (a phase's first step)
    schedule_steps: int = 0  # the step the lr schedule ends at (min_lr from there on); 0: train.steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1337
    precision: str = "fp32"
    backend: str = "numpy"
    eval_every: int = 50
    eval_batches: int = 8
    ckpt_every: int = 100
    log_every: int = 1
    # False: the MLP keeps a = gelu(h) per layer from forward to backward (L x (N, 4C) more saved activations, one
    # pass fewer over them in backward); True: one (N, 4C) scratch, and backward recomputes a from h
    recompute_gelu: bool = False
    # GiB of the device's free memory the plan leaves to what is allocated outside it: the CUDA graph's pool, Triton's
    # loaded kernels, NCCL's buffers, other processes (the plan is checked against the free memory less this)
    memory_margin: float = 0.5
    # a HellaSwag JSONL file (microgpt/use/hellaswag.py) scored during the run, every hellaswag_every steps (0: with the
    # validation loss, every eval_every) and at the last, on its first hellaswag_examples examples (0: all); "": none
    hellaswag: str = ""
    hellaswag_every: int = 0
    hellaswag_examples: int = 0
    # the optimizer of the block matrices: "adamw" (every parameter), or "muon" (engine/optim.py: Newton-Schulz
    # orthogonalised momentum on each block matrix; AdamW keeps the embedding and the head)
    optimizer: str = "adamw"
    # the lr schedule: "cosine" (warmup, then cosine from lr to min_lr) or "warmdown" (warmup, then lr held,
    # then a straight line down to min_lr over the last warmdown_frac of the schedule)
    schedule: str = "cosine"
    warmdown_frac: float = 0.4
    # each group's lr at the schedule's peak (the schedule scales them all alike): the untied head's (0: lr) and
    # Muon's; muon_momentum rises linearly from muon_momentum_start over muon_momentum_warmup steps (0: none);
    # muon_ns_steps: the Newton-Schulz steps that orthogonalise each Muon update (three batched GEMMs each per group)
    head_lr: float = 0.0
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_momentum_start: float = 0.85
    muon_momentum_warmup: int = 300
    muon_weight_decay: float = 0.0
    muon_ns_steps: int = 5
    # a batch-size warmup (data/loader.py MicroSchedule): step s < batch_warmup_steps reads batch_warmup_start +
    # floor(s (n_micro - batch_warmup_start) / batch_warmup_steps) micro-batches instead of n_micro (0: none); the
    # lr, Muon's momentum, evaluations and checkpoints still count steps. Under micro_batch "auto" batch_warmup_start
    # counts sequences, as n_micro does
    batch_warmup_steps: int = 0
    batch_warmup_start: int = 1
    # the attention window's schedule (optim.attn_window_at): attn_window_start positions at step 0, widened by as
    # many every attn_window_every steps up to model.attn_window (0 there: seq_len); 0: model.attn_window throughout
    attn_window_start: int = 0
    attn_window_every: int = 0


@dataclass
class DataConfig:
    """Where tokens come from; microgpt/data/experiment.py documents each field. "builtin" needs no network."""

    source: str = "builtin"  # builtin | shards
    path: str = ""  # shards: their folder; builtin: cache folder override
    tokenizer: str = ""  # "" (auto: bytes if model.vocab_size is 256, else BPE) | "bytes" | a tokenizer.json
    val_fraction: float = 0.05
    max_bytes: int = 4_000_000  # builtin: stdlib source bytes (plus ~25% synthetic chats)
    loss_mask: bool = False  # targets -1 where the loss-mask shard is 0 (assistant tokens only)
    prep: str = ""  # shards: the `microgpt prep` arguments that make data.path (microgpt/data/recipe.py); "": own data


@dataclass
class Experiment:
    name: str = "ANDREA-tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # Sections owned by other parts (the proxy's phases, the bandit's mixing): kept verbatim here and
    # validated by their owners (mixing: microgpt.data.validate).
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "model": dataclasses.asdict(self.model), "train": dataclasses.asdict(self.train)}
        d["data"] = dataclasses.asdict(self.data)
        d.update(self.extra)
        return d


SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig}
EXTRA_SECTIONS = ("phases", "mixing", "description", "proxy")
AUTO = "auto"  # train.micro_batch's one non-number
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")  # fp8: E4M3 block linears (microgpt/fp8.py)
BLOCKS = ("gpt2", "modern")  # model.block
OPTIMIZERS = ("adamw", "muon")  # train.optimizer
MAX_NS_STEPS = 10  # train.muon_ns_steps: 1 .. this many Newton-Schulz steps
SCHEDULES = ("cosine", "warmdown")  # train.schedule
NUMPY_PRECISIONS = ("fp32", "fp8")  # what the numpy backend runs: it computes in fp32 (fp8: E4M3 linears' reference)
BACKENDS = ("numpy", "triton")


INT_MAX = 2**31 - 1  # the checkpoint header's int32: steps, and every count a step multiplies
SEED_MAX = 2**63 - 1
HELLASWAG_ZERO = {"hellaswag_every": "with every evaluation", "hellaswag_examples": "every example"}
MAX_TOKENS = 1_000_000  # tokens sampled at once (--tokens, proxy.sample_tokens): more is a typo, not a request
MAX_LAYERS = 1024  # the plan is a table with rows per layer: a hostile n_layer must not build a billion rows


def check_type(where: str, name: str, value: Any, typ: type) -> Any:
    """value as typ (an int where a float is wanted becomes a float; NaN and infinities are refused); ConfigError
    naming where and the field."""
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return check_finite(value, f"{where}: field '{name}'", ConfigError)
    if not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):
        raise ConfigError(f"{where}: field '{name}' must be {typ.__name__}, got {type(value).__name__} {brief(value)}")
    return value


def build_section(cls: type, raw: Any, where: str) -> Any:
    """A config dataclass from its JSON object: unknown fields and wrong types are one-line ConfigErrors."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a JSON object, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    obj = cls()
    for name, value in raw.items():
        if cls is ModelConfig and name == "head_dim":  # derived (ModelConfig.head_dim): from_dict checks its value
            check_type(where, name, value, int)
            continue
        if name not in fields:
            known = ", ".join(fields)
            raise ConfigError(f"{where}: unknown field {brief(name)} (known: {known})")
        if cls is TrainConfig and name == "micro_batch":
            setattr(obj, name, micro_batch_value(where, value))
            continue
        typ = {"int": int, "float": float, "str": str, "bool": bool, "list[Any]": list}[str(fields[name].type)]
        setattr(obj, name, check_type(where, name, value, typ))
    return obj


def micro_batch_value(where: str, value: Any) -> int | str:
    """train.micro_batch: an int (its bounds: validate) or "auto"; ConfigError naming where otherwise."""
    if value == AUTO or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ConfigError(
        f"{where}: field 'micro_batch' must be an int or {AUTO!r}, got {type(value).__name__} {brief(value)}"
    )


def check_data_parallel(t: TrainConfig) -> None:
    """What a data-parallel job needs of train: a micro-batch given as a number (with "auto" each rank would pick
    by its own card's free memory); ConfigError otherwise."""
    if t.micro_batch == AUTO:
        raise ConfigError(
            "train.micro_batch 'auto' is one process's choice: under data parallel give it as a number "
            "(the one `microgpt train --micro-batch auto` prints on one card)"
        )


def validate(exp: Experiment, src: str) -> Experiment:
    """Impossible values, each with the file and the field."""
    m, t, d = exp.model, exp.train, exp.data
    positive = [("model", m, ("vocab_size", "d_model", "n_layer", "n_head", "seq_len"))]
    counts = ("micro_batch", "n_micro", "steps", "eval_every", "eval_batches", "ckpt_every", "log_every")
    positive.append(("train", t, counts))
    for sec, obj, names in positive:
        for name in names:
            value = getattr(obj, name)
            if value == AUTO:
                continue
            if value <= 0:
                raise ConfigError(f"{src}: {sec}.{name} must be > 0, got {brief(value)}")
            if value > INT_MAX and sec == "train":  # model sizes: the memory plan refuses what cannot fit
                raise ConfigError(f"{src}: {sec}.{name} must be at most {INT_MAX:,}, got {brief(value)}")
    if m.n_layer > MAX_LAYERS:
        raise ConfigError(f"{src}: model.n_layer must be at most {MAX_LAYERS}, got {brief(m.n_layer)}")
    if m.d_model % m.n_head:
        raise ConfigError(f"{src}: model.d_model ({m.d_model}) must be divisible by model.n_head ({m.n_head})")
    _check_family(m, t, src)
    if m.vocab_size > 65536:
        raise ConfigError(f"{src}: model.vocab_size {m.vocab_size} does not fit the uint16 token shards (max 65536)")
    if not 0 < t.lr < 1 or not 0 <= t.min_lr <= t.lr:
        raise ConfigError(f"{src}: train.lr must be in (0, 1) and train.min_lr in [0, lr], got {t.lr}, {t.min_lr}")
    if not 0 <= t.warmup_steps <= INT_MAX:
        raise ConfigError(f"{src}: train.warmup_steps must be in [0, {INT_MAX}], got {brief(t.warmup_steps)}")
    if not 0 <= t.batch_warmup_steps <= INT_MAX:
        raise ConfigError(
            f"{src}: train.batch_warmup_steps must be in [0, {INT_MAX}] (0: none), got {brief(t.batch_warmup_steps)}"
        )
    if not 1 <= t.batch_warmup_start <= t.n_micro:
        bad = brief(t.batch_warmup_start)
        raise ConfigError(f"{src}: train.batch_warmup_start must be in [1, train.n_micro ({t.n_micro})], got {bad}")
    if not 0 <= t.seed <= SEED_MAX:
        raise ConfigError(f"{src}: train.seed must be in [0, 2**63), got {brief(t.seed)}")
    for name in ("hellaswag_every", "hellaswag_examples"):
        if not 0 <= getattr(t, name) <= INT_MAX:
            raise ConfigError(
                f"{src}: train.{name} must be in [0, {INT_MAX}] (0: {HELLASWAG_ZERO[name]}), got "
                f"{brief(getattr(t, name))}"
            )
    if not 0 <= t.memory_margin <= 1 << 20:
        raise ConfigError(f"{src}: train.memory_margin must be in [0, 2**20] GiB, got {t.memory_margin}")
    if not 0 <= t.schedule_start < t.steps:
        raise ConfigError(f"{src}: train.schedule_start must be in [0, steps), got {t.schedule_start}")
    if t.schedule_steps and not t.schedule_start < t.schedule_steps <= INT_MAX:
        raise ConfigError(
            f"{src}: train.schedule_steps must be 0 (train.steps) or in (schedule_start, "
            f"{INT_MAX}], got {brief(t.schedule_steps)}"
        )
    if not (0 <= t.beta1 < 1 and 0 <= t.beta2 < 1):
        raise ConfigError(f"{src}: train.beta1 and train.beta2 must be in [0, 1), got {t.beta1}, {t.beta2}")
    for name, value in (("eps", t.eps), ("weight_decay", -t.weight_decay), ("grad_clip", -t.grad_clip)):
        if (value <= 0) if name == "eps" else (value > 0):
            bound = "> 0" if name == "eps" else ">= 0"
            raise ConfigError(f"{src}: train.{name} must be {bound}, got {getattr(t, name)}")
    if t.precision not in PRECISIONS:
        raise ConfigError(f"{src}: train.precision must be one of {', '.join(PRECISIONS)}, got {brief(t.precision)}")
    if t.backend not in BACKENDS:
        raise ConfigError(f"{src}: train.backend must be one of {', '.join(BACKENDS)}, got {brief(t.backend)}")
    if t.backend == "numpy" and t.precision not in NUMPY_PRECISIONS:
        raise ConfigError(
            f"{src}: train.precision {t.precision!r} needs train.backend 'triton' (numpy computes in "
            "fp32, with fp8's E4M3 linears as the reference)"
        )
    if t.precision == "fp8" and m.d_model % 16:
        raise ConfigError(
            f"{src}: model.d_model ({m.d_model}) must be a multiple of 16 for train.precision 'fp8' "
            "(the FP8 GEMMs' operand dimensions)"
        )
    if d.max_bytes <= 0:
        raise ConfigError(f"{src}: data.max_bytes must be > 0, got {brief(d.max_bytes)}")
    if not 0 < d.val_fraction < 1:
        raise ConfigError(f"{src}: data.val_fraction must be in (0, 1), got {d.val_fraction}")
    return exp


def _check_family(m: ModelConfig, t: TrainConfig, src: str) -> None:
    """The block family's fields and the optimizer and schedule that go with them."""
    for sec, name, value, choices in (
        ("model", "block", m.block, BLOCKS),
        ("train", "optimizer", t.optimizer, OPTIMIZERS),
        ("train", "schedule", t.schedule, SCHEDULES),
    ):
        if value not in choices:
            raise ConfigError(f"{src}: {sec}.{name} must be one of {', '.join(choices)}, got {brief(value)}")
    if m.block == "modern" and m.head_dim % 2:
        raise ConfigError(
            f"{src}: model.head_dim (d_model / n_head) must be even for model.block 'modern' (rotary pairs), got "
            f"{m.head_dim}"
        )
    if m.softcap < 0 or m.rope_base <= 1:
        raise ConfigError(f"{src}: model.softcap must be >= 0 and model.rope_base > 1, got {m.softcap}, {m.rope_base}")
    if m.value_embeds and (m.block != "modern" or not 0 < 2 * m.value_embeds <= m.n_layer):
        raise ConfigError(
            f"{src}: model.value_embeds needs model.block 'modern' and 0 <= 2 x value_embeds <= model.n_layer "
            f"({m.n_layer}), got {m.value_embeds} on block {brief(m.block)}"
        )
    if m.skips and (m.block != "modern" or not 0 < 2 * m.skips <= m.n_layer):
        raise ConfigError(
            f"{src}: model.skips needs model.block 'modern' and 0 <= 2 x skips <= model.n_layer ({m.n_layer}), got "
            f"{m.skips} on block {brief(m.block)}"
        )
    _check_window(m, t, src)
    if t.optimizer == "muon" and m.block != "modern":
        raise ConfigError(
            f"{src}: train.optimizer 'muon' needs model.block 'modern' (its matrices are Muon's; "
            "ANDREA's GPT-2 block trains with adamw)"
        )
    if not 0 < t.warmdown_frac <= 1:
        raise ConfigError(f"{src}: train.warmdown_frac must be in (0, 1], got {t.warmdown_frac}")
    if not (0 <= t.head_lr < 1 and 0 < t.muon_lr < 1):
        raise ConfigError(
            f"{src}: train.head_lr must be in [0, 1) and train.muon_lr in (0, 1), got {t.head_lr}, {t.muon_lr}"
        )
    if not (0 <= t.muon_momentum_start < 1 and 0 <= t.muon_momentum < 1):
        raise ConfigError(
            f"{src}: train.muon_momentum and train.muon_momentum_start must be in [0, 1), got "
            f"{t.muon_momentum}, {t.muon_momentum_start}"
        )
    if not 0 <= t.muon_momentum_warmup <= INT_MAX or t.muon_weight_decay < 0:
        raise ConfigError(
            f"{src}: train.muon_momentum_warmup must be in [0, {INT_MAX}] and train.muon_weight_decay "
            f">= 0, got {brief(t.muon_momentum_warmup)}, {t.muon_weight_decay}"
        )
    if not 1 <= t.muon_ns_steps <= MAX_NS_STEPS:
        raise ConfigError(f"{src}: train.muon_ns_steps must be in [1, {MAX_NS_STEPS}], got {brief(t.muon_ns_steps)}")


WINDOW_TILE = 16  # the attention kernels' smallest key tile: a scheduled window is a whole number of them


def _check_window(m: ModelConfig, t: TrainConfig, src: str) -> None:
    """The attention window, its schedule and the document mask (the modern block's: ops/attention.py)."""
    if m.attn_window and (m.block != "modern" or not 0 < m.attn_window <= m.seq_len):
        raise ConfigError(
            f"{src}: model.attn_window needs model.block 'modern' and must be in [0, model.seq_len ({m.seq_len})] "
            f"(0: the whole sequence), got {brief(m.attn_window)} on block {brief(m.block)}"
        )
    if m.doc_mask != -1 and (m.block != "modern" or not 0 <= m.doc_mask < m.vocab_size):
        raise ConfigError(
            f"{src}: model.doc_mask needs model.block 'modern' and must be -1 (off) or the <|endoftext|> id in [0, "
            f"model.vocab_size ({m.vocab_size})), got {brief(m.doc_mask)} on block {brief(m.block)}"
        )
    final = m.attn_window or m.seq_len
    if t.attn_window_start and (m.block != "modern" or not 0 < t.attn_window_start < final):
        raise ConfigError(
            f"{src}: train.attn_window_start needs model.block 'modern' and must be 0 (no schedule) or in (0, "
            f"{final}) (model.attn_window, or model.seq_len where it is 0), got {brief(t.attn_window_start)}"
        )
    if t.attn_window_start % WINDOW_TILE:
        raise ConfigError(
            f"{src}: train.attn_window_start must be a multiple of {WINDOW_TILE} (the attention kernels' smallest key "
            f"tile: each window it schedules then skips whole tiles), got {brief(t.attn_window_start)}"
        )
    if not (0 < t.attn_window_every <= INT_MAX if t.attn_window_start else t.attn_window_every == 0):
        raise ConfigError(
            f"{src}: train.attn_window_every must be in [1, {INT_MAX}] with train.attn_window_start (the steps between "
            f"widenings), and 0 without, got {brief(t.attn_window_every)}"
        )


def from_dict(raw: Any, src: str = "<config>") -> Experiment:
    if not isinstance(raw, dict):
        raise ConfigError(f"{src}: the experiment must be a JSON object")
    exp = Experiment()
    for key, value in raw.items():
        if key == "name":
            exp.name = check_type(src, "name", value, str)
        elif key in SECTIONS:
            setattr(exp, key, build_section(SECTIONS[key], value, f"{src}: {key}"))
        elif key in EXTRA_SECTIONS:
            exp.extra[key] = value
        else:
            known = ", ".join(["name", *SECTIONS, *EXTRA_SECTIONS])
            raise ConfigError(f"{src}: unknown field {brief(key)} (known: {known})")
    validate(exp, src)
    m, named = exp.model, raw.get("model", {}).get("head_dim", 0)  # derived: an experiment that names it must agree
    if named and named != m.head_dim:
        raise ConfigError(
            f"{src}: model.head_dim ({named}) x model.n_head ({m.n_head}) must be model.d_model ({m.d_model}); "
            "leave it out (or 0): d_model / n_head"
        )
    return exp


def read_raw(path: str | Path) -> Any:
    """The experiment file's JSON value, not yet checked; ConfigError naming the file when it cannot be read, is
    not UTF-8 or not strict JSON (fileio.read_json: a key twice, nesting too deep)."""
    try:
        return read_json(Path(path), "experiment file", ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"{path}: cannot read experiment file (no such file)") from None


def load(path: str | Path, sets: Sequence[str] = (), **train: Any) -> Experiment:
    """The experiment file with `--set` assignments and train-field flags applied (see apply_overrides)."""
    return apply_overrides(read_raw(path), str(path), sets, **train)[1]


def parse_assignment(assignment: str, src: str = "--set") -> tuple[str, str, Any]:
    """`section.field=value` -> (section, field, value); the value is parsed as JSON, else taken as a string."""
    key, sep, text = assignment.partition("=")
    section, dot, name = key.partition(".")
    if not sep or not dot or section not in SECTIONS:
        sections = ", ".join(SECTIONS)
        raise ConfigError(f"{src} {brief(assignment)}: expected section.field=value with section in {sections}")
    try:
        return section, name, parse_json(text, src)
    except InputError:
        return section, name, text


def apply_overrides(raw: Any, src: str, sets: Sequence[str] = (), **train: Any) -> tuple[dict[str, Any], Experiment]:
    """Apply `--set` assignments, then each train flag that is not None (steps, seed, backend, precision set the
    train field of the same name), to the raw experiment from src.

    Returns the raw experiment with only the assignments applied (what the file says as amended; the proxy hashes
    it to recognize its run) and the checked Experiment with everything applied. The file is checked alone first
    (an error names the file), each override's field and type as it is read (an error names the flag), then the
    whole (an impossible combination names the file and the flags that changed it)."""
    exp = from_dict(raw, src)
    changes = [(*parse_assignment(a), f"--set {a.partition('=')[0]}") for a in sets]
    changes += [
        ("train", name, value, "--" + name.replace("_", "-")) for name, value in train.items() if value is not None
    ]
    if not changes:
        return raw, exp
    amended = _set_fields(raw, changes[: len(sets)])
    flags = " ".join(flag for *_, flag in changes)
    return amended, from_dict(_set_fields(amended, changes[len(sets) :]), f"{src} with {flags}")


def _set_fields(raw: dict[str, Any], changes: list[tuple[str, str, Any, str]]) -> dict[str, Any]:
    """A copy of raw with each (section, field, value, flag) set; the field and its type checked, naming the flag."""
    raw = copy.deepcopy(raw)
    for section, name, value, flag in changes:
        build_section(SECTIONS[section], {name: value}, f"{flag}: {section}")
        fields = raw.setdefault(section, {})
        before = fields.get(name, TrainConfig.micro_batch) if (section, name) == ("train", "micro_batch") else None
        if value == AUTO and before not in (None, AUTO):  # auto keeps the step's sequences: n_micro counts them
            fields["n_micro"] = before * fields.get("n_micro", TrainConfig.n_micro)
            if "batch_warmup_start" in fields or fields.get("batch_warmup_steps"):  # and so does the warmup's start
                fields["batch_warmup_start"] = before * fields.get("batch_warmup_start", TrainConfig.batch_warmup_start)
        fields[name] = value
    return raw


def override(exp: Experiment, assignment: str) -> Experiment:
    """exp with one `section.field=value` assignment applied."""
    return apply_overrides(exp.to_dict(), "<config>", [assignment])[1]


TRAIN_FLAGS = ("steps", "seed", "backend", "precision", "micro_batch", "memory_margin")  # each sets that train field
TRACKERS = ("tensorboard", "wandb", "trackio")  # --track (microgpt/run/trackers.py)
# How to install each tracker's package: the 'trackers' extra holds TensorBoard and W&B; trackio is its own package.
TRACKER_INSTALL = {"tensorboard": "pip install -e '.[trackers]'", "wandb": "pip install -e '.[trackers]'",
                   "trackio": "pip install trackio"}  # fmt: skip


def add_experiment_flags(p: argparse.ArgumentParser) -> None:
    """The flags `microgpt train` and `microgpt run` share, declared once: the same names, types and checks."""
    p.add_argument("experiment", help="an experiment file: experiments/ANDREA-*.json")
    p.add_argument("--out", help="run folder (default runs/<name>)")
    p.add_argument("--steps", type=int, help="the run's last global step: train.steps (under `run`: caps the phases)")
    p.add_argument("--seed", type=int, help="override train.seed")
    p.add_argument("--backend", choices=BACKENDS, help="override train.backend")
    p.add_argument("--precision", choices=PRECISIONS, help="override train.precision")
    p.add_argument(
        "--micro-batch",
        type=_micro_batch_flag,
        metavar="N|auto",
        help="override train.micro_batch; auto: the largest whose memory plan fits the device, with the "
        "n_micro that keeps the recipe's sequences a step",
    )
    p.add_argument(
        "--memory-margin",
        type=float,
        metavar="GIB",
        help="override train.memory_margin: the GiB of free device memory the plan leaves to what runs "
        f"beside it ({TrainConfig.memory_margin})",
    )
    p.add_argument(
        "--data",
        metavar="DIR",
        help="train on the token shards in DIR (`microgpt prep ... --out DIR`): data.source 'shards', data.path DIR",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override any config field (the value is read as JSON, else as a string)",
    )
    p.add_argument(
        "--track",
        action="append",
        default=[],
        metavar="tensorboard|wandb|trackio",
        help="also send the run's records to a tracker (microgpt/run/trackers.py says what each installs)",
    )
    p.add_argument(
        "--init",
        metavar="CKPT_OR_RUN_DIR",
        help="start a new run from these weights (a checkpoint, or a run folder's newest): fresh "
        "optimizer state, step 0, its own schedule; unused when resuming",
    )
    p.add_argument(
        "--procs",
        "--gpus",
        dest="procs",
        type=int,
        metavar="N",
        help="data parallel over N processes: one GPU each (triton, NCCL) or CPU processes (numpy, gloo); "
        "torchrun-style RANK/WORLD_SIZE in the environment join a job instead",
    )


def _micro_batch_flag(text: str) -> int | str:
    if text == AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or {AUTO!r}, got {text!r}") from None


def check_flags(args: argparse.Namespace) -> None:
    """The shared flags' own limits, checked before the experiment is read."""
    for flag in ("steps", "procs"):  # --procs: the machine's own bound is job.check_job's
        if getattr(args, flag) is not None:
            check_number(getattr(args, flag), f"--{flag}", 1, INT_MAX, integer=True, error=ConfigError)
    for name in args.track:
        if name not in TRACKERS:
            raise ConfigError(f"--track {name}: unknown tracker (known: {', '.join(TRACKERS)})")
        if importlib.util.find_spec(name) is None:  # found, not imported: before the run folder is made
            raise ConfigError(tracker_missing(name))


def tracker_missing(name: str) -> str:
    """The one line for a tracker whose package is not installed, with the command that installs it."""
    return f"--track {name}: the {name} package is not installed ({TRACKER_INSTALL[name]})"


def train_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The shared flags that set train fields, as apply_overrides takes them."""
    return {name: getattr(args, name) for name in TRAIN_FLAGS}


def experiment_sets(args: argparse.Namespace) -> list[str]:
    """The shared flags that set fields by assignment: every --set, then --data DIR's (data.source "shards",
    data.path DIR, and no data.prep: the data are the user's own)."""
    own = ["data.source=shards", f"data.path={json.dumps(args.data)}", 'data.prep=""'] if args.data else []
    return [*args.set, *own]


def from_flags(args: argparse.Namespace) -> Experiment:
    """The experiment of `microgpt train`: the file, then --set and --data, then --steps, --seed, --backend,
    --precision, --micro-batch, --memory-margin."""
    check_flags(args)
    return load(args.experiment, experiment_sets(args), **train_flags(args))
