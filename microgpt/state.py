"""The training state: everything a run carries from one optimizer step to the next, and its checkpoint.

`make_state(m, t, K)` plans the memory (memory.plan: the model's buffers plus the backend's own rows), makes the
one arena allocation, binds the backend to it, and fills in the weights from the seed: the engine, bench, dev
scripts and tests all start from here. The state converts to and from the seed's checkpoint format: the fp32
weights, Adam m and v in the canonical order; the step, the loss scaler and, in fp8, the operands' amax histories
ride in the sidecar.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from microgpt import checkpoint, config, fp8, memory, model
from microgpt.backend import Backend
from microgpt.config import ModelConfig, TrainConfig

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
    def for_precision(cls, precision: str) -> LossScaler:
        return cls(dynamic=True, scale=2.0**16) if precision == "fp16" else cls()

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
    P_compute: dict[str, Any]  # the weights the model reads (model.with_qkv): the compute-dtype copy, or P itself in
    # fp32; in fp8 the block linears' entries are Fp8Weights
    G: dict[str, Any]  # gradients, same names and shapes (and each layer's "h{l}.w_qkv")
    p: Any  # flat views of the same four arrays: n_params long
    g: Any
    adam_m: Any
    adam_v: Any
    p_compute: Any  # flat compute copy, or None in fp32
    w8: list[fp8.Fp8Weight | fp8.Fp8Head]  # fp8: every block linear site's E4M3 copies and the LM head's, which the
    # optimizer step refreshes
    priming: fp8.Priming  # fp8: whether the operands' amax histories are still empty (read by every site)
    scaler: LossScaler = field(default_factory=LossScaler)
    step: int = 0  # optimizer steps completed

    @property
    def n_params(self) -> int:
        return memory.n_params(self.m)

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
        if self.w8:
            self._load_history(path, side.get("fp8_amax_history"))
        self.step = ck.step
        self.scaler.scale = float(side.get("loss_scale", self.scaler.scale))
        self.scaler.good_steps = int(side.get("loss_scale_good_steps", 0))
        return side

    def set_weights(self, weights: np.ndarray) -> None:
        """The fp32 masters from (n_params,) weights in the canonical order, and what follows them: the compute copy,
        fp8's E4M3 copies. Adam m and v, the step and the loss scaler are left as they are (make_state's, for
        `train --init`: another run's weights, a new run's optimizer)."""
        self.K.copy_in(self.p, weights)
        if self.p_compute is not None:
            self.K.copy_in(self.p_compute, weights)
        if self.w8:
            self.K.cast_weights(self.w8)

    def save_checkpoint(self, path: Path, meta: dict[str, Any]) -> Path:
        """The seed-format file of the last completed step, with meta and the loss scaler in its sidecar."""
        self.K.synchronize()
        host = [self.K.to_numpy(a) for a in (self.p, self.adam_m, self.adam_v)]
        meta = {**meta, "loss_scale": self.scaler.scale, "loss_scale_good_steps": self.scaler.good_steps,
                "params": [[n, list(s)] for n, s in memory.param_shapes(self.m)]}  # fmt: skip
        if self.w8 and not self.priming.on:
            meta["fp8_amax_history"] = self._history().reshape(-1).tolist()
        return checkpoint.write_checkpoint(path, self.step, *host, meta)

    def _history(self) -> np.ndarray:
        """fp8: every operand slot's amax history, (L, sites, 2, HISTORY) fp32, newest first."""
        return self.K.to_numpy(self.arena["fp8_slots"])[..., fp8.HIST :].astype(np.float32)

    def _load_history(self, path: str | Path, saved: list | None) -> None:
        """fp8: the histories from the sidecar (the run goes on scaling as it did); none saved (a checkpoint of
        another precision, or of a run that never stepped): they are primed by the first micro-batch."""
        self.K.zero_(self.arena["fp8_slots"])
        self.priming.on = saved is None
        if saved is None:
            return
        where = f"{checkpoint.sidecar_path(path)}: field 'fp8_amax_history'"
        want = self._history().shape
        try:
            hist = np.array(saved, dtype=np.float64)
        except (TypeError, ValueError):
            raise checkpoint.CheckpointError(f"{where} must be a list of numbers") from None
        if hist.shape != (math.prod(want),):
            raise checkpoint.CheckpointError(f"{where} must hold {math.prod(want)} numbers (this model's amax "
                                             f"histories), got {hist.size}")  # fmt: skip
        if not (np.isfinite(hist).all() and (hist >= 0).all() and (hist <= np.finfo(np.float32).max).all()):
            raise checkpoint.CheckpointError(f"{where} must hold finite non-negative numbers")
        slots = np.zeros(self.arena["fp8_slots"].shape, np.float32)
        slots[..., fp8.HIST :] = hist.reshape(want)
        self.K.copy_in(self.arena["fp8_slots"], slots)


def make_state(m: ModelConfig, t: TrainConfig, K: Backend) -> TrainState:
    """The whole plan allocated once, the backend bound to it, weights from t.seed, m = v = grads = 0."""
    plan = memory.check_fits(m, t, K.logits_rows(m, t.micro_batch), K.rows(m, t), K.memory_bytes(), K.device)
    arena = memory.Arena(plan, K)
    K = K.bind(arena)
    compute = "compute_params" if memory.has_compute_copy(t) else "params"
    P, p = arena.role("params"), arena.flat("params")
    priming = fp8.Priming(on=t.precision == "fp8")
    P_compute = model.with_qkv(arena.role(compute), arena.flat(compute), m)
    w8: list[fp8.Fp8Weight | fp8.Fp8Head] = []
    if t.precision == "fp8":
        w8 += fp8_weights(m, arena, p, priming)
        if fp8.head_in_fp8(m.vocab_size):
            w8.append(fp8.Fp8Head(P_compute["wte"], P["wte"], arena["lm_head.w8"], *arena["fp8_head_slots"]))
        P_compute.update({w.name: w for w in w8})
    S = TrainState(
        K=K, m=m, t=t, plan=plan, arena=arena, P=P, P_compute=P_compute,
        G=model.with_qkv(arena.role("grads"), arena.flat("grads"), m),
        p=p, g=arena.flat("grads"), adam_m=arena.flat("adam_m"), adam_v=arena.flat("adam_v"),
        p_compute=arena.flat(compute) if compute != "params" else None, w8=w8, priming=priming,
        scaler=LossScaler.for_precision(t.precision),
    )  # fmt: skip
    host = {name: np.zeros(shape, np.float32) for name, shape in memory.param_shapes(m)}
    model.init_params(host, m, np.random.default_rng(t.seed))
    S.set_weights(np.concatenate([a.reshape(-1) for a in host.values()]))
    mask = np.concatenate([np.full(math.prod(s), len(s) == 2, np.uint8) for _, s in memory.param_shapes(m)])
    K.copy_in(arena["decay_mask"], mask)
    return S


def fp8_weights(m: ModelConfig, arena: memory.Arena, p: Any, priming: fp8.Priming) -> list[fp8.Fp8Weight]:
    """Each block linear site's Fp8Weight: its fp32 masters as one (G, C, OC) view of the flat params `p`, its
    planned E4M3 copies and slots (memory.fp8_rows), in layer then fp8.SITES order."""
    offsets = memory.param_offsets(m)
    out = []
    for layer in range(m.n_layer):
        for i, (site, (G, C, OC)) in enumerate(fp8.site_shapes(m.d_model).items()):
            o = offsets[f"h{layer}.{fp8.SITES[site][0]}"]
            name = f"h{layer}.{site}"
            slots = arena["fp8_slots"][layer, i]
            xt = arena.get(name + ".xt")  # the triton backend's (kernels/fp8.py); None on NumPy
            out.append(fp8.Fp8Weight(name, p[o : o + G * C * OC].reshape(G, C, OC), arena[name + ".w8"],
                                     arena[name + ".w8t"], arena["fp8_wscales"][layer, i], slots[0], slots[1],
                                     priming, xt))  # fmt: skip
    return out
