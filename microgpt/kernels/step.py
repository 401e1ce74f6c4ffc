"""The whole optimizer step on the GPU, captured once as a CUDA graph and replayed (DESIGN.md §3).

    for each micro-batch: forward; backward          (model.gpt_forward / gpt_backward on the triton K)
    grad norm (two deterministic passes) -> AdamW with the 1/n_micro scale, the clip and the fp16 loss-scale
    unscale folded into its gradient factor; AdamW also refreshes the bf16/fp16 weight copy and zeroes the grads.

Everything the step reads from the host sits in static device buffers filled before each replay: the tokens
and targets of all micro-batches (one pinned H2D copy) and `hyper` = [lr, 1-b1^t, 1-b2^t, gscale, loss scale].
The replay reports [mean loss, raw grad norm, each micro-batch's loss] through one small D2H copy, the step's
only synchronization (the per-micro-batch losses feed the data mixture, microgpt/data/mixing.py).
The first call runs the step once eagerly with the update forced off (norm := inf makes k_adamw skip every
element), which compiles every kernel and makes every once-per-shape GEMM choice before capture, so nothing
is compiled, timed or allocated inside the graph.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from microgpt import memory, model
from microgpt.kernels import crossentropy

GROWTH_INTERVAL = 2000  # fp16: good steps before the loss scale doubles (as torch.cuda.amp.GradScaler)


class _MicroArena:
    """The arena, with tokens and targets pointing at micro-batch i of the static inputs."""

    def __init__(self, arena: Any, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        self.arena, self.inputs = arena, {"tokens": tokens, "targets": targets}

    def __getitem__(self, name: str) -> Any:
        return self.inputs.get(name) if name in self.inputs else self.arena[name]


class GraphStep:
    def __init__(self, K: Any, m: Any, t: Any, arena: Any, use_graph: bool | None = None, dp: Any = None) -> None:
        self.K, self.m, self.t, self.A, self.dp = K, m, t, arena, dp
        self.world = dp.world_size if dp is not None else 1
        B, T = arena["tokens"].shape
        self.p, self.g = arena.flat_f32("params"), arena.flat_f32("grads")
        self.adam_m, self.adam_v = arena.flat_f32("adam_m"), arena.flat_f32("adam_v")
        self.G = arena.role("grads")
        if K.dtype == torch.float32:
            self.p_lp, self.P = None, arena.role("params")
        else:  # the compute copy of the weights, same packed order; refreshed by k_adamw after each update
            self.p_lp = K.alloc(self.p.numel(), "compute")
            self.P, off = {}, 0
            for name, shape in memory.param_shapes(m):
                n = math.prod(shape)
                self.P[name] = self.p_lp[off : off + n].view(shape)
                off += n
            self.refresh_lp()
        self.inputs = K.alloc(2 * t.n_micro * B * T, "i32").view(2, t.n_micro, B, T)
        self.hyper = K.alloc(8, "f32")
        self.report = K.alloc(2 + t.n_micro, "f32")  # [mean loss over the micro-batches, raw grad norm, each loss]
        self.micro_losses: list[float] = []
        K.dscale = self.hyper[4:5]
        pin = K.dev.type == "cuda"
        self.host_inputs = torch.zeros(self.inputs.shape, dtype=torch.int32, pin_memory=pin)
        self.host_hyper = torch.zeros(8, dtype=torch.float32, pin_memory=pin)
        self.host_report = torch.zeros(2 + t.n_micro, dtype=torch.float32, pin_memory=pin)
        # data parallel: the NCCL all-reduce runs between backward and the norm, so that step stays eager
        self.use_graph = (K.dev.type == "cuda" and dp is None) if use_graph is None else use_graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.good_steps = 0

    def refresh_lp(self) -> None:
        """Recast the fp32 master weights into the compute copy (at start and after a checkpoint load)."""
        if self.p_lp is not None:
            self.p_lp.copy_(self.p)

    def _body(self, warmup: bool = False) -> None:
        K, t, A = self.K, self.t, self.A
        K.zero_(self.report)
        for i in range(t.n_micro):
            Ai = _MicroArena(A, self.inputs[0, i], self.inputs[1, i])
            model.gpt_forward(K, self.m, self.P, Ai, self.G)
            crossentropy.loss_sum(self.report, A["losses"], Ai["targets"].reshape(-1), 1.0 / t.n_micro, accumulate=True)
            crossentropy.loss_sum(self.report[2 + i :], A["losses"], Ai["targets"].reshape(-1), 1.0, accumulate=True)
            model.gpt_backward(K, self.m, self.P, self.G, Ai)
        if self.dp is not None:
            self.dp.all_reduce_grads(self.g)  # the sum over ranks; gscale makes it the mean
        K.grad_norm_partial(A["norm_partials"], self.g, memory.NORM_BLOCK)
        K.grad_norm_final(A["norm"], A["norm_partials"])
        self.report[1:2].copy_(A["norm"])
        if warmup:
            A["norm"].fill_(float("inf"))  # compile everything, update nothing
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        K.adamw_step(self.p, self.g, self.adam_m, self.adam_v, A["decay_mask"], 0.0, t.beta1, t.beta2, t.eps,
                     t.weight_decay, 1, p_lp=self.p_lp, hyper=self.hyper, norm=A["norm"], max_norm=max_norm,
                     zero_grad=True)  # fmt: skip

    def _capture(self) -> None:
        # warm-up and capture on the backend's one stream (TritonBackend._one_stream): one cuBLAS workspace
        stream = torch.cuda.current_stream()
        self._body(warmup=True)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            self._body()

    def step(self, batches: list[tuple[np.ndarray, np.ndarray]], lr: float, t_adam: int) -> tuple[float, float]:
        """One optimizer step over n_micro (x, y) batches; returns (mean loss, grad norm before clipping)."""
        t, K = self.t, self.K
        for i, (x, y) in enumerate(batches):
            self.host_inputs[0, i].numpy()[...] = x
            self.host_inputs[1, i].numpy()[...] = y
        gscale = 1.0 / (t.n_micro * self.world * K.loss_scale)
        self.host_hyper[:5] = torch.tensor([lr, 1 - t.beta1**t_adam, 1 - t.beta2**t_adam, gscale, K.loss_scale])
        self.inputs.copy_(self.host_inputs, non_blocking=True)
        self.hyper.copy_(self.host_hyper, non_blocking=True)
        if self.use_graph:
            if self.graph is None:
                self._capture()
            self.graph.replay()
        else:
            self._body()
        self.host_report.copy_(self.report, non_blocking=True)
        K.synchronize()
        loss, raw_norm, *self.micro_losses = self.host_report.tolist()
        grad_norm = raw_norm * gscale
        if K.precision == "fp16":
            self._update_loss_scale(math.isfinite(raw_norm))
        return loss, grad_norm

    def _update_loss_scale(self, finite: bool) -> None:
        """Dynamic loss scaling: halve on overflow (that step was skipped on the device), double after a streak."""
        if not finite:
            self.K.loss_scale = max(1.0, self.K.loss_scale / 2)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps % GROWTH_INTERVAL == 0:
            self.K.loss_scale = min(2.0**24, self.K.loss_scale * 2)
