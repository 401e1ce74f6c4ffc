"""The backend interface: every op pair and helper the model and the step call, and the device underneath.

A `Backend` is one frozen dataclass with a field per function of the op registry (microgpt/ops/__init__.py:
`<op>_forward`, `<op>_backward`, the loss head's extra entry points, the step's helpers) and the device functions
the state and the step need (allocation, views, copies, the step's preparation). Both backends are built by the
same loop over the registry's rows: the NumPy one from each row's NumPy module (the reference, the CPU path, no
torch), the Triton one from each row's Triton module (imported only when asked for). Each is made for one precision
(microgpt/engine/precision.py), which it carries.

A backend is bound to one memory plan (`bind`), which gives every launcher what it takes beyond the spec's arguments
as keyword arguments, so model.py calls both backends alike: the precision's Matmul (`mm`, the GEMM sites:
ops.MATMUL_TAKERS), planned scratch (the triton backend's embedding sort order, LayerNorm partial sums, attention
delta: `scratch_args`), the runtime's tuner (`tuner`: kernels/runtime.py TUNER_TAKERS) and the NumPy backend's
threads (`rows`: ops.ROWS_TAKERS, ops/rows.py).
"""

from __future__ import annotations

import argparse
import ctypes.util
import dataclasses
import functools
import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from microgpt import ops
from microgpt.config import BACKENDS, NUMPY_PRECISIONS, PRECISIONS, ConfigError, ModelConfig, TrainConfig
from microgpt.engine import memory, precision
from microgpt.engine.memory import Buf
from microgpt.engine.precision import Precision, PrecisionState
from microgpt.engine.precision import make as make_precision
from microgpt.ops.rows import Rows, cpu_threads

Fn = Callable[..., Any]


@dataclass(frozen=True)
class Backend:
    name: str  # "numpy" | "triton"
    precision: Precision  # what it computes in (microgpt/engine/precision.py)
    device: str  # what it runs on, in words
    versions: dict[str, str]
    kind_bytes: dict[str, int]  # bytes per element of each memory-plan kind
    # the op pairs, registry order (microgpt/ops/<op>.py documents each)
    embedding_forward: Fn
    embedding_backward: Fn
    embedding_add_forward: Fn  # the modern block's value embeddings (backward: embedding_backward)
    layernorm_forward: Fn
    layernorm_backward: Fn
    residual_layernorm_forward: Fn
    linear_forward: Fn
    linear_backward: Fn
    attention_forward: Fn
    attention_backward: Fn
    attention_forward_cached: Fn
    doc_starts: Fn  # each position's document start from the tokens (model.doc_mask)
    mlp_forward: Fn
    mlp_backward: Fn
    crossentropy_forward: Fn
    crossentropy_backward: Fn
    crossentropy_forward_backward: Fn
    head_logits: Fn
    loss_weights: Fn
    loss_sum: Fn
    # the modern block's (model.block "modern", issue 46)
    rmsnorm_forward: Fn
    rmsnorm_backward: Fn
    residual_rmsnorm_forward: Fn
    relu2_forward: Fn
    relu2_backward: Fn
    qkrope_forward: Fn  # QK-norm and rotary embedding (ops/qkrope.py)
    qkrope_backward: Fn
    skip_forward: Fn  # the U-net skip connections (ops/skip.py)
    skip_backward: Fn
    # the step's helpers over the flat arrays
    grad_norm_partial: Fn
    grad_norm_final: Fn
    adamw_step: Fn
    muon_step: Fn
    muon_scratch: Fn  # the planned buffers muon_step takes, for a model's Muon groups (engine/optim.py)
    # the decode step's position-dependent ops (model.gpt_decode)
    decode_embedding: Fn
    decode_kv_write: Fn
    decode_attention: Fn
    decode_qkrope: Fn  # the modern block's
    decode_doc_starts: Fn  # the modern block's document starts (model.doc_mask)
    # the greedy pick after the decode step's logits (ops/argmax.py)
    argmax_rows: Fn
    # the device
    alloc: Callable[[int], Any]  # one zeroed byte array: the arena
    view: Callable[[Any, int, tuple[int, ...], str], Any]  # (pool, byte offset, shape, kind) -> typed view
    zero_: Callable[[Any], None]
    copy_: Callable[[Any, Any], None]  # buffer -> buffer of the same shape (the inference step's KV cache writes)
    copy_in: Callable[[Any, np.ndarray], None]  # host array -> buffer (casting to the buffer's dtype)
    # host array -> buffer without waiting for the device's queued work (GPU: through pinned memory, in stream order;
    # the host array may be reused at once): serve's next step staged while the step before it runs
    copy_in_async: Callable[[Any, np.ndarray], None]
    to_numpy: Callable[[Any], np.ndarray]
    # buffer -> a function that waits for the copy and returns it on the host (GPU: copied into pinned memory after
    # the work queued so far, the device not waited for until the function is called)
    fetch: Callable[[Any], Callable[[], np.ndarray]]
    synchronize: Callable[[], None]
    prepare: Callable[[Callable[[], None], bool], Callable[[], None]]  # (step, graph ok) -> what to call per step
    logits_rows: Callable[[ModelConfig, int], int]  # R of the loss head's (R, V) chunk for micro-batch B
    rows: Callable[[ModelConfig, TrainConfig], list[Buf]]  # the backend's own plan rows ("kernel", "runtime")
    infer_rows: Callable[[ModelConfig, int], list[Buf]]  # its rows in an inference plan of B sequences
    scratch_args: tuple[tuple[str, str, str], ...] = ()  # (function, keyword, planned buffer) bound by bind()
    kernel_args: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # function -> keywords
    matmul_args: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the precision's Matmul takes
    # the bytes the plan may take on the device (memory.check_fits, less train.memory_margin): the host's memory on
    # NumPy, the GPU's free memory on triton; None: the allocation decides (the interpreter)
    memory_bytes: Callable[[], int | None] = lambda: None
    # the device memory held at its peak so far, in bytes, and how it is measured; None: not measured here (the
    # CPU, where the trainer reports the process's peak resident memory instead)
    peak_memory: Callable[[], int | None] = lambda: None
    peak_memory_name: str = ""
    on_bind: Callable[[memory.Arena], None] = lambda arena: None
    tuned: Callable[[], dict[str, dict[str, str]]] = dict  # the device's recorded choices (bench prints them)
    # whether a kernel is compiled at its first launch with a new kind of argument (Triton on a GPU: an integer of 1,
    # a multiple of 16 or neither), so that a first call of a new shape costs a compile (serve warms its windows)
    compiles: bool = False

    def bind(self, arena: memory.Arena, m: ModelConfig) -> tuple[Backend, PrecisionState]:
        """This backend with every launcher given what it takes beyond the spec (the precision's Matmul, planned
        scratch, the runtime's tuner, what the bound precision asks: PrecisionState.backend_args), and the precision
        bound to the arena."""
        self.on_bind(arena)
        state = self.precision.bind(arena, m, arena.flat("params"), self, **self.matmul_args)
        kwargs: dict[str, dict[str, Any]] = {fn: {"mm": state.mm} for fn in ops.MATMUL_TAKERS}
        for fn, kws in self.kernel_args.items():
            kwargs.setdefault(fn, {}).update(kws)
        for fn, kw, buf in self.scratch_args:
            if buf in arena:  # an inference plan has no backward: none of its scratch
                kwargs.setdefault(fn, {})[kw] = arena[buf]
        for fn, kws in state.backend_args.items():
            kwargs.setdefault(fn, {}).update(kws)
        bound = {fn: functools.partial(getattr(self, fn), **kws) for fn, kws in kwargs.items()}
        return dataclasses.replace(self, **bound), state


def registry_functions(module_of: Callable[[ops.OpPair | ops.Helpers], str]) -> dict[str, Fn]:
    """Every function the registry names, taken from the module `module_of(row)` of each row."""
    fns: dict[str, Fn] = {}
    for row in [*ops.OPS.values(), *ops.HELPERS.values()]:
        module = importlib.import_module(module_of(row))
        for name in row.functions:
            fns[name] = getattr(module, name)
    return fns


# --- numpy ---------------------------------------------------------------------------------------------------
NUMPY_DTYPES = {"f32": np.float32, "compute": np.float32, "i32": np.int32, "u8": np.uint8}


def numpy_backend(
    dtypes: dict[str, type] | None = None, precision_name: str = "fp32", flag: str = "train.precision"
) -> Backend:
    """The reference backend. `dtypes` maps plan kinds to NumPy types (the gradient checks use float64). It computes
    in fp32; precision "fp8" casts the block linears' operands to E4M3 as the GPU does (microgpt/ops/fp8.py). Its
    passes between the GEMMs run on as many threads as NumPy's BLAS (ops/rows.py: the same bits on any number). What
    this machine cannot run is a ConfigError naming `flag`."""
    prec = precision.make(precision_name, "numpy")
    if why := precision.matmul_class(prec.matmul).unsupported(precision_name):
        raise ConfigError(f"{flag} {precision_name!r} {why}")
    dtypes = dict(dtypes or NUMPY_DTYPES)
    rows = Rows.make(cpu_threads())

    def view(pool: np.ndarray, offset: int, shape: tuple[int, ...], kind: str) -> np.ndarray:
        dtype = np.dtype(dtypes[kind] if kind in dtypes else prec.numpy_dtype(kind))  # a precision's own kind
        return pool[offset : offset + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)

    def copy_in(dst: np.ndarray, src: np.ndarray) -> None:
        dst[...] = np.asarray(src).reshape(dst.shape)

    def fetch(x: np.ndarray) -> Callable[[], np.ndarray]:
        got = np.array(x)  # the work is done: copied now, before anything writes x again
        return lambda: got

    def alloc(nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, np.uint8)

    return Backend(
        name="numpy",
        precision=prec,
        device="cpu",
        versions={"numpy": np.__version__},
        kind_bytes={**{kind: np.dtype(t).itemsize for kind, t in dtypes.items()}, "f8": 1},
        **registry_functions(lambda row: row.numpy),
        alloc=alloc,
        view=view,
        zero_=lambda x: x.fill(0),
        copy_=np.copyto,
        copy_in=copy_in,
        copy_in_async=copy_in,
        to_numpy=np.asarray,
        fetch=fetch,
        synchronize=lambda: None,
        prepare=lambda run, graph: run,
        logits_rows=memory.cpu_logits_rows,
        rows=lambda m, t: [],
        infer_rows=lambda m, B: [],
        memory_bytes=memory.host_memory_bytes,
        kernel_args={fn: {"rows": rows} for fn in ops.ROWS_TAKERS},
        matmul_args={"rows": rows},
    )


# --- triton --------------------------------------------------------------------------------------------------
def triton_backend(precision_name: str, flag: str = "train.precision", compute: str | None = None) -> Backend:
    """The GPU backend (or the Triton interpreter on the CPU under TRITON_INTERPRET=1); a precision this machine
    cannot run is a ConfigError naming `flag`. compute: precision.make's (the activations' dtype where not the
    precision's own: the GPU tests' fp8 over fp32 activations)."""
    from microgpt.kernels import runtime  # torch and triton: only on this path, never on the CPU path

    prec = precision.make(precision_name, "triton", compute)
    if why := precision.matmul_class(prec.matmul).unsupported(precision_name):
        raise ConfigError(f"{flag} {precision_name!r} {why}")
    rt = runtime.Runtime(prec.compute, scaled_mm=prec.scaled_mm)

    def infer_rows(m: ModelConfig, B: int) -> list[Buf]:
        scratch = runtime.infer_scratch(B, m.seq_len, m.d_model, m.n_head, rt.sm_count)
        own = [Buf(buf, (n,), "kernel", kind) for _, buf, n, kind in scratch.values()]
        return own + triton_rows(m, None, rt.sm_count, rt.workspace_bytes)

    def rows(m: ModelConfig, t: TrainConfig) -> list[Buf]:
        return triton_rows(m, t.micro_batch, rt.sm_count, rt.workspace_bytes)

    return Backend(
        name="triton",
        precision=prec,
        device=rt.device,
        versions=rt.versions,
        kind_bytes=rt.kind_bytes,
        **registry_functions(lambda row: row.triton),
        alloc=rt.alloc,
        view=rt.view,
        zero_=rt.zero_,
        copy_=rt.copy_,
        copy_in=rt.copy_in,
        copy_in_async=rt.copy_in_async,
        to_numpy=rt.to_numpy,
        fetch=rt.fetch,
        synchronize=rt.synchronize,
        prepare=rt.prepare,
        logits_rows=lambda m, B: memory.gpu_logits_rows(m, B, rt.dtype.itemsize),
        rows=rows,
        infer_rows=infer_rows,
        scratch_args=tuple((fn, kw, buf) for fn, (kw, buf, _, _) in rt.scratch(1, 1, 1, 1).items()),
        kernel_args={
            **{fn: {"tuner": rt.tuner} for fn in runtime.TUNER_TAKERS},
            "decode_attention": {"sm_count": rt.sm_count},
            "muon_step": {"gemm": rt.gemm},  # Newton-Schulz's GEMMs
        },
        matmul_args={"gemm": rt.gemm},
        on_bind=lambda arena: rt.tuner.set_probe(arena["gemm_probe"]),
        tuned=rt.tuned,
        memory_bytes=rt.memory_bytes,
        peak_memory=rt.peak_memory,
        peak_memory_name="torch.cuda.max_memory_allocated" if rt.cuda else "",
        compiles=rt.cuda,
    )


def triton_rows(m: ModelConfig, B: int | None, sm_count: int, workspace_bytes: int) -> list[Buf]:
    """The triton backend's own rows of a plan on a device of sm_count multiprocessors whose cuBLAS workspace is
    workspace_bytes: the launchers' scratch for a training micro-batch of B sequences (none in an inference plan, B
    None), the GEMM choice's probe and the workspace (kernels/runtime.py)."""
    from microgpt.kernels import runtime  # torch: only on this path, never on the CPU path

    out = []
    if B is not None:
        scratch = runtime.scratch(B, m.seq_len, m.d_model, m.n_head, sm_count, skips=m.skips > 0)
        out = [Buf(buf, (n,), "kernel", kind) for _, buf, n, kind in scratch.values()]
    out.append(Buf("gemm_probe", (runtime.Runtime.probe_numel(m.d_model, m.vocab_size),), "kernel", "f32"))
    if workspace_bytes:
        out.append(Buf("cublas_workspace", (workspace_bytes,), "runtime", "u8"))
    return out


def get_backend(
    name: str,
    precision_name: str,
    flags: tuple[str, str] = ("train.backend", "train.precision"),
) -> Backend:
    """The backend by name; what this machine cannot run is a ConfigError naming the field or flag (CLI: exit 2):
    flags[0] for the backend, flags[1] for the precision."""
    if name == "numpy":
        return numpy_backend(precision_name=precision_name, flag=flags[1])
    if name == "triton":
        try:
            return triton_backend(precision_name, flags[1])
        except ImportError as e:
            raise ConfigError(
                f"{flags[0]} 'triton' needs torch and triton ({e.name} is missing): pip install -e '.[gpu]'"
            ) from None
        except ConfigError:
            raise
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"{flags[0]} 'triton': {e}") from None
    raise ConfigError(f"{flags[0]}: unknown backend {name!r}")


def cuda_available() -> bool:
    """Whether this machine has a CUDA GPU for the triton backend: the CUDA driver's library is there (looked up
    without importing torch, so a machine without a driver stays on the torch-free CPU path), torch and triton are
    installed, and torch sees a device. The interpreter (TRITON_INTERPRET=1) is not a GPU."""
    if os.environ.get("TRITON_INTERPRET") == "1" or ctypes.util.find_library("cuda") is None:
        return False
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
        return False
    import torch  # only where a driver is there: the CPU path never imports torch

    return torch.cuda.is_available()


# --- a trained model's backend (eval, sample, chat, serve) -------------------------------------------------------
BACKEND_CHOICES = ("auto", *BACKENDS)
# What a trained model computes in on each backend: the first is the default; a precision whose only_as_trained is
# set runs only a checkpoint trained in it (Precision.only_as_trained).
INFER_PRECISIONS = {"numpy": NUMPY_PRECISIONS, "triton": ("bf16", *(p for p in PRECISIONS if p != "bf16"))}


def add_flags(p: argparse.ArgumentParser) -> None:
    """`--backend` and `--precision` of the commands that run a trained model (eval, sample, chat, serve)."""
    p.add_argument(
        "--backend",
        choices=BACKEND_CHOICES,
        default="auto",
        help="where the model runs (auto: triton where a CUDA GPU is there, else numpy)",
    )
    as_trained = " and ".join(p for p in PRECISIONS if precision.make(p, "triton").only_as_trained)
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        help=f"what it computes in (default: bf16 on triton, fp32 on numpy; {as_trained} only for a "
        "checkpoint trained in them)",
    )


def for_trained(name: str, precision: str | None, trained: str, where: str, error: type[Exception]) -> Backend:
    """The backend `--backend` names ("auto": triton where a CUDA GPU is there, else numpy) in `--precision`, for a
    checkpoint at `where` trained in `trained`. What this machine or this checkpoint cannot run is one `error`
    naming the flag (a ConfigError for what the backend itself refuses)."""
    name = ("triton" if cuda_available() else "numpy") if name == "auto" else name
    if name not in INFER_PRECISIONS:
        raise ConfigError(f"--backend: unknown backend {name!r}")
    supported = INFER_PRECISIONS[name]
    precision = precision or supported[0]
    if precision not in supported:
        raise error(
            f"--precision {precision}: the {name} backend runs {', '.join(supported)} (--backend triton "
            "runs every precision, on a GPU)"
        )
    if precision != trained and make_precision(precision, name).only_as_trained:
        raise error(
            f"--precision {precision}: {where} trained in {trained}; {precision} runs only a checkpoint "
            f"trained in it (--precision {supported[0]} or fp32 run any)"
        )
    return get_backend(name, precision, flags=("--backend", "--precision"))
