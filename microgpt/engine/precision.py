"""Precision as one object: what a run computes in, what it plans for that, and the matmul its GEMM sites call.

    precision   compute   compute copy   loss scaler   GEMMs of the block linears and the head's logits
    fp32        fp32      no             no            fp32 (cuBLAS, cuBLASLt or our Triton tile on the GPU)
    bf16        bf16      yes            no            bf16 operands, fp32 sums
    fp16        fp16      yes            dynamic       fp16 operands, fp32 sums
    fp8         bf16      yes            no            E4M3 operands, fp32 sums (microgpt/fp8.py; the head's
                                                       gradient GEMMs stay bf16)

The NumPy backend computes in fp32 whatever the precision (its fp8 rounds every E4M3 operand as the GPU does, so it
specifies fp8 too). `make(name, backend)` gives the one `Precision` for a (precision, backend) pair; the memory plan
asks it for its rows and its compute dtype, the backend binds it to the arena (`Precision.bind`), and what comes
back, a `PrecisionState`, is all a run holds of its precision:

    state.mm                 the Matmul the linear, MLP and head pairs call (their keyword `mm`)
    state.weights(views)     the weights as the model hands them to those pairs (fp8: each site's E4M3 handle)
    state.cast_weights()     whatever the precision keeps besides the compute copy (fp8's E4M3), from the
                             masters: after AdamW (updated=True) and wherever they are set
    state.end_micro_batch()  the end of a training micro-batch (fp8: the amax histories roll)
    state.end_eval()         the end of an evaluation forward (fp8: what the casts met is forgotten)
    state.priming            whether the first step must run eagerly to prime state (fp8's empty histories)
    state.backend_args       what it asks of the backend's functions, function -> keywords (fp8 on the GPU:
                             AdamW's segment maxima, ops/adamw.py, which are then the weights' amaxes)
    state.snapshot() / steady() / restore()   around the warm-up and capture of the steady-state step
    state.sidecar() / load_sidecar()   what a checkpoint's sidecar carries for it (fp8: the histories), which
                             `check_sidecar` checks for every reader of a checkpoint

A Matmul (one class per precision and backend: ops/linear.py and kernels/linear.py for fp32/bf16/fp16, ops/fp8.py
and kernels/fp8.py for fp8) has four methods, each a GEMM site's work with the operand casts it needs, and one flag:

    forward(y, x, w, *, act_out=None, act_of=None, act="gelu")
                                                       y = x @ w (w (C,OC), or (G,C,OC) and y (G,N,OC));
                                                       act_out: also a = act(y) (an epilogue it may fuse), y None
                                                       where only a is kept (ReLU^2, not in fp8);
                                                       act_of: x is act(act_of) (None where it casts act)
    backward(dx, dw, dy, x, w, *, dx_act_of=None, dx_act_out=None, act="gelu")
                                                       dx = dy @ w^T (written; G weights summed), dw += x^T @ dy;
                                                       dx_act_of: dx *= act'(dx_act_of) after (a pass or an
                                                       epilogue it may fuse; act: "gelu" or "relu2",
                                                       ops/linear.ACTIVATIONS); dx_act_out: the same act' read
                                                       from a = act(h) (ReLU^2's: ops/linear.FROM_OUTPUT); fp8's
                                                       takes dact_of instead: dy *= act'(dact_of) first, inside
                                                       its cast of dy
    dact_in_cast                                       which of the two the MLP asks for (True: dact_of)
    logits(x, wte) -> fn(z, i, j)                      z = x[i:j] @ wte^T, the tied head's logits chunk by chunk
    logits_backward(dx, dwte, dz, x, wte)              dx += dz @ wte ; dwte += dz^T @ x

`w` is what `state.weights` made of the weight: the tensor itself, or the precision's own handle. The pairs never
look inside it. docs/ANDREA.md section 4 lists the files a new precision touches.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from microgpt import checkpoint, fp8
from microgpt.config import PRECISIONS, ConfigError, ModelConfig
from microgpt.engine import params
from microgpt.engine.memory import Arena, Buf
from microgpt.errors import brief, check_number
from microgpt.ops.adamw import segment_table_of
from microgpt.ops.fp8 import e4m3

COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MATMULS = {  # (precision family, backend) -> "module:Class"
    ("plain", "numpy"): "microgpt.ops.linear:Matmul",
    ("plain", "triton"): "microgpt.kernels.linear:Matmul",
    ("fp8", "numpy"): "microgpt.ops.fp8:Matmul",
    ("fp8", "triton"): "microgpt.kernels.fp8:Matmul",
}


HISTORY_FIELD = "fp8_amax_history"  # the sidecar's field of fp8's amax histories (Fp8State.sidecar)
F32_MAX = float(np.finfo(np.float32).max)
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


def check_sidecar(side: dict[str, Any], where: str) -> None:
    """What a precision keeps in a checkpoint's sidecar, checked wherever a checkpoint is read back (resume, and
    every use of a trained model), whatever the reader computes in, as checkpoint.read_sidecar checks the format's
    own fields: fp8's amax histories are a list of numbers in [0, the largest fp32] (their count is this model's,
    checked by Fp8State.load_sidecar). CheckpointError naming the sidecar `where` and the field otherwise."""
    hist = side.get(HISTORY_FIELD, [])
    if not isinstance(hist, list):
        raise checkpoint.CheckpointError(
            f"{where}: field '{HISTORY_FIELD}' must be list, got {type(hist).__name__} {brief(hist)}"
        )
    for i, amax in enumerate(hist):  # a string "1.5" or true would pass numpy's cast
        check_number(amax, f"{where}: field '{HISTORY_FIELD}' item {i}", 0, F32_MAX, error=checkpoint.CheckpointError)


def matmul_class(path: str) -> type:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


class PrecisionState:
    """fp32, bf16 and fp16 bound to an arena: the matmul, and nothing else to keep."""

    priming = False

    def __init__(self, mm: Any, backend_args: dict[str, dict[str, Any]] | None = None) -> None:
        self.mm = mm
        self.backend_args = backend_args or {}

    def weights(self, views: dict[str, Any]) -> dict[str, Any]:
        return views

    def cast_weights(self, updated: bool = False) -> None:
        """updated: right after the optimizer step's AdamW (which may have recorded what the cast needs)."""

    def end_micro_batch(self, dp: Any = None) -> None:
        pass

    def end_eval(self) -> None:
        pass

    def sidecar(self) -> dict[str, Any]:
        return {}

    def load_sidecar(self, side: dict[str, Any], where: str) -> None:
        pass

    def snapshot(self) -> Any:
        """What the warm-up run may change and must leave as it found it."""
        return None

    def steady(self) -> None:
        """Stop priming for a run of the steady-state step (the warm-up and the graph capture)."""

    def restore(self, snap: Any) -> None:
        pass


@dataclass(frozen=True)
class Precision:
    """One precision on one backend (`make`)."""

    name: str  # fp32 | bf16 | fp16 | fp8
    backend: str  # numpy | triton
    compute: str  # the compute copy's and the activations' dtype: fp32 | bf16 | fp16
    loss_scaling: bool  # fp16's dynamic loss scale (LossScaler, above)
    matmul: str  # MATMULS' "module:Class"
    scaled_mm: bool = False  # E4M3 GEMMs through torch._scaled_mm (the runtime measures their workspace)
    # whether a trained model runs in it only where it was trained in it: fp16's range holds only the activations of
    # a model trained to stay in it; fp8 scales its operands by the run's amax histories (in the sidecar)
    only_as_trained: bool = False

    @property
    def compute_copy(self) -> bool:
        """Whether the weights have a compute-dtype copy beside the fp32 masters (plan role compute_params)."""
        return self.compute != "fp32"

    @property
    def act_planned(self) -> bool:
        """Whether the MLP's a = act(h) has a compute buffer (memory.py): it does unless the matmul casts the
        activation (GELU or ReLU^2) on its way to its operand."""
        return True

    @property
    def dact_in_cast(self) -> bool:
        """Whether the MLP's act' runs inside W_1's operand cast, from h (its Matmul's dact_in_cast: fp8's, on both
        backends), so that the plan keeps h even where act' could be read from a (memory.pre_activation_kept)."""
        return False

    def label(self) -> str:
        """What the memory plan's title says the run computes in."""
        return self.compute

    def numpy_dtype(self, kind: str) -> Any:
        """The NumPy dtype of a plan kind this precision brings (its rows'), for the numpy backend's views."""
        raise KeyError(f"precision {self.name} has no plan kind {kind!r}")

    def rows(self, m: ModelConfig, N: int, weight_maxima: bool = True) -> list[Buf]:
        """The plan rows this precision adds for N tokens a micro-batch. weight_maxima: whether the plan's optimizer
        step can record each weight's max |w| on its way (a training plan whose one AdamW call covers every
        parameter; not an inference plan, nor Muon's, whose matrices AdamW does not see)."""
        return []

    def bind(self, arena: Arena, m: ModelConfig, p: Any, device: Any, **kernel_state: Any) -> PrecisionState:
        """This precision on an arena of its plan. p: the flat fp32 master weights; device: the backend's copy_in,
        to_numpy and zero_; kernel_state: what the backend's Matmul takes (the triton backend's GEMM router and
        tuner)."""
        return PrecisionState(matmul_class(self.matmul)(**kernel_state))


@dataclass(frozen=True)
class Fp8(Precision):
    """E4M3 block linears and head logits (microgpt/fp8.py: the format, the scale rule and the slots)."""

    @property
    def act_planned(self) -> bool:
        return self.backend != "triton"  # the GPU's cast computes act(h) on the way to E4M3: a exists in E4M3 only

    @property
    def dact_in_cast(self) -> bool:
        return True  # the cast of W_1's output gradient computes dh * act'(h) from h (ops/fp8.py, kernels/fp8.py)

    def label(self) -> str:
        return f"{self.compute} + fp8 linears"

    def numpy_dtype(self, kind: str) -> Any:
        """E4M3 for the kind "f8" (ml_dtypes, imported here: only a plan of fp8 needs it)."""
        return e4m3() if kind == "f8" else super().numpy_dtype(kind)

    def rows(self, m: ModelConfig, N: int, weight_maxima: bool = True) -> list[Buf]:
        """Every block GEMM site's two E4M3 weight layouts, its weights' scale slot, and the slots of its input and
        of its output gradient with their amax histories (carried across steps); the LM head's E4M3 wte and its two
        slots where its logits GEMM runs in E4M3. On the GPU also the casts' scratch ("kernel": E4M3 operands in
        row and transposed layouts, the fp32 weight-gradient product) and each site's input as its forward cast
        it, transposed, for the weight gradient in backward ("acts"); and, in a training plan, where AdamW records
        the weights' amaxes for their cast (`amax_blocks`: its segment table and maxima), unless a weight is too
        short for it."""
        sites = params.site_shapes(m.d_model)
        bufs = []
        for layer in range(m.n_layer):
            for site, (G, C, OC) in sites.items():
                name = f"h{layer}.{site}"
                bufs += [
                    Buf(name + ".w8", (C, G * OC), "fp8_weights", "f8"),
                    Buf(name + ".w8t", (G, OC, C), "fp8_weights", "f8"),
                ]
        bufs += [
            Buf("fp8_wscales", (m.n_layer, len(sites), fp8.SLOT), "optim", "f32"),
            Buf("fp8_slots", (m.n_layer, len(sites), 2, fp8.OSLOT), "optim", "f32"),
        ]
        if fp8.head_in_fp8(m.vocab_size):
            bufs += [
                Buf("lm_head.w8", (m.vocab_size, m.d_model), "fp8_weights", "f8"),
                Buf("fp8_head_slots", (2, fp8.SLOT), "optim", "f32"),
            ]
        if self.backend == "triton":
            C = m.d_model
            bufs += [Buf(name, (N * 4 * C,), "kernel", "f8") for name in fp8.SCRATCH]
            bufs += [Buf("fp8_wgrad", (4 * C * C,), "kernel", "f32")]
            bufs += [
                Buf(f"h{layer}.{site}.xt", (C_in * N,), "acts", "f8")
                for layer in range(m.n_layer)
                for site, (_, C_in, _) in sites.items()
            ]
            if weight_maxima and (blocks := amax_blocks(m)) is not None:
                bufs += [
                    Buf("fp8_amax_blocks", blocks.shape, "optim", "i32"),
                    Buf("fp8_wamax", (len(weight_segments(m)),), "optim", "f32"),
                ]
        return bufs

    def bind(self, arena: Arena, m: ModelConfig, p: Any, device: Any, **kernel_state: Any) -> PrecisionState:
        priming = fp8.Priming()
        segments = iter(weight_segments(m))  # the weights in AdamW's amax order (their index in fp8_wamax)
        weights = []
        for layer in range(m.n_layer):
            for i, (site, (G, C, OC)) in enumerate(params.site_shapes(m.d_model).items()):
                (start, end), name = next(segments), f"h{layer}.{site}"
                slots = arena["fp8_slots"][layer, i]
                weights.append(
                    fp8.Fp8Weight(
                        name,
                        p[start:end].reshape(G, C, OC),
                        arena[name + ".w8"],
                        arena[name + ".w8t"],
                        arena["fp8_wscales"][layer, i],
                        slots[0],
                        slots[1],
                        priming,
                        arena.get(name + ".xt"),
                    )
                )
        head = None
        if fp8.head_in_fp8(m.vocab_size):
            hw = params.family(m).head_weight  # wte when tied, lm_head in the modern block
            wte = params.named(arena.flat("compute_params" if self.compute_copy else "params"), m)[hw]
            head = fp8.Fp8Head(wte, params.named(p, m)[hw], arena["lm_head.w8"], *arena["fp8_head_slots"])
        if self.backend == "triton":  # the casts' planned scratch (rows above)
            kernel_state["scratch"] = {name: arena[name] for name in (*fp8.SCRATCH, "fp8_wgrad")}
        asked = {}
        if "fp8_amax_blocks" in arena:  # AdamW's segment maxima over the weights: their amaxes, for their cast
            device.copy_in(arena["fp8_amax_blocks"], amax_blocks(m))
            asked = {"adamw_step": {"segment_table": arena["fp8_amax_blocks"], "segment_max": arena["fp8_wamax"]}}
        mm = matmul_class(self.matmul)(head=head, **kernel_state)
        return Fp8State(mm, device, weights, head, priming, arena["fp8_slots"], arena.get("fp8_wamax"), asked)


def weight_segments(m: ModelConfig) -> list[tuple[int, int]]:
    """(start, end) of each E4M3 weight's masters in the flat parameters, in the order the weights' cast takes them
    (Fp8State.cast_weights): every layer's sites (a site's G weights as one), then the head's matrix (wte, or the
    modern block's lm_head) where its logits GEMM runs in E4M3."""
    offsets, sites = params.param_offsets(m), params.site_shapes(m.d_model)
    out = [
        (o, o + G * C * OC)
        for layer in range(m.n_layer)
        for site, (G, C, OC) in sites.items()
        for o in [offsets[f"h{layer}.{params.SITES[site][0]}"]]
    ]
    if fp8.head_in_fp8(m.vocab_size):
        head = offsets[params.family(m).head_weight]
        out.append((head, head + m.vocab_size * m.d_model))
    return out


def amax_blocks(m: ModelConfig) -> np.ndarray | None:
    """The segment table (ops/adamw.py) of this model's E4M3 weights over its flat parameters: AdamW's segment
    maxima are then the weights' amaxes, in weight_segments' order."""
    return segment_table_of(weight_segments(m), params.n_params(m))


class Fp8State(PrecisionState):
    """fp8 bound to an arena: each site's handle, the head's, the operands' slots and whether they are primed."""

    def __init__(
        self,
        mm: Any,
        device: Any,
        weights: list[fp8.Fp8Weight],
        head: fp8.Fp8Head | None,
        priming: fp8.Priming,
        slots: Any,
        amaxes: Any = None,
        backend_args: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(mm, backend_args)
        self.device, self.sites, self.head, self._priming, self.slots = device, weights, head, priming, slots
        self.amaxes = amaxes  # where AdamW leaves the weights' amaxes (the GPU's training plans), else None

    @property
    def priming(self) -> bool:
        return self._priming.on

    def weights(self, views: dict[str, Any]) -> dict[str, Any]:
        return {**views, **{w.name: w for w in self.sites}}

    def cast_weights(self, updated: bool = False) -> None:
        weights = [*self.sites, *([self.head] if self.head is not None else [])]
        if updated and self.amaxes is not None:  # AdamW recorded their amaxes: no amax pass
            self.mm.cast_weights(weights, self.amaxes)
        else:
            self.mm.cast_weights(weights)

    def end_micro_batch(self, dp: Any = None) -> None:
        """What the casts met becomes the newest entry of each operand's amax history, the same on every rank (the
        max over ranks); a fresh run's histories are primed from then on."""
        if dp is not None:
            dp.all_reduce_max(self.slots)
        self.mm.roll(self.slots, True)
        self._priming.on = False

    def end_eval(self) -> None:
        self.mm.roll(self.slots, False)  # evaluation scales by the histories and leaves nothing in them

    def _history(self) -> np.ndarray:
        """Every operand slot's amax history, (L, sites, 2, HISTORY) fp32, newest first."""
        return self.device.to_numpy(self.slots)[..., fp8.HIST :].astype(np.float32)

    def sidecar(self) -> dict[str, Any]:
        return {} if self.priming else {HISTORY_FIELD: self._history().reshape(-1).tolist()}

    def load_sidecar(self, side: dict[str, Any], where: str) -> None:
        """The histories from the sidecar (the run goes on scaling as it did); none saved (a checkpoint of another
        precision, or of a run that never stepped): they are primed by the first micro-batch. where: the sidecar's
        path, for the error."""
        saved = side.get(HISTORY_FIELD)
        self.device.zero_(self.slots)
        self._priming.on = saved is None
        if saved is None:
            return
        where = f"{where}: field '{HISTORY_FIELD}'"  # its items are checked numbers (check_sidecar)
        want = self._history().shape
        hist = np.array(saved, dtype=np.float64)
        if hist.shape != (math.prod(want),):
            raise checkpoint.CheckpointError(
                f"{where} must hold {math.prod(want)} numbers (this model's amax histories), got {hist.size}"
            )
        slots = np.zeros(self.slots.shape, np.float32)
        slots[..., fp8.HIST :] = hist.reshape(want)
        self.device.copy_in(self.slots, slots)

    def snapshot(self) -> tuple[np.ndarray, bool]:
        """The slots and the priming flag: the warm-up's casts and rolls must leave no trace in the run's scales."""
        return self.device.to_numpy(self.slots).copy(), self._priming.on

    def steady(self) -> None:
        self._priming.on = False

    def restore(self, snap: tuple[np.ndarray, bool]) -> None:
        self.device.copy_in(self.slots, snap[0])
        self._priming.on = snap[1]


def make(name: str, backend: str, compute: str | None = None) -> Precision:
    """The precision `name` on `backend` ("numpy" or "triton"); ConfigError naming train.precision otherwise.
    compute: the activations' dtype on the GPU where not the precision's own, for fp8 only (its own is bf16; "fp32":
    E4M3 GEMMs between fp32 activations, which the GPU tests compare with the NumPy reference free of bf16's
    rounding, to which E4M3's coarse steps are sensitive: tests/kernels/test_gpu_decode.py)."""
    if name not in PRECISIONS:
        raise ConfigError(f"train.precision: unknown precision {name!r} (one of {', '.join(PRECISIONS)})")
    if compute is not None and (name != "fp8" or compute not in COMPUTE_BYTES):
        raise ValueError(f"compute {compute!r}: fp8's activation dtype ({', '.join(COMPUTE_BYTES)}), for fp8 only")
    dtype = "fp32" if backend == "numpy" else {"fp8": compute or "bf16"}.get(name, name)
    if name == "fp8":
        return Fp8(
            name, backend, dtype, False, MATMULS[("fp8", backend)], scaled_mm=backend == "triton", only_as_trained=True
        )
    return Precision(name, backend, dtype, name == "fp16", MATMULS[("plain", backend)], only_as_trained=name == "fp16")
