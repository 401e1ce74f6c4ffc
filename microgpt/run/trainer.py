"""The run: optimizer steps (engine/step.py) over a TrainState (engine/state.py), evaluation, checkpoints,
signals, and the records the world reads (microgpt/runlog.py: the run folder's train.jsonl, the terminal's human
lines, stdout's JSON lines when asked).

Weights, Adam m and v change only inside the step, so at any other moment they are the state after the last
completed step: a signal handler may checkpoint right away (SIGTERM then exits 0, SIGUSR1 carries on); a signal
that lands inside the step is handled as soon as it ends.
Data parallel (dp, engine/collectives.py): each layer's grads are summed over ranks during the last micro-batch's
backward (step.py), the ranks agree on the step's loss and on the signals received at the step boundary (dp.agree,
dp.to_act: the trainer hands over what it received and acts on what comes back), and rank 0 alone writes
checkpoints.
Everything the engine tells the world is a record of its RunLog: appended to <out>/train.jsonl, printed on stdout
as a JSON line when asked (`train --json`, as the proxy asks), a human line on the terminal where one helps.
A checkpoint that cannot be written (a full disk) ends the run with one `error:` line and exit code EXIT_WRITE (4),
the temp file removed and the previous checkpoints intact; the proxy does not restart it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import resource
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

import microgpt
from microgpt import checkpoint, config, data
from microgpt.config import ConfigError, Experiment
from microgpt.engine import memory, model
from microgpt.engine.backend import Backend, get_backend
from microgpt.engine.state import make_state
from microgpt.engine.step import Step
from microgpt.engine.trained import load_trained
from microgpt.errors import EXIT_WRITE, InputError, WriteError
from microgpt.run import report
from microgpt.runlog import RunLog
from microgpt.use import hellaswag


def schedule_end(t: Any) -> int:
    """The step the lr schedule ends at: train.schedule_steps, or train.steps when that is 0."""
    return t.schedule_steps or t.steps


def lr_at(step: int, t: Any) -> float:
    """Linear warmup to t.lr over warmup_steps, then cosine decay to t.min_lr at schedule_end(t); past it, t.min_lr.
    step is 0-based.

    The schedule starts at t.schedule_start (0 for a plain run; a phase's first step under the proxy), so a
    polish phase gets its own warmup and cosine instead of the tail of the pretraining one. A run trained past
    its schedule's end (`--steps` beyond a finished run: a resume keeps the schedule, Trainer.load) continues at
    the schedule's final lr, never back up.
    """
    step, steps = step - t.schedule_start, schedule_end(t) - t.schedule_start
    warmup = min(t.warmup_steps, steps)
    if step < warmup:
        return t.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))


class Terminate(Exception):
    """Raised from the SIGTERM/SIGINT handler after the checkpoint is written."""


class Trainer:
    def __init__(self, exp: Experiment, out: Path, tokenizer_info: dict[str, Any] | None = None,
                 K: Backend | None = None, dp: Any = None, log: RunLog | None = None):  # fmt: skip
        m = exp.model
        if dp is not None:
            config.check_data_parallel(exp.train)
        self.dp = dp  # distributed.DataParallel, or None for one process
        self.rank, self.world = (dp.rank, dp.world_size) if dp is not None else (0, 1)
        self.S = make_state(m, exp.train, K or get_backend(exp.train.backend, exp.train.precision))
        t = self.S.t  # micro_batch "auto" resolved: what runs, and what the checkpoints record
        self.exp, self.m, self.t, self.out = dataclasses.replace(exp, train=t), m, t, Path(out)
        self.K = self.S.K
        self.train_data, self.val_data = data.make_loaders(self.exp, t.micro_batch, shard=(self.rank, self.world))
        self.data_info = data.data_description(self.exp)  # for every checkpoint's sidecar: the data do not change
        self.tokenizer_info = tokenizer_info or {}
        self.step_fn = Step(self.S, dp)
        self.hellaswag = hellaswag.DuringTraining.make(self.exp, self.rank, self.world)  # None without it
        self._critical = False  # from the start of a step until it is reported, or in a checkpoint write
        self._pending: list[str] = []
        self.last_eval: dict[str, Any] = {}  # {"val_loss", "val_step"} of the latest evaluation, for the sidecars
        self.log = log or RunLog()  # no log file, nothing on stdout: a Trainer made by a test or a script
        self.recipe: dict[str, Any] = {}  # how the run was asked for (cli.recipe): the start record and the report
        self.init: dict[str, Any] = {}  # --init: the checkpoint whose weights this run started from
        self.elapsed0, self.t0 = 0.0, None  # training seconds before this process (its checkpoint's), and its start
        self.outcome = ""  # how run() ended: done | stopped | failed
        self.last_checkpoint: Path | None = None
        self.last_targets: list[np.ndarray] = []

    @property
    def step(self) -> int:
        return self.S.step

    # --- the step -------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """Run optimizer step self.step (0-based) and advance it; return the step's log record.

        Returns still inside the critical section: the caller leaves it once the record is out (run()), so a
        signal's checkpoint of step s is never announced before step s's own line (no gap in the history).
        """
        t, step = self.t, self.step
        t0 = time.perf_counter()
        lr = lr_at(step, t)
        batches = [self.train_data.batch(step, micro) for micro in range(t.n_micro)]
        self.last_targets = [y for _, y in batches]  # the report card's bytes per token of the final train loss
        self._critical = True
        res = self.step_fn(batches, lr)
        mix = self._end_mixture(step, res.micro_losses)  # with the step, so a checkpoint never sees half of it
        dt = time.perf_counter() - t0
        tokens = t.n_micro * t.micro_batch * self.m.seq_len * self.world
        return {"event": "step", "step": self.step, "loss": res.loss, "lr": lr, "grad_norm": res.grad_norm,
                "tokens_per_s": tokens / dt, "dt_ms": 1000 * dt, "tokens": tokens, **mix}  # fmt: skip

    def _end_mixture(self, step: int, micro_losses: list[float]) -> dict[str, Any]:
        """FIREHOSE (microgpt/data/mixing.py): the step's per-source losses update the mixture; its record fields."""
        return self.train_data.end_step(step, micro_losses, self.dp)

    def evaluate(self) -> dict[str, Any]:
        """{"val_loss": ...}; a mixture adds each source's own val loss, and val_loss is their prior-weighted mean."""
        return self.val_data.record({name: self._val_loss(ld) for name, ld in self.val_data.sources.items()})

    def evaluations(self) -> dict[str, Any]:
        """The fields of the eval record due after this step (val loss, HellaSwag; both at the last); {}: none."""
        last, ev = self.t.steps, {}
        if self.step % self.t.eval_every == 0 or self.step == last:
            ev = self.evaluate()
            self.last_eval = {"val_loss": ev["val_loss"], "val_step": self.step}
        if self.hellaswag is not None and self.hellaswag.due(self.step, last):
            ev.update(self.hellaswag(self.S, self.dp))
        return ev

    def _val_loss(self, loader: data.Loader) -> float:
        K, A = self.K, self.S.arena
        total, count = 0.0, 0
        for i in range(self.t.eval_batches):
            x, y = loader.val_batch(i)
            K.copy_in(A["tokens"][0], x)
            K.copy_in(A["targets"][0], y)
            model.gpt_forward(K, self.m, self.S.P_compute, A, A["tokens"][0], A["targets"][0])
            self.S.prec.end_eval()  # fp8: evaluation scales by the amax histories and leaves nothing in them
            K.loss_sum(A["loss_sum"], A["losses"], A["targets"][0].reshape(-1))
            s, c = K.to_numpy(A["loss_sum"]).tolist()
            total, count = total + s, count + int(c)
        if self.dp is not None:
            total, count = self.dp.sum_scalars(total, count)
        return total / max(1, count)

    # --- checkpoints and signals ----------------------------------------------------------------------
    def load(self, path: str | Path) -> None:
        side = self.S.load_checkpoint(path)
        self.last_eval = {k: side[k] for k in ("val_loss", "val_step") if k in side}  # until the next evaluation
        self.train_data.load_state(side.get("mixing"), self.step, str(path))  # a mixture continues where it left
        self.elapsed0 = float(side.get("elapsed_s", 0.0))
        self.init = side.get("init") or {}
        self._keep_schedule(side.get("config", {}).get("train", {}))

    def _keep_schedule(self, saved: dict[str, Any]) -> None:
        """A resume keeps the lr schedule its checkpoint was trained on: with --steps beyond it (a finished run
        trained on), the steps past its end run at its final lr (lr_at). Not when train.schedule_steps is set (a
        deliberate new schedule) or the schedule starts elsewhere (the proxy's next phase: a schedule of its own)."""
        t = self.t
        end = saved.get("schedule_steps") or saved.get("steps")
        if t.schedule_steps or saved.get("schedule_start", 0) != t.schedule_start or not isinstance(end, int):
            return
        if end != t.steps and end > t.schedule_start:
            t.schedule_steps = end

    def init_from(self, where: str) -> None:
        """--init: a new run from another run's weights (a checkpoint, or a run folder's newest): the same model,
        fresh Adam moments, step 0, this experiment's own schedule. The provenance rides in every sidecar."""
        ld = load_trained(where)
        diff = next((k for k, v in vars(ld.exp.model).items() if vars(self.m)[k] != v), None)
        if diff is not None:
            raise checkpoint.CheckpointError(f"--init {where}: {ld.path} is a model with another model.{diff} "
                                             f"({getattr(ld.exp.model, diff)}, this experiment's is "
                                             f"{getattr(self.m, diff)})")  # fmt: skip
        self.S.set_weights(ld.weights)
        tok = ld.side.get("tokenizer", {})
        self.init = {"path": str(ld.path), "step": ld.step, "run": ld.exp.name, "sha256": ld.side.get("sha256"),
                     "tokenizer": {k: tok[k] for k in ("kind", "sha256") if k in tok}}  # fmt: skip

    def elapsed(self) -> float:
        """Training seconds of the run up to now: this process's (from its first step) plus its checkpoint's."""
        return self.elapsed0 + (time.monotonic() - self.t0 if self.t0 is not None else 0.0)

    def save(self, reason: str) -> Path | None:
        """Checkpoint the last completed step under <out>/ckpt and announce it (data parallel: rank 0 only)."""
        S = self.S
        if self.dp is not None:  # every rank comes here after the same step; the replicas must agree
            self.dp.check_replicas(self.step, (S.p, S.adam_m, S.adam_v))
            if self.rank != 0:
                return None
        was_critical, self._critical = self._critical, True
        meta = {"config": self.exp.to_dict(), "seed": self.t.seed, "tokenizer": self.tokenizer_info,
                "data": self.data_info, "backend": self.t.backend, "precision": self.t.precision,
                "reason": reason, "elapsed_s": round(self.elapsed(), 3), **self.last_eval}  # fmt: skip
        if self.init:
            meta["init"] = self.init
        mix = self.train_data.state()  # FIREHOSE: weights, rewards, draw counts (bit-exact resume); plain: None
        if mix is not None:
            meta["mixing"] = mix
        target = self.out / "ckpt" / checkpoint.ckpt_name(self.step)
        try:
            path = S.save_checkpoint(target, meta)
        except OSError as e:  # a full disk, a read-only folder: fileio removed its temp file, older ones are intact
            raise WriteError(f"{target}: cannot write the checkpoint ({e.strerror or e}); the previous "
                             "checkpoints are intact") from None  # fmt: skip
        self.last_checkpoint = path
        self.log.emit({"event": "checkpoint", "step": self.step, "path": str(path), "reason": reason})
        self.log.say(f"checkpoint step {self.step} written ({reason}): {path}")
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

    def _take_pending(self) -> list[str]:
        """The signals received during the step, handed to the data-parallel group to agree on."""
        taken, self._pending = self._pending, []
        return taken

    def _leave_critical(self) -> None:
        self._critical = False
        while self._pending and self.dp is None:
            self._handle(self._pending.pop(0))

    def install_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    # --- the run --------------------------------------------------------------------------------------
    def start_record(self) -> dict[str, Any]:
        versions = {"microgpt": microgpt.__version__, "python": platform.python_version(), "numpy": np.__version__,
                    **self.K.versions}  # fmt: skip
        m, t = self.m, self.t
        return {"event": "start", "run": self.exp.name, "config": self.exp.to_dict(), "n_params": self.S.n_params,
                "memory": memory.role_bytes(self.S.plan, self.K.precision), "versions": versions,
                "device": self.K.device, "step": self.step, "git": _git_commit(), "world_size": self.world,
                "recipe": self.recipe, "init": self.init or None, "schedule_end": schedule_end(t), "pid": os.getpid(),
                "flops_per_token": report.flops_per_token(m, self.S.n_params),
                "peak_flops": report.peak_flops(self.K.device, t.precision),
                "memory_measure": self.K.peak_memory_name or report.RSS_NAME}  # fmt: skip

    def memory_peak(self) -> int:
        """The backend's measured peak (a GPU's allocator), or on the CPU this process's peak resident memory."""
        peak = self.K.peak_memory()
        return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def run(self) -> int:
        t = self.t
        self.install_signals()  # before the start record: a supervisor may signal as soon as it reads it
        try:
            self.log.emit(self.start_record())
            if self.hellaswag is not None and self.rank == 0:
                self.log.say(self.hellaswag.describe())
            clock = _Clock(self.step, t.steps)
            self.t0 = time.monotonic()
            while self.step < t.steps:
                rec = self.train_step()
                rec.update(elapsed_s=round(self.elapsed(), 3), memory_peak=self.memory_peak())
                if self.dp is not None:  # the mean loss over ranks; the signals every rank acts on below
                    rec["loss"] = self.dp.agree(rec["loss"], self._take_pending())
                if not math.isfinite(rec["loss"]):
                    self.log.say(f"error: loss is {rec['loss']} at step {self.step}; stopping")
                    self.outcome = "failed"
                    return 3
                if self.step % t.log_every == 0 or self.step == t.steps:
                    self.log.emit(rec)
                    if self.rank == 0:
                        self.log.say(_progress(rec, t.steps, clock))
                self._leave_critical()  # a signal that came during the step is handled now
                ev = self.evaluations()
                if ev:
                    self.log.emit({"event": "eval", "step": self.step, **ev})
                    if self.rank == 0:
                        self.log.say(_progress_eval(self.step, t.steps, ev, self.eval_windows()))
                if self.step % t.ckpt_every == 0 and self.step < t.steps:
                    self.save("periodic")
                    self._leave_critical()  # a signal that came during the write is handled now, not a step later
                if self.dp is not None:  # agreed signals (rank 0 checkpoints; SIGTERM stops all); replica checks
                    for reason in self.dp.to_act(self.step, (self.S.p, self.S.adam_m, self.S.adam_v)):
                        self._handle(reason)
                self.log.pump()
            self.save("final")
        except Terminate:
            self.log.emit({"event": "stopped", "step": self.step, "reason": "SIGTERM"})
            if self.rank == 0:
                self.log.say(f"stopped (SIGTERM) at step {self.step}, its checkpoint written; the same command with "
                             "--resume latest continues the run")  # fmt: skip
            self.outcome = "stopped"
            return 0
        except InputError as e:  # found only while training: a mixture source ran dry (microgpt/data/mixing.py)
            self.log.say(f"error: {e}")
            self.outcome = "failed"
            return 2
        except WriteError as e:  # no restart fixes it: the proxy does not retry this exit code
            self.log.say(f"error: {e}")
            self.outcome = "failed"
            return EXIT_WRITE
        finally:
            quiet_signals()
        self.log.emit({"event": "done", "step": self.step})
        self.outcome = "done"
        return 0

    def eval_windows(self) -> str:
        """Which validation windows val_loss scores: the first eval_batches x micro-batch (x ranks) of each source,
        the same at every evaluation. `microgpt eval --data` scores all of them by default, so its loss differs."""
        n = self.t.eval_batches * self.t.micro_batch * self.world
        sources = self.val_data.sources
        if len(sources) == 1:
            total = next(iter(sources.values())).n_windows
            return f"the first {min(n, total):,} of {total:,} val windows" + (" (wrapping)" if n > total else "")
        return f"the first {n:,} val windows of each of {len(sources)} sources"


def quiet_signals() -> None:
    """After the run: SIGUSR1 has nothing left to checkpoint (ignored); SIGTERM and Ctrl-C end the process at once,
    the last checkpoint being written already (the report card, if cut short, keeps its previous version)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


class _Clock:
    """The run's training time (a step record's elapsed_s: across resumes and under `run`, the time the dashboard
    shows) and the ETA of the rest: this process's mean time per step so far (evaluations and checkpoints included)
    times the steps left. A resumed process counts its rate from the step it resumed at."""

    def __init__(self, step: int, steps: int):
        self.t0, self.step0, self.steps = time.monotonic(), step, steps

    def __call__(self, step: int, elapsed_s: float) -> str:
        eta = (time.monotonic() - self.t0) / max(1, step - self.step0) * (self.steps - step)
        return f"{_hms(elapsed_s)} elapsed, ETA {_hms(eta)}"


def _hms(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _progress(rec: dict[str, Any], steps: int, clock: _Clock) -> str:
    """The terminal's progress line; the log's step record holds every field."""
    return (f"step {rec['step']:>6}/{steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
            f"norm {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s | "
            f"{clock(rec['step'], rec['elapsed_s'])}")  # fmt: skip


def _progress_eval(step: int, steps: int, ev: dict[str, Any], windows: str) -> str:
    """The evaluation on the terminal, under the step line it follows: the validation loss (a mixture adds each
    source's) and HellaSwag's accuracy, where each was scored."""
    per_source = [f"{name} {loss:.4f}" for name, loss in ev.get("source_val_loss", {}).items()]
    parts = [f"val_loss {ev['val_loss']:.4f}", *per_source, windows] if "val_loss" in ev else []
    parts += [hellaswag.progress(ev)] if "hellaswag" in ev else []
    return f"eval {step:>6}/{steps} | " + " | ".join(parts)


def _git_commit() -> str | None:
    """The checkout's commit; a worktree's .git is a file naming its git folder."""
    git = Path(__file__).resolve().parent.parent / ".git"
    try:
        if git.is_file():
            git = Path(git.read_text().strip().removeprefix("gitdir: "))
        ref = (git / "HEAD").read_text().strip()
        if not ref.startswith("ref: "):
            return ref
        if (git / ref[5:]).is_file():
            return (git / ref[5:]).read_text().strip()
        common = git / "commondir"  # a worktree's branches live in the main git folder
        base = git / common.read_text().strip() if common.is_file() else git
        return (base / ref[5:]).read_text().strip()
    except OSError:
        return None


def check_out_dir(out: Path) -> None:
    """--out can hold the run before anything is built or trained: a folder (made if missing) whose ckpt, if there,
    is a folder (or a link to one): a file or a dangling link there would fail the first checkpoint write only
    after training. ConfigError naming it otherwise."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create the output folder ({e.strerror})") from None
    ckpt = out / "ckpt"
    if (ckpt.exists() or ckpt.is_symlink()) and not ckpt.is_dir():
        what = "a link to nothing" if ckpt.is_symlink() else "not a folder"
        raise ConfigError(f"--out {out}: {ckpt} is {what}; checkpoints are written there (move it away)")
