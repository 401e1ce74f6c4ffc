"""The training state: everything a run carries from one optimizer step to the next, and its checkpoint.

`make_state(m, t, K)` plans the memory (memory.plan: the model's buffers, the precision's and the backend's own
rows), makes the one arena allocation, binds the backend and its precision to it, and fills in the weights from
the seed: the engine, bench, dev scripts and tests all start from here. The state converts to and from the seed's
checkpoint format: the fp32 weights, Adam m and v in the canonical order; the step, the loss scaler and what the
precision keeps across steps (fp8: the operands' amax histories) ride in the sidecar.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from microgpt import checkpoint, config, memory, model, params
from microgpt.backend import Backend
from microgpt.config import ModelConfig, TrainConfig
from microgpt.precision import Precision, PrecisionState

GROWTH_INTERVAL = 2000  # fp16: good steps before the loss scale doubles (as torch.amp.GradScaler)


@dataclass
class LossScaler:
    """fp16's dynamic loss scale: the loss head multiplies its gradient by `scale`, AdamW divides it out again.
    An overflow (a non-finite gradient norm: that step updated nothing) halves it; GROWTH_INTERVAL good steps in a
    row double it. Static at 1 for fp32 and bf16."""

    dynamic: bool = False
    scale: float = 1.0
    good_steps: int = 0

    @classmethod
    def for_precision(cls, prec: Precision) -> LossScaler:
        return cls(dynamic=True, scale=2.0**16) if prec.loss_scaling else cls()

    def update(self, finite: bool) -> None:
        if not self.dynamic:
            return
        if not finite:
            self.scale, self.good_steps = max(1.0, self.scale / 2), 0
            return
        self.good_steps += 1
        if self.good_steps % GROWTH_INTERVAL == 0:
            self.scale = min(2.0**24, self.scale * 2)


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

    @property
    def n_params(self) -> int:
        return params.n_params(self.m)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Weights, m, v, step and loss scaler from a checkpoint of this model; returns its sidecar."""
        ck, side = checkpoint.load(path, self.n_params)
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

    def save_checkpoint(self, path: Path, meta: dict[str, Any]) -> Path:
        """The seed-format file of the last completed step, with meta and the loss scaler in its sidecar."""
        self.K.synchronize()
        host = [self.K.to_numpy(a) for a in (self.p, self.adam_m, self.adam_v)]
        meta = {**meta, "loss_scale": self.scaler.scale, "loss_scale_good_steps": self.scaler.good_steps,
                "params": [[n, list(s)] for n, s in params.param_shapes(self.m)], **self.prec.sidecar()}  # fmt: skip
        return checkpoint.write_checkpoint(path, self.step, *host, meta)


def make_state(m: ModelConfig, t: TrainConfig, K: Backend) -> TrainState:
    """The whole plan allocated once, the backend bound to it, weights from t.seed, m = v = grads = 0."""
    prec = K.precision
    bufs = memory.plan(m, t, prec, K.logits_rows(m, t.micro_batch), K.rows(m, t))
    plan = memory.check_fits(bufs, prec, m, K.memory_bytes(), K.device)
    arena = memory.Arena(plan, K)
    K, bound = K.bind(arena, m)
    compute = "compute_params" if prec.compute_copy else "params"
    p = arena.flat("params")
    S = TrainState(
        K=K, m=m, t=t, plan=plan, arena=arena, P=params.named(p, m),
        P_compute=bound.weights(params.views(arena.flat(compute), m)), G=params.views(arena.flat("grads"), m),
        p=p, g=arena.flat("grads"), adam_m=arena.flat("adam_m"), adam_v=arena.flat("adam_v"),
        p_compute=arena.flat(compute) if compute != "params" else None, prec=bound,
        scaler=LossScaler.for_precision(prec),
    )  # fmt: skip
    S.set_weights(params.init_weights(m, t.seed))
    K.copy_in(arena["decay_mask"], params.decay_mask(m))
    return S


@dataclass
class InferState:
    """A model for the inference step (model.gpt_infer): the inference plan's arena (weights, KV cache and one layer's
    activations for up to B sequences of seq_len), the backend and the precision bound to it."""

    K: Backend  # bound to this state's arena
    m: ModelConfig
    B: int  # sequences the plan holds
    plan: list[memory.Buf]
    arena: memory.Arena
    P_compute: dict[str, Any]  # the weights the model reads, as TrainState's
    prec: PrecisionState

    def load_weights(self, weights: np.ndarray) -> None:
        """The flat fp32 weights (n_params,), canonical order, into the masters and what the precision computes
        with."""
        self.K.copy_in(self.arena.flat("params"), weights)
        if self.K.precision.compute_copy:
            self.K.copy_in(self.arena.flat("compute_params"), weights)
        self.prec.cast_weights()

    def inputs(self, b: int, t: int) -> tuple[Any, Any]:
        """The planned tokens and targets as contiguous (b, t) windows, for b * t <= B * seq_len tokens (and b <= B
        where the plan has a KV cache)."""
        return tuple(self.arena[name].reshape(-1)[: b * t].reshape(b, t) for name in ("tokens", "targets"))

    def run(self, tokens: Any, pos: int, targets: Any = None) -> None:
        """One inference step (model.gpt_infer) on planned tokens (b, t) at positions pos .. pos + t - 1, then the
        precision's end of an evaluation forward (fp8: what its casts met is forgotten)."""
        model.gpt_infer(self.K, self.m, self.P_compute, self.arena, tokens, pos, targets)
        self.prec.end_eval()


def make_infer_state(m: ModelConfig, K: Backend, B: int, weights: np.ndarray, cache: bool = True) -> InferState:
    """The inference plan for B sequences (memory.inference_plan; cache False: windows from position 0 only)
    allocated once, the backend bound to it, the weights loaded."""
    prec = K.precision
    bufs = memory.inference_plan(m, prec, B, K.logits_rows(m, B), K.infer_rows(m, B), cache)
    plan = memory.check_fits(bufs, prec, m, K.memory_bytes(), K.device)
    arena = memory.Arena(plan, K)
    K, bound = K.bind(arena, m)
    compute = "compute_params" if prec.compute_copy else "params"
    S = InferState(K, m, B, plan, arena, bound.weights(params.views(arena.flat(compute), m)), bound)
    S.load_weights(weights)
    return S
