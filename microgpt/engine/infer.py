"""The inference state: a model on the inference plan (weights, KV cache, one layer's activations) for the
inference step (model.gpt_infer) and the decode step (model.gpt_decode), from fresh weights, a training state or a
checkpoint. Evaluation, sampling, chat and serving hold one of these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from microgpt import checkpoint
from microgpt.config import ModelConfig, TrainConfig
from microgpt.engine import memory, model, params
from microgpt.engine.backend import Backend
from microgpt.engine.precision import PrecisionState
from microgpt.engine.state import TrainState, fill_tables
from microgpt.engine.trained import Trained


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

    def run(
        self,
        tokens: Any,
        pos: int | Sequence[int],
        targets: Any = None,
        slots: Sequence[int] | None = None,
    ) -> None:
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
        self._decoder(b)()
        return self.arena["next_logits"][:b]

    # The decode step in three calls, for a host that prepares the next step while this one runs (serve's scheduler):
    # stage its inputs, carry in the tokens only the device knows yet, launch; the greedy tokens come back later.
    def stage_decode(self, rows: np.ndarray) -> int:
        """The next decode step's inputs, rows (3b,) int32 on the host: b tokens, b positions, b cache rows (as
        decode's), checked, then copied into decode_rows without waiting for the step under way (the backend's
        copy_in_async: on a GPU in stream order, after it). A token the host does not know yet (the greedy token of
        the step under way) is any id here, carried in by `carry`. Returns b."""
        b = rows.size // 3
        self._check_decode(rows[:b], rows[b : 2 * b], rows[2 * b :])
        self.K.copy_in_async(self.arena["decode_rows"][: 3 * b], rows)
        return b

    def carry(self, dst: int, src: int, n: int) -> None:
        """Tokens dst .. dst + n - 1 of the staged step = the greedy tokens src .. src + n - 1 of the step before it
        (next_ids), copied on the device."""
        rows, ids = self.arena["decode_rows"], self.arena["next_ids"]
        self.K.copy_(rows[dst : dst + n], ids[src : src + n])

    def launch_decode(self, b: int) -> Callable[[], np.ndarray]:
        """The decode step of b rows on the staged inputs (on a GPU its graph replayed, which returns at once), and a
        function that waits for it and returns its greedy tokens (b,) int32 on the host (the backend's fetch, queued
        before any later step can write next_ids). Its logits stay in next_logits[:b] until the next step."""
        self._decoder(b)()
        return self.K.fetch(self.arena["next_ids"][:b])

    def window_logits(self, lo: int, hi: int) -> Any:
        """The logits (hi - lo, V) of rows lo .. hi - 1 (hi - lo <= B) of the last inference step's window, its
        (b, t) tokens flattened, in next_logits[: hi - lo]: the head over the final norm's output, which
        model.gpt_infer leaves in the plan's `ln`, as the loss head computes them (the tied wte or the untied head,
        the modern block's soft-cap; serve's echo with logprobs: every position's alternatives)."""
        out = self.arena["next_logits"][: hi - lo]
        self.K.head_logits(out, self.arena["ln"][lo:hi], self.P_compute["head"], **model.head_args(self.m))
        return out

    def copy_rows(self, dst: int, src: int, n: int) -> None:
        """Positions 0 .. n - 1 of KV-cache row dst = those of row src (every layer, keys and values, and their tokens
        where the model masks documents: kv_tokens): a prefix two sequences share is computed once (serve's prefix
        reuse)."""
        kv = self.arena["kv"]
        self.K.copy_(kv[:, :, dst, :n], kv[:, :, src, :n])
        if "kv_tokens" in self.arena:
            tokens = self.arena["kv_tokens"]
            self.K.copy_(tokens[dst, :n], tokens[src, :n])

    def _decoder(self, b: int) -> Callable[[], None]:
        """The decode step of b rows, prepared at its first use (K.prepare: on a GPU its warm-up, then its graph)."""
        run = self.decoders.get(b)
        if run is None:
            run = self.decoders[b] = self.K.prepare(lambda: self._decode(b), True)
        return run

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
            raise ValueError(
                f"decode: tokens, positions and slots need one entry a row, 1 to {self.B} rows (got "
                f"{tokens.size}, {positions.size}, {slots.size})"
            )
        for name, a, top in (("tokens", tokens, V), ("positions", positions, T), ("slots", slots, self.B)):
            if a.dtype.kind not in "iu" or a.min() < 0 or a.max() >= top:
                raise ValueError(f"decode: {name} must be integers in [0, {top}) (got {a.min()} .. {a.max()})")
        if np.unique(slots.astype(np.int64) * T + positions).size != b:
            raise ValueError("decode: two rows of one step write one position of one cache row")
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
    fill_tables(K, m, arena)
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
    a = A.get("a")  # (L, N, 4C) saved, (N, 4C) recomputed, or None where the precision's cast computes the activation
    view = {
        "x": A["resid"][0],
        "x2": A["resid2"][0],
        "ln": A["ln1"][0],
        "qkv": A["qkv"][0],
        "att": A["att"][0],
        "proj": A["proj"],
        "ln_rstd": A["ln1_rstd"][0],
        "att_lse": A["att_lse"][0].reshape(-1),
        "losses": A["losses"],
        "ce_lse": A["ce_lse"],
        "logits": A["logits"],
        "loss_sum": A["loss_sum"],
        "tokens": A["tokens"][0],
        "targets": A["targets"][0],
        **({} if a is None else {"a": a if a.ndim == 2 else a[0]}),
        # h as the inference plan has it (memory.pre_activation_kept), though training keeps it under recompute_gelu
        **({"h": A["h"][0]} if memory.pre_activation_kept(S.m, S.K.precision) else {}),
    }
    for name, buf in (("ln_mean", "ln1_mean"), ("qk_rstd", "qk_rstd")):  # GPT-2's LayerNorm means; modern's QK-norm
        if buf in A:
            view[name] = A[buf][0]
    for name in ("rope", "attn_window", "doc_start"):  # the rotary table; the window and document starts' buffers
        if name in A:
            view[name] = A[name]
    if S.m.skips:  # the streams a skip keeps: layers 1 .. k's saved inputs, as dead as the rest between steps
        view["skips"] = A["resid"][1 : S.m.skips + 1]
    return InferState(S.K, S.m, S.t.micro_batch, S.plan, view, S.P_compute, S.prec)


def trained_infer_state(ld: Trained, K: Backend, B: int, cache: bool = True) -> InferState:
    """A checkpoint's model on an inference plan of B sequences (make_infer_state), with what the run's precision
    keeps read from its sidecar (fp8: the amax histories the run scaled by)."""
    S = make_infer_state(ld.exp.model, K, B, ld.weights, cache)
    S.prec.load_sidecar(ld.side, str(checkpoint.sidecar_path(ld.path)))
    return S
