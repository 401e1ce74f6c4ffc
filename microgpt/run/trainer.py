"""The run: optimizer steps (engine/step.py) over a TrainState (engine/state.py), and the records the world reads
(microgpt/runlog.py: the run folder's train.jsonl, the terminal's human lines, stdout's JSON lines when asked).

The loop's helpers each have a module of their own in run/: evaluation.py (val loss, HellaSwag), checkpoints.py
(save, resume, --init), signals.py (SIGTERM, SIGUSR1 and the critical section) and progress.py (the terminal's lines
and the ETA); the lr schedule is the optimizer's (engine/optim.py: lr_at, schedule_end).

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
import time
from pathlib import Path
from typing import Any

import numpy as np

import microgpt
from microgpt import config, data
from microgpt.config import Experiment
from microgpt.engine import memory, params
from microgpt.engine.backend import Backend, get_backend
from microgpt.engine.optim import lr_at, schedule_end
from microgpt.engine.state import make_state
from microgpt.engine.step import Step
from microgpt.engine.trained import Trained
from microgpt.errors import EXIT_WRITE, InputError, WriteError
from microgpt.run import checkpoints, progress, report
from microgpt.run.evaluation import Evaluation
from microgpt.run.signals import Signals, Terminate, quiet_signals
from microgpt.runlog import RunLog


class Trainer:
    def __init__(
        self,
        exp: Experiment,
        out: Path,
        tokenizer_info: dict[str, Any] | None = None,
        K: Backend | None = None,
        dp: Any = None,
        log: RunLog | None = None,
    ):
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
        self.micro = data.MicroSchedule.of(t)  # the micro-batches each step reads (a batch warmup's fewer first)
        self.data_info = data.data_description(self.exp)  # for every checkpoint's sidecar: the data do not change
        self.tokenizer_info = tokenizer_info or {}
        self.step_fn = Step(self.S, dp)
        self.evals = Evaluation(self.S, self.exp, self.val_data, dp, self.rank, self.world)
        self.signals = Signals(self._act, deferred=dp is not None)
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
        batches = [self.train_data.batch(step, micro) for micro in range(self.micro.count(step))]
        self.last_targets = [y for _, y in batches]  # the report card's bytes per token of the final train loss
        self.signals.critical = True
        res = self.step_fn(batches, lr)
        mix = self._end_mixture(step, res.micro_losses)  # with the step, so a checkpoint never sees half of it
        dt = time.perf_counter() - t0
        tokens = len(batches) * t.micro_batch * self.m.seq_len * self.world  # the tokens this step read
        return {
            "event": "step",
            "step": self.step,
            "loss": res.loss,
            "lr": lr,
            "grad_norm": res.grad_norm,
            "tokens_per_s": tokens / dt,
            "dt_ms": 1000 * dt,
            "tokens": tokens,
            **mix,
        }

    def _end_mixture(self, step: int, micro_losses: list[float]) -> dict[str, Any]:
        """FIREHOSE (microgpt/data/mixing.py): the step's per-source losses update the mixture; its record fields."""
        return self.train_data.end_step(step, micro_losses, self.dp)

    def evaluate(self) -> dict[str, Any]:
        """The validation loss now (evaluation.py)."""
        return self.evals.evaluate()

    def eval_windows(self) -> str:
        """Which validation windows val_loss scores (evaluation.py)."""
        return self.evals.windows()

    # --- checkpoints (checkpoints.py) and signals (signals.py) -----------------------------------------
    def load(self, path: str | Path) -> None:
        checkpoints.load(self, path)

    def init_from(self, ld: Trained) -> None:
        checkpoints.init_from(self, ld)

    def save(self, reason: str) -> Path | None:
        return checkpoints.save(self, reason)

    def elapsed(self) -> float:
        """Training seconds of the run up to now: this process's (from its first step) plus its checkpoint's."""
        return self.elapsed0 + (time.monotonic() - self.t0 if self.t0 is not None else 0.0)

    def _act(self, reason: str) -> None:
        """A signal's action: the checkpoint now; SIGTERM then stops the run."""
        self.save(reason)
        if reason == "SIGTERM":
            raise Terminate

    # --- the run --------------------------------------------------------------------------------------
    def start_record(self) -> dict[str, Any]:
        versions = {
            "microgpt": microgpt.__version__,
            "python": platform.python_version(),
            "numpy": np.__version__,
            **self.K.versions,
        }
        m, t = self.m, self.t
        return {
            "event": "start",
            "run": self.exp.name,
            "config": self.exp.to_dict(),
            "n_params": self.S.n_params,
            "memory": memory.role_bytes(self.S.plan, self.K.precision),
            "versions": versions,
            "device": self.K.device,
            "step": self.step,
            "git": git_commit(),
            "world_size": self.world,
            "recipe": self.recipe,
            "init": self.init or None,
            "schedule_end": schedule_end(t),
            "pid": os.getpid(),
            "flops_per_token": params.flops_per_token(m),
            "peak_flops": report.peak_flops(self.K.device, self.K.precision.compute),
            "memory_measure": self.K.peak_memory_name or report.RSS_NAME,
        }

    def memory_peak(self) -> int:
        """The backend's measured peak (a GPU's allocator), or on the CPU this process's peak resident memory."""
        peak = self.K.peak_memory()
        return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def run(self) -> int:
        t = self.t
        self.signals.install()  # before the start record: a supervisor may signal as soon as it reads it
        try:
            self.log.emit(self.start_record())
            if self.evals.hellaswag is not None and self.rank == 0:
                self.log.say(self.evals.hellaswag.describe())
            clock = progress.Clock(self.step, t.steps)
            self.t0 = time.monotonic()
            while self.step < t.steps:
                rec = self.train_step()
                rec.update(elapsed_s=round(self.elapsed(), 3), memory_peak=self.memory_peak())
                if self.dp is not None:  # the mean loss over ranks; the signals every rank acts on below
                    rec["loss"] = self.dp.agree(rec["loss"], self.signals.take_pending())
                if not math.isfinite(rec["loss"]):
                    self.log.say(f"error: loss is {rec['loss']} at step {self.step}; stopping")
                    self.outcome = "failed"
                    return 3
                if self.step % t.log_every == 0 or self.step == t.steps:
                    self.log.emit(rec)
                    if self.rank == 0:
                        self.log.say(progress.step_line(rec, t.steps, clock))
                self.signals.leave_critical()  # a signal that came during the step is handled now
                ev = self.evals.due(self.step)
                if ev:
                    self.log.emit({"event": "eval", "step": self.step, **ev})
                    if self.rank == 0:
                        self.log.say(progress.eval_line(self.step, t.steps, ev, self.evals.windows()))
                if self.step % t.ckpt_every == 0 and self.step < t.steps:
                    self.save("periodic")
                    self.signals.leave_critical()  # a signal during the write is handled now, not a step later
                if self.dp is not None:  # agreed signals (rank 0 checkpoints; SIGTERM stops all); replica checks
                    for reason in self.dp.to_act(self.step, (self.S.p, self.S.adam_m, self.S.adam_v)):
                        self._act(reason)
                self.log.pump()
            self.save("final")
        except Terminate:
            self.log.emit({"event": "stopped", "step": self.step, "reason": "SIGTERM"})
            if self.rank == 0:
                self.log.say(
                    f"stopped (SIGTERM) at step {self.step}, its checkpoint written; the same command with "
                    "--resume latest continues the run"
                )
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


PACKAGE = Path(microgpt.__file__).resolve().parent  # the code that trains: microgpt/ of a checkout, or of site-packages
INSTALLED = ("site-packages", "dist-packages")  # where pip puts a package: a copy, not a checkout's code


def git_commit(package: Path = PACKAGE) -> str | None:
    """The commit of the code that trains: HEAD of the git checkout that holds the package (a clone run in place, or
    installed with `pip install -e`), read from the git folder (no git program needed): a plain clone, a linked
    worktree or a submodule (their .git is a file naming the git folder), a branch in packed-refs, a detached HEAD.
    None (the report card says "unknown") for a package installed into site-packages, whose code is its version and
    not the commit of a repository above it (a project that holds the virtual environment), or outside any checkout."""
    for folder in (package, *package.parents):
        if folder.name in INSTALLED:
            return None
        if (folder / ".git").exists():
            return _head_commit(folder / ".git")
    return None


def _head_commit(dot_git: Path) -> str | None:
    """The commit HEAD names in the repository whose work tree holds dot_git; None where it names none (a branch with
    no commit yet) or the folder cannot be read."""
    try:
        git = dot_git
        if dot_git.is_file():  # "gitdir: PATH", PATH relative to the .git file's folder unless absolute
            text = dot_git.read_text().strip()
            if not text.startswith("gitdir:"):
                return None
            git = dot_git.parent / text.removeprefix("gitdir:").strip()
        common = git / "commondir"  # a linked worktree's branches live in the main git folder
        base = git / common.read_text().strip() if common.is_file() else git
        head = (git / "HEAD").read_text().strip()
        for _ in range(5):  # a symbolic ref may name another
            if not head.startswith("ref:"):
                return head if _is_commit_id(head) else None
            ref = head.removeprefix("ref:").strip()
            loose = [folder / ref for folder in (git, base) if (folder / ref).is_file()]
            head = loose[0].read_text().strip() if loose else _packed_ref(base / "packed-refs", ref)
        return None
    except (OSError, UnicodeDecodeError):
        return None


def _packed_ref(packed: Path, ref: str) -> str:
    """ref's commit in a packed-refs file ("<id> <ref>" lines; "#" and "^" lines are a header and peeled tags)."""
    if packed.is_file():
        for line in packed.read_text().splitlines():
            commit, _, name = line.partition(" ")
            if name == ref and not line.startswith(("#", "^")):
                return commit
    return ""


def _is_commit_id(text: str) -> bool:
    """A full object id: 40 hex digits (SHA-1), or 64 (a SHA-256 repository)."""
    return len(text) in (40, 64) and all(c in "0123456789abcdef" for c in text)
