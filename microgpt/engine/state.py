"""The training state: everything a run carries from one optimizer step to the next, and its checkpoint.

`make_state(m, t, K)` plans the memory (memory.plan: the model's buffers, the precision's and the backend's own
rows), makes the one arena allocation, binds the backend and its precision to it, and fills in the weights from
the seed: the engine, bench, dev scripts and tests all start from here. The state converts to and from the seed's
checkpoint format: the fp32 weights, Adam m and v in the canonical order; the step, the loss scaler and what the
precision keeps across steps (fp8: the operands' amax histories) ride in the sidecar.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from microgpt import checkpoint, config
from microgpt.config import ModelConfig, TrainConfig
from microgpt.engine import memory, optim, params
from microgpt.engine.backend import Backend
from microgpt.engine.precision import LossScaler, PrecisionState, check_sidecar
from microgpt.fileio import Anchor
from microgpt.ops.qkrope import rope_tables


@dataclass
class TrainState:
    K: Backend  # bound to this state's arena
    m: ModelConfig
    t: TrainConfig
    plan: list[memory.Buf]
    arena: memory.Arena
    P: dict[str, Any]  # fp32 master weights, named views in the canonical order
    P_compute: dict[str, Any]  # the weights the model reads (params.views of the compute copy, or of P's array in
    # fp32), as the precision hands them to its GEMM sites (PrecisionState.weights)
    G: dict[str, Any]  # gradients, same names and shapes (and each layer's "h{l}.w_qkv")
    p: Any  # flat views of the same four arrays: n_params long
    g: Any
    adam_m: Any
    adam_v: Any
    p_compute: Any  # flat compute copy, or None in fp32
    prec: PrecisionState  # the precision bound to this arena: its matmul and what it keeps across steps
    scaler: LossScaler = field(default_factory=LossScaler)
    step: int = 0  # optimizer steps completed
    # train.optimizer "muon": the backend's muon_step bound to this model's groups, its planned scratch and
    # train.muon_ns_steps
    muon: Callable[..., None] | None = None

    @property
    def n_params(self) -> int:
        return params.n_params(self.m)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Weights, m, v, step and loss scaler from a checkpoint of this model; returns its sidecar."""
        ck, side = checkpoint.load(path, self.n_params)
        check_sidecar(side, str(checkpoint.sidecar_path(path)))
        saved = side.get("config", {}).get("model")
        if saved is not None:
            where = f"{checkpoint.sidecar_path(path)}: field 'config.model'"
            saved = asdict(config.build_section(ModelConfig, saved, where))
            diff = next((k for k in saved if saved[k] != asdict(self.m)[k]), None)
            if diff is not None:
                raise checkpoint.CheckpointError(f"{path}: checkpoint is for another model (model.{diff} differs)")
        self.set_weights(ck.weights)
        for dst, src in ((self.adam_m, ck.m), (self.adam_v, ck.v)):
            self.K.copy_in(dst, src)
        self.prec.load_sidecar(side, str(checkpoint.sidecar_path(path)))
        self.step = ck.step
        self.scaler.scale = float(side.get("loss_scale", self.scaler.scale))
        self.scaler.good_steps = int(side.get("loss_scale_good_steps", 0))
        return side

    def set_weights(self, weights: np.ndarray) -> None:
        """The fp32 masters from (n_params,) weights in the canonical order, and what follows them: the compute copy,
        what the precision keeps of them (fp8's E4M3 copies). Adam m and v, the step and the loss scaler are left as
        they are (make_state's, for `train --init`: another run's weights, a new run's optimizer)."""
        self.K.copy_in(self.p, weights)
        if self.p_compute is not None:
            self.K.copy_in(self.p_compute, weights)
        self.prec.cast_weights()

    def save_checkpoint(self, path: Path, meta: dict[str, Any], anchor: Anchor | None = None) -> Path:
        """The seed-format file of the last completed step, with meta and the loss scaler in its sidecar (written
        through anchor, the run folder's lock, where one is held: fileio.Anchor)."""
        self.K.synchronize()
        host = [self.K.to_numpy(a) for a in (self.p, self.adam_m, self.adam_v)]
        meta = {
            **meta,
            "loss_scale": self.scaler.scale,
            "loss_scale_good_steps": self.scaler.good_steps,
            "params": [[n, list(s)] for n, s in params.param_shapes(self.m)],
            **self.prec.sidecar(),
        }
        return checkpoint.write_checkpoint(path, self.step, *host, meta, anchor)


def training_plan(m: ModelConfig, t: TrainConfig, K: Backend) -> list[memory.Buf]:
    """Every buffer of a training step of t.micro_batch sequences on K: the model's, its precision's, its own."""
    rows = [*K.rows(m, t), *optim.rows(m, t, K.muon_scratch)]
    return memory.plan(m, t, K.precision, K.logits_rows(m, t.micro_batch), rows)


def _sequences(t: TrainConfig) -> int:
    """The sequences a step takes: micro_batch x n_micro (n_micro itself under "auto": config.py)."""
    return t.n_micro * (1 if t.micro_batch == config.AUTO else t.micro_batch)


def _divides(t: TrainConfig) -> int:
    """What a micro-batch must divide: the step's sequences and, with a batch warmup, its first step's (so that both
    are whole micro-batches)."""
    first = t.batch_warmup_start * (1 if t.micro_batch == config.AUTO else t.micro_batch)
    return math.gcd(_sequences(t), first) if t.batch_warmup_steps else _sequences(t)


def _plan_bytes(m: ModelConfig, t: TrainConfig, K: Backend, B: int) -> int:
    """The bytes of the training plan for micro-batch B, with t's sequences a step."""
    bufs = training_plan(m, dataclasses.replace(t, micro_batch=B, n_micro=_sequences(t) // B), K)
    return sum(memory.role_bytes(bufs, K.precision).values())


def _fitting(
    m: ModelConfig, t: TrainConfig, K: Backend, available: int, below: int | None = None
) -> tuple[int, int] | None:
    """(micro-batch, plan bytes) of the largest micro-batch that fits available bytes and keeps t's sequences a
    step, and a batch warmup's first (memory.largest_fitting)."""
    return memory.largest_fitting(lambda B: _plan_bytes(m, t, K, B), _divides(t), available, below)


def auto_micro_batch(m: ModelConfig, t: TrainConfig, K: Backend, room: int | None, margin: int) -> TrainConfig:
    """t with train.micro_batch "auto" resolved: the largest micro-batch whose plan fits the room the device has
    for it less the margin, and the n_micro that keeps the step's sequences (the batch_warmup_start that keeps a
    batch warmup's first step's: under "auto" both count sequences); one line on stderr says why."""
    S, device = _sequences(t), f"{K.device}"
    if room is None:
        raise memory.PlanError(
            f"train.micro_batch 'auto': the device ({device}) does not say how much memory it has; "
            "give train.micro_batch as a number"
        )
    found = _fitting(m, t, K, room - margin)
    if found is None:
        need = _plan_bytes(m, t, K, 1)
        raise memory.PlanError(
            f"train.micro_batch 'auto': no micro-batch fits the device ({device}): a micro-batch "
            f"of 1 needs {need / memory.GIB:.2f} GiB of the {room / memory.GIB:.2f} GiB available "
            f"(less train.memory_margin {margin / memory.GIB:.2f} GiB); lower the model's sizes "
            "(model.d_model, model.n_layer, model.seq_len)"
        )
    B, nbytes = found
    print(
        f"train.micro_batch auto: {B} x n_micro {S // B} = {S} sequences a step, the largest micro-batch whose "
        f"plan ({nbytes / memory.GIB:.2f} GiB) fits the {(room - margin) / memory.GIB:.2f} GiB {device} has for it "
        f"({room / memory.GIB:.2f} GiB available less train.memory_margin {margin / memory.GIB:.2f} GiB)",
        file=sys.stderr,
    )
    return dataclasses.replace(t, micro_batch=B, n_micro=S // B, batch_warmup_start=max(1, t.batch_warmup_start // B))


def _refit(m: ModelConfig, t: TrainConfig, K: Backend, available: int) -> str:
    """What would fit instead of t's micro-batch (the PlanError's hint)."""
    found, S = _fitting(m, t, K, available, below=t.micro_batch), _sequences(t)
    if found is None:
        return (
            f"no micro-batch of the {S:,} sequences a step (train.micro_batch x train.n_micro) fits: lower them "
            "or the model's sizes (model.d_model, model.n_layer, model.seq_len)"
        )
    B, nbytes = found
    first = f", train.batch_warmup_start {t.batch_warmup_start * t.micro_batch // B}" if t.batch_warmup_steps else ""
    return (
        f"train.micro_batch {B} with train.n_micro {S // B}{first} fits ({nbytes / memory.GIB:.2f} GiB) and keeps the "
        f"{S} sequences a step (--micro-batch auto picks it)"
    )


def make_state(m: ModelConfig, t: TrainConfig, K: Backend) -> TrainState:
    """The whole plan allocated once, the backend bound to it, weights from t.seed, m = v = grads = 0. The plan is
    checked against the device's memory first (less t.memory_margin); micro_batch "auto" becomes the largest that
    fits (S.t holds what runs)."""
    prec = K.precision
    room, margin = K.memory_bytes(), round(t.memory_margin * memory.GIB)
    if t.micro_batch == config.AUTO:
        t = auto_micro_batch(m, t, K, room, margin)
    bufs = training_plan(m, t, K)
    hint = None if room is None else (lambda: _refit(m, t, K, room - margin))
    plan = memory.check_fits(bufs, prec, m, room, K.device, margin, hint)
    arena = memory.Arena(plan, K)
    K, bound = K.bind(arena, m)
    compute = "compute_params" if prec.compute_copy else "params"
    p = arena.flat("params")
    S = TrainState(
        K=K,
        m=m,
        t=t,
        plan=plan,
        arena=arena,
        P=params.named(p, m),
        P_compute=bound.weights(params.views(arena.flat(compute), m)),
        G=params.views(arena.flat("grads"), m),
        p=p,
        g=arena.flat("grads"),
        adam_m=arena.flat("adam_m"),
        adam_v=arena.flat("adam_v"),
        p_compute=arena.flat(compute) if compute != "params" else None,
        prec=bound,
        scaler=LossScaler.for_precision(prec),
    )
    if t.optimizer == "muon":
        work = optim.scratch(m, t, K.muon_scratch)
        for s in work:
            if s.fill is not None:  # what the kernels read before the first step writes (Muon's offsets)
                K.copy_in(arena[s.buffer], np.array(s.fill, np.int32))
        S.muon = functools.partial(
            K.muon_step,
            groups=optim.groups(m),
            ns_steps=t.muon_ns_steps,
            **{s.keyword: arena[s.buffer] for s in work},
        )
    S.set_weights(params.init_weights(m, t.seed))
    K.copy_in(arena["decay_mask"], params.decay_mask(m))
    fill_tables(K, m, arena)
    return S


def fill_tables(K: Backend, m: ModelConfig, arena: memory.Arena | dict[str, Any]) -> None:
    """The plan's constant tables (memory.tables), written once: the modern block's rotary cos and sin; and the
    model's attention window where the plan has one (a training step writes its own over it: Step)."""
    if "rope" in arena:
        K.copy_in(arena["rope"], rope_tables(m.seq_len, m.head_dim, m.rope_base))
    if "attn_window" in arena:
        K.copy_in(arena["attn_window"], np.array([m.attn_window or m.seq_len], np.int32))
