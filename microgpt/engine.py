"""The training step, the run loop, checkpoints and signals.

One optimizer step, exactly as the seed describes it:

    for each micro-batch: forward; backward (adds into the grads)
    scale_grads(1 / n_micro) -> clip (global norm) -> AdamW -> zero_grads

Weights, Adam m and v change only inside the optimizer section, so at any other moment they are the
state after the last completed step: a signal handler may checkpoint right away (SIGTERM then exits 0,
SIGUSR1 carries on); a signal that lands inside the optimizer section is handled as soon as it ends.
Data parallel (dp, microgpt/distributed.py): grads are summed over ranks after the last micro-batch, ranks
agree on signals at the step boundary, and rank 0 alone writes checkpoints.
Everything the engine tells the world goes out as one JSON object per line on stdout.
"""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from microgpt import checkpoint, data, memory, model
from microgpt.backend import get_backend
from microgpt.config import ConfigError, Experiment
from microgpt.errors import InputError
from microgpt.ops import clip_coef

STDOUT_FD = 1


def emit(obj: dict[str, Any]) -> None:
    """One JSON line on stdout, written with one os.write: safe from a signal handler, flushed at once."""
    line = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
    while line:
        line = line[os.write(STDOUT_FD, line) :]


def lr_at(step: int, t: Any) -> float:
    """Linear warmup to t.lr over warmup_steps, then cosine decay to t.min_lr at t.steps. step is 0-based.

    The schedule starts at t.schedule_start (0 for a plain run; a phase's first step under the proxy), so a
    polish phase gets its own warmup and cosine instead of the tail of the pretraining one.
    """
    step, steps = step - t.schedule_start, t.steps - t.schedule_start
    warmup = min(t.warmup_steps, steps)
    if step < warmup:
        return t.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))


class Terminate(Exception):
    """Raised from the SIGTERM/SIGINT handler after the checkpoint is written."""


class Trainer:
    def __init__(self, exp: Experiment, out: Path, tokenizer_info: dict[str, Any] | None = None, K: Any = None,
                 dp: Any = None):  # fmt: skip
        m, t = exp.model, exp.train
        self.exp, self.m, self.t, self.out = exp, m, t, Path(out)
        self.dp = dp  # distributed.DataParallel, or None for one process
        self.rank, self.world = (dp.rank, dp.world_size) if dp is not None else (0, 1)
        self.K = K or get_backend(t.backend, t.precision)
        rows = self.K.logits_rows(m, t.micro_batch) if hasattr(self.K, "logits_rows") else None
        self.bufs = memory.plan(m, t.micro_batch, rows)
        if hasattr(self.K, "reserve_for"):  # triton: the whole arena is one device allocation
            self.K.reserve_for(self.bufs, m, t)
        self.arena = memory.Arena(self.bufs, self.K.alloc)
        self.P, self.G = self.arena.role("params"), self.arena.role("grads")
        self.p, self.g = self.arena.flat_f32("params"), self.arena.flat_f32("grads")
        self.adam_m, self.adam_v = self.arena.flat_f32("adam_m"), self.arena.flat_f32("adam_v")
        self.n_params = memory.n_params(m)
        self.train_data, self.val_data = data.make_loaders(exp, t.micro_batch, shard=(self.rank, self.world))
        self.data_info = data.data_description(exp)  # for every checkpoint's sidecar: the data do not change
        self.tokenizer_info = tokenizer_info or {}
        self.step = 0
        self._critical = False  # from the optimizer section until the step is reported, or in a checkpoint write
        self._pending: list[str] = []
        self._init_state()
        # triton: the whole optimizer step runs on the device as one CUDA graph (microgpt/kernels/step.py),
        # over a bf16/fp16 copy of the weights when the compute precision is not fp32
        self.fast = self.K.make_step(self) if hasattr(self.K, "make_step") else None
        self.P_compute = self.fast.P if self.fast is not None else self.P

    def _init_state(self) -> None:
        """Weights from the seed, the decay mask from the parameter shapes; m, v and grads start at zero."""
        host = {name: np.zeros(shape, np.float32) for name, shape in memory.param_shapes(self.m)}
        model.init_params(host, self.m, np.random.default_rng(self.t.seed))
        self.K.copy_in(self.p, np.concatenate([a.reshape(-1) for a in host.values()]))
        mask = np.concatenate([np.full(a.size, a.ndim == 2, np.uint8) for a in host.values()])
        self.K.copy_in(self.arena["decay_mask"], mask)

    # --- the step -------------------------------------------------------------------------------------
    def micro_forward(self, x: np.ndarray, y: np.ndarray, train: bool = False) -> tuple[float, int]:
        """(sum of losses, count) of one micro-batch; with train, the loss head's gradients too (model.py)."""
        self.K.copy_in(self.arena["tokens"], x)
        self.K.copy_in(self.arena["targets"], y)
        model.gpt_forward(self.K, self.m, self.P_compute, self.arena, self.G if train else None)
        return self.K.loss_sum(self.arena["losses"], self.arena["targets"].reshape(-1))

    def train_step(self) -> dict[str, Any]:
        """Run optimizer step self.step (0-based) and advance self.step; return the step's log record.

        Returns still inside the critical section: the caller leaves it once the record is out (run()), so a
        signal's checkpoint of step s is never announced before step s's own line (no gap in the history).
        """
        K, t, A, step = self.K, self.t, self.arena, self.step
        t0 = time.perf_counter()
        if self.fast is not None:
            return self._device_step(t0)
        loss, micro_losses = 0.0, []
        for micro in range(t.n_micro):
            total, count = self.micro_forward(*self.train_data.batch(step, micro), train=True)
            micro_losses.append(total / max(1, count))
            loss += micro_losses[-1] / t.n_micro
            model.gpt_backward(K, self.m, self.P, self.G, A)
        if self.dp is not None:
            self.dp.all_reduce_grads(self.g)  # sum over ranks; the scale below makes it the mean
        K.grad_scale(self.g, 1.0 / (t.n_micro * self.world))
        K.grad_norm_partial(A["norm_partials"], self.g, memory.NORM_BLOCK)
        K.grad_norm_final(A["norm"], A["norm_partials"])
        grad_norm = float(K.to_numpy(A["norm"])[0])
        coef = clip_coef(grad_norm, t.grad_clip) if t.grad_clip > 0 else 1.0
        if coef < 1.0:
            K.grad_scale(self.g, coef)
        lr = lr_at(step, t)
        self._critical = True
        K.adamw_step(self.p, self.g, self.adam_m, self.adam_v, A["decay_mask"], lr, t.beta1, t.beta2, t.eps,
                     t.weight_decay, step + 1)  # fmt: skip
        K.zero_(self.g)
        self.step = step + 1
        mix = self._end_mixture(step, micro_losses)  # with the step, so a checkpoint never sees half of it
        K.synchronize()
        return self._record(t0, loss, lr, grad_norm, mix)

    def _record(self, t0: float, loss: float, lr: float, grad_norm: float, mix: dict[str, Any]) -> dict[str, Any]:
        """The step's JSON line (step = steps completed, tokens over all ranks, time since t0)."""
        t, dt = self.t, time.perf_counter() - t0
        tokens = t.n_micro * t.micro_batch * self.m.seq_len * self.world
        return {"event": "step", "step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "tokens_per_s": tokens / dt, "dt_ms": 1000 * dt, "tokens": tokens, **mix}  # fmt: skip

    def _end_mixture(self, step: int, micro_losses: list[float]) -> dict[str, Any]:
        """FIREHOSE (microgpt/data/mixing.py): the step's per-source losses update the mixture; its record fields."""
        return self.train_data.end_step(step, micro_losses, self.dp)

    def _device_step(self, t0: float) -> dict[str, Any]:
        """The triton backend's step: batches in, one graph replay (micro-batches, clip, AdamW, zero), numbers out."""
        t, step = self.t, self.step
        lr = lr_at(step, t)
        batches = [self.train_data.batch(step, micro) for micro in range(t.n_micro)]
        self._critical = True
        loss, grad_norm = self.fast.step(batches, lr, step + 1)
        self.step = step + 1
        mix = self._end_mixture(step, self.fast.micro_losses)
        return self._record(t0, loss, lr, grad_norm, mix)

    def evaluate(self) -> dict[str, Any]:
        """{"val_loss": ...}; a mixture adds each source's own val loss, and val_loss is their prior-weighted mean."""
        return self.val_data.record({name: self._val_loss(ld) for name, ld in self.val_data.sources.items()})

    def _val_loss(self, loader: data.Loader) -> float:
        total, count = 0.0, 0
        for i in range(self.t.eval_batches):
            s, c = self.micro_forward(*loader.val_batch(i))
            total, count = total + s, count + c
        if self.dp is not None:
            total, count = self.dp.sum_scalars(total, count)
        return total / max(1, count)

    # --- checkpoints and signals ----------------------------------------------------------------------
    def load(self, path: str | Path) -> None:
        ck = checkpoint.read_checkpoint(path, self.n_params)
        side = checkpoint.read_sidecar(path)
        saved_model = side.get("config", {}).get("model")
        if saved_model is not None and saved_model != self.exp.to_dict()["model"]:
            diff = [k for k in saved_model if saved_model[k] != self.exp.to_dict()["model"].get(k)]
            raise checkpoint.CheckpointError(f"{path}: checkpoint is for another model (model.{diff[0]} differs)")
        for dst, src in ((self.p, ck.weights), (self.adam_m, ck.m), (self.adam_v, ck.v)):
            self.K.copy_in(dst, src)
        self.step = ck.step
        self.train_data.load_state(side.get("mixing"), ck.step, str(path))  # a mixture continues where it left
        if self.fast is not None:
            self.fast.refresh_lp()  # the compute copy of the weights follows the loaded fp32 masters
            self.K.loss_scale = float(side.get("loss_scale", self.K.loss_scale))
            self.fast.good_steps = int(side.get("loss_scale_good_steps", 0))  # fp16: when the scale grows next

    def save(self, reason: str) -> Path | None:
        """Checkpoint the last completed step under <out>/ckpt and announce it (data parallel: rank 0 only)."""
        if self.dp is not None:  # every rank comes here after the same step; the replicas must agree
            self.dp.check_replicas(self.step, (self.p, self.adam_m, self.adam_v))
            if self.rank != 0:
                return None
        was_critical, self._critical = self._critical, True
        self.K.synchronize()
        host = [self.K.to_numpy(a) for a in (self.p, self.adam_m, self.adam_v)]
        meta = {"config": self.exp.to_dict(), "seed": self.t.seed, "tokenizer": self.tokenizer_info,
                "data": self.data_info, "backend": self.t.backend, "precision": self.t.precision,
                "loss_scale": getattr(self.K, "loss_scale", 1.0),
                "loss_scale_good_steps": getattr(self.fast, "good_steps", 0), "reason": reason,
                "params": [[n, list(s)] for n, s in memory.param_shapes(self.m)]}  # fmt: skip
        mix = self.train_data.state()  # FIREHOSE: weights, rewards, draw counts (bit-exact resume); plain: None
        if mix is not None:
            meta["mixing"] = mix
        path = checkpoint.write_checkpoint(self.out / "ckpt" / checkpoint.ckpt_name(self.step), self.step, *host, meta)
        emit({"event": "checkpoint", "step": self.step, "path": str(path), "reason": reason})
        self._critical = was_critical
        return path

    def _on_signal(self, signum: int, frame: Any) -> None:
        reason = "SIGUSR1" if signum == signal.SIGUSR1 else "SIGTERM"
        if self._critical or self.dp is not None:  # dp: handled after the step the ranks agree on (dp.act)
            self._pending.append(reason)
            return
        self._handle(reason)

    def _handle(self, reason: str) -> None:
        self.save(reason)
        if reason == "SIGTERM":
            raise Terminate

    def _leave_critical(self) -> None:
        self._critical = False
        while self._pending and self.dp is None:
            self._handle(self._pending.pop(0))

    def install_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    # --- the run --------------------------------------------------------------------------------------
    def start_record(self) -> dict[str, Any]:
        versions = {"python": platform.python_version(), "numpy": np.__version__}
        versions.update(getattr(self.K, "versions", {}))
        return {"event": "start", "run": self.exp.name, "config": self.exp.to_dict(), "n_params": self.n_params,
                "memory": memory.role_bytes(self.bufs, self.t.precision), "versions": versions,
                "device": self.K.device, "step": self.step, "git": _git_commit(), "world_size": self.world}  # fmt: skip

    def run(self) -> int:
        t = self.t
        self.install_signals()  # before the start record: a supervisor may signal as soon as it reads it
        try:
            emit(self.start_record())
            while self.step < t.steps:
                rec = self.train_step()
                if self.dp is not None:
                    self.dp.agree(self, rec)  # the mean loss over ranks; the signals every rank acts on below
                if not math.isfinite(rec["loss"]):
                    print(f"error: loss is {rec['loss']} at step {self.step}; stopping", file=sys.stderr)
                    return 3
                if self.step % t.log_every == 0 or self.step == t.steps:
                    emit(rec)
                    if self.rank == 0:
                        _progress(rec, t.steps)
                self._leave_critical()  # a signal that came during the step is handled now
                if self.step % t.eval_every == 0 or self.step == t.steps:
                    emit({"event": "eval", "step": self.step, **self.evaluate()})
                if self.step % t.ckpt_every == 0 and self.step < t.steps:
                    self.save("periodic")
                    self._leave_critical()  # a signal that came during the write is handled now, not a step later
                if self.dp is not None:
                    self.dp.act(self)  # agreed signals (rank 0 checkpoints; SIGTERM stops all); replica checks
            self.save("final")
        except Terminate:
            emit({"event": "stopped", "step": self.step, "reason": "SIGTERM"})
            return 0
        except InputError as e:  # found only while training: a mixture source ran dry (microgpt/data/mixing.py)
            print(f"error: {e}", file=sys.stderr)
            return 2
        emit({"event": "done", "step": self.step})
        return 0


def _progress(rec: dict[str, Any], steps: int) -> None:
    print(f"step {rec['step']:>6}/{steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
          f"norm {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s", file=sys.stderr)  # fmt: skip


def _git_commit() -> str | None:
    head = Path(__file__).resolve().parent.parent / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            return (head.parent / ref[5:]).read_text().strip()
        return ref
    except OSError:
        return None


def check_out_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create the output folder ({e.strerror})") from None
