"""The training state: everything a run carries from one optimizer step to the next, and its checkpoint.

`make_state(m, t, K)` plans the memory (memory.plan: the model's buffers, the precision's and the backend's own
rows), makes the one arena allocation, binds the backend and its precision to it, and fills in the weights from
the seed: the engine, bench, dev scripts and tests all start from here. The state converts to and from the seed's
checkpoint format: the fp32 weights, Adam m and v in the canonical order; the step, the loss scaler and what the
precision keeps across steps (fp8: the operands' amax histories) ride in the sidecar.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
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


def training_plan(m: ModelConfig, t: TrainConfig, K: Backend) -> list[memory.Buf]:
    """Every buffer of a training step of t.micro_batch sequences on K: the model's, its precision's, its own."""
    return memory.plan(m, t, K.precision, K.logits_rows(m, t.micro_batch), K.rows(m, t))


def _sequences(t: TrainConfig) -> int:
    """The sequences a step takes: micro_batch x n_micro (n_micro itself under "auto": config.py)."""
    return t.n_micro * (1 if t.micro_batch == config.AUTO else t.micro_batch)


def _plan_bytes(m: ModelConfig, t: TrainConfig, K: Backend, B: int) -> int:
    """The bytes of the training plan for micro-batch B, with t's sequences a step."""
    bufs = training_plan(m, dataclasses.replace(t, micro_batch=B, n_micro=_sequences(t) // B), K)
    return sum(memory.role_bytes(bufs, K.precision).values())


def _fitting(m: ModelConfig, t: TrainConfig, K: Backend, available: int,
             below: int | None = None) -> tuple[int, int] | None:  # fmt: skip
    """(micro-batch, plan bytes) of the largest micro-batch that fits available bytes and keeps t's sequences a
    step (memory.largest_fitting)."""
    return memory.largest_fitting(lambda B: _plan_bytes(m, t, K, B), _sequences(t), available, below)


def auto_micro_batch(m: ModelConfig, t: TrainConfig, K: Backend, room: int | None, margin: int) -> TrainConfig:
    """t with train.micro_batch "auto" resolved: the largest micro-batch whose plan fits the room the device has
    for it less the margin, and the n_micro that keeps the step's sequences; one line on stderr says why."""
    S, device = _sequences(t), f"{K.device}"
    if room is None:
        raise memory.PlanError(f"train.micro_batch 'auto': the device ({device}) does not say how much memory it has; "
                               "give train.micro_batch as a number")  # fmt: skip
    found = _fitting(m, t, K, room - margin)
    if found is None:
        need = _plan_bytes(m, t, K, 1)
        raise memory.PlanError(f"train.micro_batch 'auto': no micro-batch fits the device ({device}): a micro-batch "
                               f"of 1 needs {need / memory.GIB:.2f} GiB of the {room / memory.GIB:.2f} GiB available "
                               f"(less train.memory_margin {margin / memory.GIB:.2f} GiB); lower the model's sizes "
                               "(model.d_model, model.n_layer, model.seq_len)")  # fmt: skip
    B, nbytes = found
    print(f"train.micro_batch auto: {B} x n_micro {S // B} = {S} sequences a step, the largest micro-batch whose "
          f"plan ({nbytes / memory.GIB:.2f} GiB) fits the {(room - margin) / memory.GIB:.2f} GiB {device} has for it "
          f"({room / memory.GIB:.2f} GiB available less train.memory_margin {margin / memory.GIB:.2f} GiB)",
          file=sys.stderr)  # fmt: skip
    return dataclasses.replace(t, micro_batch=B, n_micro=S // B)


def _refit(m: ModelConfig, t: TrainConfig, K: Backend, available: int) -> str:
    """What would fit instead of t's micro-batch (the PlanError's hint)."""
    found, S = _fitting(m, t, K, available, below=t.micro_batch), _sequences(t)
    if found is None:
        return (f"no micro-batch of the {S:,} sequences a step (train.micro_batch x train.n_micro) fits: lower them "
                "or the model's sizes (model.d_model, model.n_layer, model.seq_len)")  # fmt: skip
    B, nbytes = found
    return (f"train.micro_batch {B} with train.n_micro {S // B} fits ({nbytes / memory.GIB:.2f} GiB) and keeps the "
            f"{S} sequences a step (--micro-batch auto picks it)")  # fmt: skip


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
    """A model for the inference step (model.gpt_infer) and the decode step (model.gpt_decode): the inference plan's
    arena (weights, KV cache and one layer's activations for up to B sequences of seq_len), the backend and the
    precision bound to it, and the decode step prepared per batch size (on a GPU, each one's CUDA graph)."""

    K: Backend  # bound to this state's arena
    m: ModelConfig
    B: int  # sequences the plan holds
    plan: list[memory.Buf]
    arena: memory.Arena | dict[str, Any]  # or the training arena's buffers under the inference plan's names
    P_compute: dict[str, Any]  # the weights the model reads, as TrainState's
    prec: PrecisionState
    decoders: dict[int, Callable[[], None]] = field(default_factory=dict)  # b -> its decode step, prepared once

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

    def run(self, tokens: Any, pos: int | Sequence[int], targets: Any = None, slots: Sequence[int] | None = None,
            ) -> None:  # fmt: skip
        """One inference step (model.gpt_infer) on planned tokens (b, t) at positions pos .. pos + t - 1 (one for all
        rows, or one per row in cache rows slots: model.windows), then the precision's end of an evaluation forward
        (fp8: what its casts met is forgotten)."""
        model.gpt_infer(self.K, self.m, self.P_compute, self.arena, tokens, pos, targets, slots)
        self.prec.end_eval()

    def score(self, x: np.ndarray, y: np.ndarray) -> tuple[float, int, np.ndarray]:
        """Windows from position 0: x, y (b, t) int32 host arrays (y -1: not scored), b * t <= B * seq_len.
        (sum of the scored losses, their count, the per-token losses (b, t) as a host array). Full windows (t =
        seq_len) are padded to B rows, as the trainer's evaluation batches are, so they score as its val loss does."""
        K, A, (b, t) = self.K, self.arena, x.shape
        if t == self.m.seq_len and b < self.B:
            x = np.concatenate([x, np.zeros((self.B - b, t), np.int32)])
            y = np.concatenate([y, np.full((self.B - b, t), -1, np.int32)])
        tokens, targets = self.inputs(*x.shape)
        K.copy_in(tokens, x)
        K.copy_in(targets, y)
        self.run(tokens, 0, targets)
        n = x.size
        K.loss_sum(A["loss_sum"], A["losses"][:n], targets.reshape(-1))  # as the trainer's _val_loss
        s, c = K.to_numpy(A["loss_sum"]).tolist()
        return s, int(c), K.to_numpy(A["losses"][:n]).reshape(x.shape)[:b].copy()

    def decode_inputs(self, b: int) -> tuple[Any, Any, Any]:
        """The planned inputs of a decode step of b rows: tokens, positions, slots (b,) int32, one after another in
        decode_rows (one copy from the host brings them: on a GPU each copy from pageable memory waits for the
        device)."""
        rows = self.arena["decode_rows"]
        return rows[:b], rows[b : 2 * b], rows[2 * b : 3 * b]

    def decode(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> Any:
        """One decode step (model.gpt_decode) of b = len(tokens) rows: row i's token at position positions[i] of KV
        cache row slots[i]; returns the rows' next-token logits, the plan's next_logits[:b] (b, V), and leaves each
        row's greedy token (their argmax, ops/argmax.py) in next_ids[:b] (b,) int32, for a host that wants b ints
        rather than b x V logits (`greedy`). The inputs are checked here (the kernels index the cache by them), then
        copied into the planned buffer, which the step reads. The step of each b is prepared once (K.prepare: on a
        GPU, run once as its warm-up, which times its choices, then captured as a CUDA graph) and then run, or
        replayed, at every call: a step run twice on the same inputs writes the same keys and values, so the
        warm-up's run leaves the cache as the step finds it."""
        tokens, positions, slots = (np.asarray(a).reshape(-1) for a in (tokens, positions, slots))
        b = self._check_decode(tokens, positions, slots)
        self.K.copy_in(self.arena["decode_rows"][: 3 * b], np.concatenate([tokens, positions, slots]).astype(np.int32))
        run = self.decoders.get(b)
        if run is None:
            run = self.decoders[b] = self.K.prepare(lambda: self._decode(b), True)
        run()
        return self.arena["next_logits"][:b]

    def greedy(self, b: int) -> list[int]:
        """The greedy tokens of the last decode step of b rows: b ints to the host."""
        return self.K.to_numpy(self.arena["next_ids"][:b]).tolist()

    def _decode(self, b: int) -> None:
        model.gpt_decode(self.K, self.m, self.P_compute, self.arena, *self.decode_inputs(b))
        self.K.argmax_rows(self.arena["next_ids"][:b], self.arena["next_logits"][:b])
        self.prec.end_eval()

    def _check_decode(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> int:
        """b, once the decode inputs are known to be in range: ValueError naming what is not."""
        b, T, V = tokens.size, self.m.seq_len, self.m.vocab_size
        if "kv" not in self.arena:
            raise ValueError("decode: the inference plan has no KV cache (make_infer_state(..., cache=True))")
        if not 1 <= b <= self.B or positions.size != b or slots.size != b:
            raise ValueError(f"decode: tokens, positions and slots need one entry a row, 1 to {self.B} rows (got "
                             f"{tokens.size}, {positions.size}, {slots.size})")  # fmt: skip
        for name, a, top in (("tokens", tokens, V), ("positions", positions, T), ("slots", slots, self.B)):
            if a.dtype.kind not in "iu" or a.min() < 0 or a.max() >= top:
                raise ValueError(f"decode: {name} must be integers in [0, {top}) (got {a.min()} .. {a.max()})")
        if np.unique(slots).size != b:
            raise ValueError("decode: two rows of one step share a cache row (slots must be distinct)")
        return b


def make_infer_state(m: ModelConfig, K: Backend, B: int, weights: np.ndarray, cache: bool = True) -> InferState:
    """The inference plan for B sequences (memory.inference_plan; cache False: windows from position 0 only)
    allocated once, the backend bound to it, the weights loaded."""
    prec = K.precision
    bufs = memory.inference_plan(m, prec, B, K.logits_rows(m, B), K.infer_rows(m, B), cache)
    margin = round(TrainConfig.memory_margin * memory.GIB)
    plan = memory.check_fits(bufs, prec, m, K.memory_bytes(), K.device, margin)
    arena = memory.Arena(plan, K)
    K, bound = K.bind(arena, m)
    compute = "compute_params" if prec.compute_copy else "params"
    S = InferState(K, m, B, plan, arena, bound.weights(params.views(arena.flat(compute), m)), bound)
    S.load_weights(weights)
    return S


def training_infer_state(S: TrainState) -> InferState:
    """The inference step over a training state: the weights it is training, as they are now, and the training
    arena's layer-0 activation buffers under the names of the inference plan's one layer (N = micro_batch x seq_len
    rows), its loss buffers and its first micro-batch's inputs. Windows from position 0 only (no KV cache).

    Between optimizer steps the saved activations are dead (the next step's forward writes every one before any
    backward reads it; the trainer's validation loss runs in them too), so scoring here costs no byte beyond the
    training plan and the device's peak stays the plan. A planned inference row would have cost memory the run
    could otherwise train with, for something that runs between steps only."""
    A = S.arena
    a = A.get("a")  # (L, N, 4C) saved, (N, 4C) recomputed, or None where the precision's cast computes GELU
    view = {"x": A["resid"][0], "x2": A["resid2"][0], "ln": A["ln1"][0], "qkv": A["qkv"][0], "att": A["att"][0],
            "proj": A["proj"], "h": A["h"][0], "ln_mean": A["ln1_mean"][0], "ln_rstd": A["ln1_rstd"][0],
            "att_lse": A["att_lse"][0].reshape(-1), "losses": A["losses"], "ce_lse": A["ce_lse"],
            "logits": A["logits"], "loss_sum": A["loss_sum"], "tokens": A["tokens"][0], "targets": A["targets"][0],
            **({} if a is None else {"a": a if a.ndim == 2 else a[0]})}  # fmt: skip
    return InferState(S.K, S.m, S.t.micro_batch, S.plan, view, S.P_compute, S.prec)


def trained_infer_state(ld: checkpoint.Trained, K: Backend, B: int, cache: bool = True) -> InferState:
    """A checkpoint's model on an inference plan of B sequences (make_infer_state), with what the run's precision
    keeps read from its sidecar (fp8: the amax histories the run scaled by)."""
    S = make_infer_state(ld.exp.model, K, B, ld.weights, cache)
    S.prec.load_sidecar(ld.side, str(checkpoint.sidecar_path(ld.path)))
    return S
