"""The triton backend: the namespace `K` that model.py and engine.py call, over torch tensors on the GPU.

Same names and arguments as the NumPy backend (microgpt.backend). PyTorch is only the device runtime here
(DESIGN.md §3): one arena allocation with typed views, streams, CUDA graphs, cuBLAS GEMMs where they measured
faster (kernels.linear.mm). Launchers never allocate; the three backward launchers that need scratch beyond
the spec's arguments (embedding: the sort order; layernorm: dw/db partials; attention: delta) get it here,
allocated by reserve_for before step 1 (or on first use, outside a planned arena) and counted in `extra_bytes`.
Under TRITON_INTERPRET=1 everything runs on the CPU (CI).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import triton

from microgpt import memory
from microgpt.kernels import (
    adamw,
    attention,
    crossentropy,
    embedding,
    gradclip,
    layernorm,
    linear,
    mlp,
    residual,
    tuning,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KIND_DTYPES = {"f32": torch.float32, "i32": torch.int32, "u8": torch.uint8}
POOL_ALIGN = 256  # bytes: every view of the arena starts on a 256-byte boundary


class TritonBackend:
    name = "triton"

    def __init__(self, precision: str) -> None:
        if precision not in DTYPES:
            raise ValueError(f"precision {precision!r} is not supported by the triton backend (fp32, bf16, fp16)")
        cuda = torch.cuda.is_available() and not tuning.INTERPRET
        if not cuda and not tuning.INTERPRET:
            raise RuntimeError("the triton backend needs a CUDA GPU (or TRITON_INTERPRET=1 for the CPU interpreter)")
        self.precision, self.dtype = precision, DTYPES[precision]
        self.dev = torch.device("cuda" if cuda else "cpu")
        self.device = torch.cuda.get_device_name() if cuda else "cpu (triton interpreter)"
        self.versions = {"torch": torch.__version__, "triton": triton.__version__}
        self.workspace_bytes = self._one_stream() if cuda else 0
        self.loss_scale = 2.0**16 if precision == "fp16" else 1.0
        self.dscale = torch.ones(1, dtype=torch.float32, device=self.dev)  # dlosses factor: the fp16 loss scale
        self._pool: torch.Tensor | None = None
        self._pool_off = 0
        self._scratch: dict[str, torch.Tensor] = {}
        for mod in (embedding, layernorm, linear, attention, mlp, residual, crossentropy):
            for fn in ("forward", "backward"):
                name = f"{mod.__name__.rsplit('.', 1)[-1]}_{fn}"
                if not hasattr(self, name):
                    setattr(self, name, getattr(mod, name))
        self.crossentropy_forward_backward = crossentropy.crossentropy_forward_backward
        self.grad_norm_partial, self.grad_norm_final = gradclip.grad_norm_partial, gradclip.grad_norm_final
        self.grad_scale, self.clip_coef, self.adamw_step = gradclip.grad_scale, gradclip.clip_coef, adamw.adamw_step

    def _one_stream(self) -> int:
        """Make one side stream current for everything this backend runs, and return the bytes of the cuBLAS
        workspace torch keeps for it (measured: one small GEMM of each kind the engine runs, in and out).

        cuBLAS gets a workspace per stream from torch's allocator; with warm-up, evaluation and graph capture
        all on this stream (capture needs a non-default one) there is one, and the plan can count it."""
        torch.cuda.synchronize()  # work queued on the previous stream is done before anything runs on this one
        self.stream = torch.cuda.Stream()
        torch.cuda.set_stream(self.stream)
        a = torch.ones(64, 64, dtype=self.dtype, device=self.dev)
        out, acc = torch.empty_like(a), torch.zeros(64, 64, dtype=torch.float32, device=self.dev)
        before = torch.cuda.memory_allocated()
        linear._cublas_mm(out, a, a.t(), False)
        linear._cublas_mm(out, a, a.t(), True)
        if self.dtype != torch.float32:
            linear._cublas_mm(acc, a.t(), a, True)  # low-precision operands into fp32 grads
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before

    def plan_extras(self, m: Any, t: Any) -> dict[str, int]:
        """Device bytes beside memory.plan's buffers: what reserve_for adds, the launchers' scratch, cuBLAS's."""
        # GraphStep's static buffers: tokens and targets of every micro-batch, hyper, report
        inputs = [(2 * t.n_micro * t.micro_batch * m.seq_len, "i32"), (8, "f32"), (2 + t.n_micro, "f32")]
        extras = {"step inputs": sum(self.pool_bytes(n, kind, self.precision) for n, kind in inputs)}
        if self.dtype != torch.float32:
            extras["compute weights"] = self.pool_bytes(memory.n_params(m), "compute", self.precision)
        extras["kernel scratch"] = sum(n * dtype.itemsize for n, dtype in self._scratch_sizes(m, t).values())
        extras["cuBLAS workspace"] = self.workspace_bytes
        return extras

    @staticmethod
    def _scratch_sizes(m: Any, t: Any) -> dict[str, tuple[int, torch.dtype]]:
        """The launchers' scratch (see `scratch`), by name: (elements, dtype) for a micro-batch of this model."""
        N = t.micro_batch * m.seq_len
        return {"emb_order": (N, torch.int32), "ln_partials": (layernorm.scratch_numel(m.d_model), torch.float32),
                "att_delta": (N * m.n_head, torch.float32), "loss_sum": (2, torch.float32)}  # fmt: skip

    # --- the ops whose launchers take scratch ---------------------------------------------------------
    def embedding_backward(self, dwte: Any, dwpe: Any, dout: Any, tokens: Any) -> None:
        order = self.scratch("emb_order", tokens.numel(), torch.int32)
        embedding.embedding_backward(dwte, dwpe, dout, tokens, order=order)

    def layernorm_backward(self, dx: Any, dw: Any, db: Any, dout: Any, x: Any, w: Any, mean: Any, rstd: Any) -> None:
        partials = self.scratch("ln_partials", layernorm.scratch_numel(w.shape[0]), torch.float32)
        layernorm.layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, partials=partials)

    def attention_backward(self, dq: Any, dk: Any, dv: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                           n_head: int) -> None:  # fmt: skip
        delta = self.scratch("att_delta", lse.numel(), torch.float32)
        attention.attention_backward(dq, dk, dv, dout, q, k, v, out, lse, n_head, delta=delta)

    def scratch(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < numel:
            buf = self._scratch[name] = torch.empty(numel, dtype=dtype, device=self.dev)
        return buf[:numel]

    @property
    def extra_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._scratch.values())

    # --- buffers ----------------------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> None:
        """One device allocation for the whole arena: later `alloc` calls are views into it."""
        self._pool = torch.zeros(nbytes, dtype=torch.uint8, device=self.dev)
        self._pool_off = 0

    def alloc(self, numel: int, kind: str) -> torch.Tensor:
        dtype = self.dtype if kind == "compute" else KIND_DTYPES[kind]
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if self._pool is None or self._pool_off + nbytes > self._pool.numel():
            return torch.zeros(numel, dtype=dtype, device=self.dev)
        view = self._pool[self._pool_off : self._pool_off + nbytes].view(dtype)
        self._pool_off += (nbytes + POOL_ALIGN - 1) // POOL_ALIGN * POOL_ALIGN
        return view

    @staticmethod
    def pool_bytes(numel: int, kind: str, precision: str) -> int:
        size = {"f32": 4, "i32": 4, "u8": 1}.get(kind) or DTYPES[precision].itemsize
        return (numel * size + POOL_ALIGN - 1) // POOL_ALIGN * POOL_ALIGN

    def logits_rows(self, m: Any, B: int) -> int:
        """R for the (R,V) logits scratch in the compute dtype (memory.halved_logits_rows)."""
        return memory.halved_logits_rows(m, B, self.dtype.itemsize)

    def reserve_for(self, bufs: list, m: Any, t: Any) -> int:
        """Reserve one allocation for the plan plus what GraphStep adds (compute weights, static inputs), and
        allocate the launchers' scratch: everything the plan lists exists before step 1."""
        extras = self.plan_extras(m, t)
        total = sum(self.pool_bytes(n, kind, self.precision) for (_, kind), n in memory.group_sizes(bufs).items())
        total += extras["step inputs"] + extras.get("compute weights", 0)
        self.reserve(total)
        for name, (numel, dtype) in self._scratch_sizes(m, t).items():
            self.scratch(name, numel, dtype)
        return total

    def zero_(self, x: torch.Tensor) -> None:
        x.zero_()

    def copy_in(self, dst: torch.Tensor, src: np.ndarray) -> None:
        dst.copy_(torch.from_numpy(np.ascontiguousarray(src)).reshape(dst.shape))

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        x = x.detach()
        return (x.float() if x.dtype in (torch.bfloat16, torch.float16) else x).cpu().numpy()

    def loss_weights(self, dlosses: torch.Tensor, targets: torch.Tensor) -> None:
        crossentropy.loss_weights(dlosses, targets, self.dscale)

    def loss_sum(self, losses: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        out = self.scratch("loss_sum", 2, torch.float32)
        crossentropy.loss_sum(out, losses, targets)
        s, c = out.tolist()
        return s, int(c)

    def synchronize(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def make_step(self, trainer: Any) -> Any:
        """The whole optimizer step as one CUDA graph (kernels.step.GraphStep) for the engine's Trainer."""
        from microgpt.kernels.step import GraphStep

        return GraphStep(self, trainer.m, trainer.t, trainer.arena, dp=trainer.dp)


def triton_backend(precision: str) -> TritonBackend:
    return TritonBackend(precision)
