"""The triton backend's device runtime: one arena allocation and typed views into it, one stream, cuBLAS's
workspace, the launchers' scratch sizes, the device's kernel state, and the optimizer step prepared for replay as
a CUDA graph.

The kernel state is the runtime's and lives as long as it does: the device's tuner (tuning.Tuner: recorded and
timed choices, keyed by GPU name and compute capability), its cuBLASLt handle and plans (cublaslt.CublasLt), the
GEMM router over both (gemm.Gemm), and the device's multiprocessor count, which sizes the grids and scratch that
depend on it. The backend hands the tuner to the launchers that make a choice (TUNER_TAKERS) as it hands out
planned scratch, and the router to the precision's Matmul.

PyTorch is only the device runtime here (memory, stream, CUDA graph; cuBLAS GEMMs). Everything runs on one side
stream made current at start (warm-up, evaluation and graph capture): cuBLAS then keeps one workspace, measured here
so the memory plan can count it. The first run of the step on a GPU is a warm-up inside the tuner's window: every
kernel compiles and every once-per-shape choice (GEMM implementation, attention tile sizes) is timed on the
warm-up's own buffers, whose values the step throws away, so nothing is compiled, timed or allocated later, inside
the graph or outside the plan.
Under TRITON_INTERPRET=1 everything runs on the CPU (CI) and nothing is timed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import triton

from microgpt.kernels import decode, layernorm, skip
from microgpt.kernels.cublaslt import CublasLt
from microgpt.kernels.gemm import PROBE_ROWS, Gemm, cublas_mm
from microgpt.kernels.tuning import INTERPRET, Tuner

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KIND_DTYPES = {"f32": torch.float32, "i32": torch.int32, "u8": torch.uint8, "f8": torch.float8_e4m3fn}
INTERPRET_SMS = 4  # the multiprocessors the interpreter stands in for: few programs, since it runs them one by one
# the launchers that make a once-per-shape choice: they take the runtime's tuner (keyword `tuner`)
TUNER_TAKERS = ("layernorm_forward", "residual_layernorm_forward", "layernorm_backward", "embedding_backward",
                "attention_forward", "attention_backward", "crossentropy_forward", "crossentropy_backward",
                "crossentropy_forward_backward", "rmsnorm_forward", "residual_rmsnorm_forward",
                "rmsnorm_backward", "adamw_step")  # fmt: skip


def describe(props: Any) -> str:
    """A GPU (torch.cuda.get_device_properties) in words, with what the kernels' choices depend on: "NVIDIA GeForce
    RTX 4090, sm_89, 128 SMs, 24.0 GiB"."""
    sms, gib = props.multi_processor_count, props.total_memory / 2**30
    return f"{props.name}, sm_{props.major}{props.minor}, {sms} SMs, {gib:.1f} GiB"


def scratch(
    B: int, T: int, C: int, NH: int, sm_count: int, skips: bool = False
) -> dict[str, tuple[str, str, int, str]]:
    """The launchers' scratch for a micro-batch of B sequences on a device of sm_count multiprocessors, the skip
    pair's only for a model with skips (model.skips): function -> (keyword, buffer, elements, kind)."""
    N = B * T
    out = {
        "embedding_backward": ("order", "emb_order", N, "i32"),
        "layernorm_backward": ("partials", "ln_partials", layernorm.scratch_numel(C, sm_count), "f32"),
        "attention_backward": ("delta", "att_delta", N * NH, "f32"),
    }
    if skips:
        out["skip_backward"] = ("partials", "skip_partials", skip.scratch_numel(sm_count), "f32")
    return out


def infer_scratch(B: int, T: int, C: int, NH: int, sm_count: int) -> dict[str, tuple[str, str, int, str]]:
    """The launchers' scratch of an inference plan of B sequences of T positions (as `scratch`): decode attention's
    partial rows, for the splits of every batch of up to B rows (kernels/decode.py split_plan)."""
    return {"decode_attention": ("partials", "dec_partials", decode.partials_numel(B, T, C, NH, sm_count), "f32")}


class Runtime:
    def __init__(self, compute: str, scaled_mm: bool = False) -> None:
        """compute: the compute dtype's name (DTYPES); scaled_mm: the run's GEMMs include E4M3 ones
        (torch._scaled_mm), whose cuBLASLt workspace the plan counts too."""
        if compute not in DTYPES:
            raise ValueError(f"compute dtype {compute!r} is not supported by the triton backend ({', '.join(DTYPES)})")
        self.cuda = torch.cuda.is_available() and not INTERPRET
        if not self.cuda and not INTERPRET:
            raise RuntimeError("the triton backend needs a CUDA GPU (or TRITON_INTERPRET=1 for the CPU interpreter)")
        self.scaled_mm = scaled_mm
        self.dtype = DTYPES[compute]
        self.dtypes = {**KIND_DTYPES, "compute": self.dtype}
        self.kind_bytes = {kind: dtype.itemsize for kind, dtype in self.dtypes.items()}
        self.dev = torch.device("cuda" if self.cuda else "cpu")
        self.device = describe(torch.cuda.get_device_properties(self.dev)) if self.cuda else "cpu (triton interpreter)"
        self.versions = {"torch": torch.__version__, "triton": triton.__version__}
        self.workspace_bytes = self._one_stream() if self.cuda else 0
        self.sm_count = torch.cuda.get_device_properties(self.dev).multi_processor_count if self.cuda else INTERPRET_SMS
        self.tuner = Tuner()
        self.gemm = Gemm(self.tuner, CublasLt.load() if self.cuda else None)

    def _one_stream(self) -> int:
        """Make one side stream current for everything this backend runs, and return the bytes of the cuBLAS
        workspace torch keeps for it (measured: one small GEMM of each kind the engine runs, in and out)."""
        torch.cuda.synchronize()  # work queued on the previous stream is done before anything runs on this one
        self.stream = torch.cuda.Stream()
        torch.cuda.set_stream(self.stream)
        a = torch.ones(64, 64, dtype=self.dtype, device=self.dev)
        out, acc = torch.empty_like(a), torch.zeros(64, 64, dtype=torch.float32, device=self.dev)
        a8, one = a.to(torch.float8_e4m3fn), torch.ones(1, device=self.dev)  # fp8's GEMMs: cuBLASLt's workspace
        before = torch.cuda.memory_allocated()
        cublas_mm(out, a, a.t(), False)
        cublas_mm(out, a, a.t(), True)
        if self.dtype != torch.float32:
            cublas_mm(acc, a.t(), a, True)  # low-precision operands into fp32 grads
        if self.scaled_mm:
            torch._scaled_mm(a8, a8.t(), one, one, out_dtype=self.dtype, out=out)
            torch._scaled_mm(a8, a8.t(), one, one, out_dtype=torch.float32, out=acc)
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before

    def peak_memory(self) -> int | None:
        """Bytes torch's allocator has held at its peak (the arena, the cuBLAS workspace, torch's own); None on the
        interpreter's CPU tensors."""
        return torch.cuda.max_memory_allocated(self.dev) if self.cuda else None

    # --- the arena -----------------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> torch.Tensor:
        """The one device allocation of the memory plan (zeroed)."""
        try:
            return torch.zeros(nbytes, dtype=torch.uint8, device=self.dev)
        except torch.OutOfMemoryError:
            free, total = torch.cuda.mem_get_info()
            raise MemoryError(f"{self.device} has {free:,} of {total:,} bytes free") from None

    def memory_bytes(self) -> int | None:
        """The bytes a memory plan may take on this device now, before its arena is allocated: the device's free
        memory (within the process's cap where torch.cuda.set_per_process_memory_fraction set one), plus what the
        plan counts that is allocated already (cuBLAS's workspace). None under the interpreter."""
        if not self.cuda:
            return None
        index = torch.cuda.current_device()  # the cap's getter takes an index, not the unindexed "cuda"
        free, total = torch.cuda.mem_get_info(index)
        fraction = torch.cuda.get_per_process_memory_fraction(index)
        if fraction < 1:
            free = min(free, int(fraction * total) - torch.cuda.memory_reserved(index))
        return free + self.workspace_bytes

    def view(self, pool: torch.Tensor, offset: int, shape: tuple[int, ...], kind: str) -> torch.Tensor:
        dtype = self.dtypes[kind]
        n = int(np.prod(shape)) * dtype.itemsize
        return pool[offset : offset + n].view(dtype).view(shape)

    def scratch(self, B: int, T: int, C: int, NH: int) -> dict[str, tuple[str, str, int, str]]:
        """The launchers' scratch for a micro-batch of B sequences on this device (`scratch`), and for an inference
        plan of B sequences (`infer_scratch`), a model with skips' included: function -> (keyword, buffer, elements,
        kind)."""
        return {**scratch(B, T, C, NH, self.sm_count, skips=True), **infer_scratch(B, T, C, NH, self.sm_count)}

    @staticmethod
    def probe_numel(C: int, V: int) -> int:
        """fp32 elements the GEMM choice compares results in (Tuner.set_probe): rows of the widest output."""
        return 2 * PROBE_ROWS * max(V, 4 * C)

    def tuned(self) -> dict[str, dict[str, str]]:
        """Every choice this runtime knows: the GEMMs it ran (shape -> way) and every table its tuner recorded."""
        return {**self.tuner.recorded(), "gemm_run": self.gemm.choices()}

    # --- host <-> device -------------------------------------------------------------------------------------
    @staticmethod
    def zero_(x: torch.Tensor) -> None:
        x.zero_()

    @staticmethod
    def copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    @staticmethod
    def copy_in(dst: torch.Tensor, src: np.ndarray) -> None:
        """Host array -> device buffer, converted to the buffer's dtype on the host: a copy that converts on the
        way would stage the host dtype on the device, outside the memory plan."""
        src = np.ascontiguousarray(src)
        src = src if src.flags.writeable else src.copy()  # torch wraps only writable arrays (a checkpoint's are not)
        dst.copy_(torch.from_numpy(src).reshape(dst.shape).to(dst.dtype))

    def copy_in_async(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """copy_in without waiting for the work queued on the stream: the host array, converted, goes into pinned
        memory (torch's pinned pool keeps that block until the copy has run) and is copied in stream order, after
        the queued work; from pageable memory the copy would wait for all of it first. Elsewhere copy_in."""
        if not self.cuda:
            return self.copy_in(dst, src)
        host = torch.from_numpy(np.ascontiguousarray(src)).reshape(dst.shape).to(dst.dtype).pin_memory()
        dst.copy_(host, non_blocking=True)

    def fetch(self, x: torch.Tensor) -> Callable[[], np.ndarray]:
        """x on the host, later: the copy into pinned memory is queued after the work queued so far, and the
        function returned waits for it (an event, not the whole device) and returns it as to_numpy does."""
        if not self.cuda:
            got = self.to_numpy(x).copy()
            return lambda: got
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> np.ndarray:
            done.synchronize()
            return (host.float() if host.dtype in (torch.bfloat16, torch.float16) else host).numpy()

        return wait

    @staticmethod
    def to_numpy(x: torch.Tensor) -> np.ndarray:
        """A device buffer on the host; bf16 and fp16 widened to fp32 there, after the copy (widening on the device
        would allocate the fp32 copy outside the memory plan, and move twice the bytes)."""
        x = x.detach().cpu()
        return (x.float() if x.dtype in (torch.bfloat16, torch.float16) else x).numpy()

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    # --- the step --------------------------------------------------------------------------------------------
    def prepare(self, run: Callable[[], None], graph: bool) -> Callable[[], None]:
        """What to call for each step: on a GPU, `run` once as the warm-up (its results are the caller's to
        discard), then the CUDA graph of it when `graph`, else `run` itself; elsewhere `run`, untouched."""
        if not self.cuda:
            return run
        with self.tuner.window():
            run()
        torch.cuda.synchronize()
        if not graph:
            return run
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=self.stream):
            run()
        return g.replay
