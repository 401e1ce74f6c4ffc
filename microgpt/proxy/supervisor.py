"""The training proxy: `microgpt run EXPERIMENT.json`, a supervisor around `microgpt train`.

It spawns the engine as a child process and talks to it only through the child's JSON lines on stdout,
POSIX signals and the run's files (checkpoints under <out>/ckpt), so either side can be restarted alone.
It keeps <out>/<run>.loss.json, .samples.json and .state.json (runfiles.py), runs the experiment's
phases in order (phases.py), samples text from new checkpoints (sampler.py) and, with --dashboard,
serves the dashboard page (package data) and the run files on 127.0.0.1 (dashboard.py). The engine
child process itself is child.py.

Signals: SIGTERM or Ctrl-C -> the engine checkpoints and exits, the proxy records `stopped`, exit 0 (a
second one kills the engine at once). SIGUSR1 -> the engine checkpoints and keeps training. The engine
runs in its own session, so a terminal's Ctrl-C reaches only the proxy, which forwards it as SIGTERM.

Crash recovery: the engine dying before `done` (killed, OOM, NaN abort), printing no JSON line but heartbeats
for hang_timeout_s (startup_timeout_s before its first step), or not even a heartbeat (microgpt/events.py) for
silence_timeout_s (a stopped or frozen process, found in minutes even mid warm-up), is a failure: the engine is
killed if still there and restarted from the newest valid checkpoint, after backoff_s * 2**(k-1) seconds, at most
max_restarts times in a row without a new checkpoint; every restart is recorded in the state file and
marked in the loss history. A corrupt checkpoint is skipped for the one before (and kept on disk). Exit
code 2 from the engine (bad input: the engine checks its own job, --procs included, before any rank starts) and 4 (a
checkpoint it cannot write: a full disk) are failures a restart cannot fix: not retried, the run marked crashed,
and the proxy exits with the engine's code. Running the same command again continues a stopped or
crashed run from its newest checkpoint; a different experiment in the same folder is refused.
A folder `microgpt train` wrote (`make train`), or a run continued by it, is taken over from its newest
checkpoint (Supervisor.adopt).

One writer per run folder (microgpt/runlock.py): the proxy locks --out before it reads anything there and passes
the lock to each engine it starts, so a second `microgpt run` or a stray `microgpt train` on the folder is refused
(one line naming the proxy's pid, exit 2) while the engine works.

Exit codes: 0 done or stopped, 1 gave up (after restarts), 2 bad input (one line `error: ...`, the proxy's or the
engine's), 4 a file the disk refused (the engine's checkpoint, or the proxy's own run files). A run says one
`error:` line: the engine's are held until it exits (child.Engine.release) and become `engine: ...` lines when the
proxy ends with its own (its run file refused, the run folder moved away: each write checks the folder is still the
one it locked, runlock.RunLock.check); a fatal engine's error line comes last, after the proxy's `proxy: ...` line
saying it is not retried (each said once).
"""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from microgpt import checkpoint, config, runlock
from microgpt.config import ConfigError
from microgpt.errors import EXIT_INPUT, EXIT_WRITE, ArgParser, WriteError, check_number, exit_on_input_error
from microgpt.events import HEARTBEAT_ENV, HEARTBEAT_S
from microgpt.proxy.child import Engine, describe_exit
from microgpt.proxy.dashboard import DashboardServer
from microgpt.proxy.phases import Phase, Schedule, load_schedule
from microgpt.proxy.runfiles import (
    ENGINE_LOG,
    META_FIELDS,
    SAMPLES_FORMAT,
    STATE_FORMAT,
    JsonDoc,
    LossHistory,
    RunFileError,
    archive,
    replay_engine_log,
    run_paths,
    utc_now,
    write_run_file,
)
from microgpt.proxy.sampler import Sampler
from microgpt.runlock import pid_alive


def log(message: str) -> None:
    print(f"proxy: {message}", file=sys.stderr, flush=True)


@dataclass
class Outcome:
    kind: str  # "done" | "stopped" | "failed" | "fatal"
    reason: str = ""
    code: int = 1  # fatal: the engine's exit code, which the proxy exits with


class Supervisor:
    def __init__(
        self,
        schedule: Schedule,
        out: Path,
        experiment: str,
        procs: int | None = None,
        lock: runlock.RunLock | None = None,
        init: str | None = None,
        track: list[str] = (),
    ):
        self.schedule, self.out, self.settings, self.procs = schedule, out, schedule.settings, procs
        self.init = init  # --init: the weights the run's first engine starts from (when there is no checkpoint)
        self.track = list(track)  # --track: the trackers every engine feeds
        self.run_lock = lock  # the run folder's lock (microgpt/runlock.py), passed to every engine
        self.paths = run_paths(out, schedule.run)
        self.loss = LossHistory(self.paths["loss"], schedule.run)
        self.state = JsonDoc(self.paths["state"], STATE_FORMAT, self._fresh_state())
        self.samples = JsonDoc(self.paths["samples"], SAMPLES_FORMAT, self._fresh_samples())
        self._check_resumable()
        self.state.update(experiment=str(experiment), out=str(out), proxy_pid=os.getpid())
        self.lock = threading.Lock()
        self.engine_said_error = False  # the last engine's `error:` line went out (a fatal one is the run's)
        for doc in (self.loss, self.state, self.samples):
            doc.lock = lock  # each write: the folder is still the locked one, and is written by its descriptor
        self.stops = 0  # SIGTERM/SIGINT received
        self.usr1 = False
        self.failures = 0  # consecutive failures without a new checkpoint
        self.last_flush = self.write_s = 0.0
        self.adopt()

    def _fresh_state(self) -> dict[str, Any]:
        phases = [{"name": p.name, "start": p.start, "end": p.end} for p in self.schedule.phases]
        return {
            "run": self.schedule.run,
            "status": "starting",
            "phase": None,
            "phase_index": None,
            "phases": phases,
            "step": 0,
            "target_step": self.schedule.final_step,
            "checkpoint": None,
            "checkpoint_step": None,
            "engine_pid": None,
            "restarts": 0,
            "restart_log": [],
            "skipped_checkpoints": [],
            "config_hash": self.schedule.config_hash,
            "archived": [],
            "dashboard": None,
            "started": utc_now(),
        }

    def _fresh_samples(self) -> dict[str, Any]:
        s = self.settings
        cfg = {"every": s.sample_every, "prompts": s.prompts, "tokens": s.sample_tokens, "temperature": s.temperature}
        return {"run": self.schedule.run, "phase": None, "settings": cfg, "samples": []}

    def _check_resumable(self) -> None:
        """Refuse, before writing anything, a folder that holds another experiment or a live run."""
        st = self.state.data
        if st.get("config_hash") != self.schedule.config_hash:
            raise RunFileError(
                f"{self.paths['state']}: this folder holds a run of a different experiment "
                f"(config hash {st.get('config_hash')}, now {self.schedule.config_hash}); "
                "use another --out"
            )
        if st.get("status") in ("starting", "running", "stopping") and st.get("proxy_pid") != os.getpid():
            if pid_alive(st.get("proxy_pid")):
                raise RunFileError(f"{self.paths['state']}: a proxy (pid {st['proxy_pid']}) is running this run")
            if pid_alive(st.get("engine_pid")):
                raise RunFileError(
                    f"{self.paths['state']}: the engine of a dead proxy (pid {st['engine_pid']}) "
                    "is still running; wait for it or kill it"
                )

    def adopt(self) -> None:
        """Continue from checkpoints `microgpt train` wrote past the loss history: a folder `make train` made, or a
        run continued with `train --resume latest`. The history of those steps comes from the engine's JSON lines
        in <out>/train.jsonl (where `make train` keeps them), else from what the checkpoints' sidecars carry (the
        val loss at each checkpoint; no train rows). Only after a proxy that ended (or none): one that died mid-run
        may have written fewer rows than its engine's checkpoints, and resumes inside its history, with no gap.
        Changes only the files in memory: nothing is written here."""
        if self.paths["state"].exists() and self.state.data.get("status") not in ("done", "stopped", "crashed"):
            return
        newest = checkpoint.latest_valid_checkpoint(self.out / "ckpt", on_skip=self._skip_checkpoint)
        last = self.loss.covered_step
        if newest is None or checkpoint.step_of(newest) <= last:
            return
        step = checkpoint.step_of(newest)
        name = checkpoint.read_sidecar(newest).get("config", {}).get("name")
        if name != self.schedule.run:
            raise RunFileError(f"{newest}: a checkpoint of run {name!r}, not {self.schedule.run!r}; use another --out")
        replayed = replay_engine_log(self.out / ENGINE_LOG, self.schedule.run)
        rows: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}
        if replayed is not None:
            engine, read = replayed
            if (note := read.note(self.out / ENGINE_LOG)) is not None:
                log(note)  # said once; the history keeps every record that could be read
            rows = {key: [r for r in engine.data[key] if last < r["step"] <= step] for key in rows}
        if rows["train"]:
            source = str(self.out / ENGINE_LOG)
            self.loss.set_meta(engine.data["meta"])
        else:
            source = "checkpoint sidecars"
            rows = {"train": [], "val": self._sidecar_val_rows(last, step)}
        for key in ("train", "val"):
            for row in rows[key]:
                self.loss.add(key, {**row, "phase": self._phase_name(row["step"]), "time": row.get("time")})
        self.loss.mark("adopt", step, checkpoint=str(newest), history=source)
        log(f"continuing from {newest}, written by `microgpt train`; history of steps {last + 1}..{step} from {source}")

    def _sidecar_val_rows(self, after: int, upto: int) -> list[dict[str, Any]]:
        """The validation loss each checkpoint in (after, upto] recorded, one row per evaluated step."""
        rows: dict[int, dict[str, Any]] = {}
        for path in reversed(checkpoint.list_checkpoints(self.out / "ckpt")):
            side = checkpoint.read_sidecar(path)
            if "val_loss" in side and after < side.get("val_step", 0) <= upto:
                rows[side["val_step"]] = {"step": side["val_step"], "val_loss": side["val_loss"]}
        return [rows[k] for k in sorted(rows)]

    def _phase_name(self, step: int) -> str:
        """The phase that ran step `step` (1-based: the row of the step that ended at `step`)."""
        idx = self.schedule.phase_at(step - 1)
        return self.schedule.phases[-1 if idx is None else idx].name

    # --- files -------------------------------------------------------------------------------------------
    def flush(self, force: bool = True) -> None:
        """Write the loss history and state; unforced, at most every flush_s, and never more often than 10x
        the last write took: a 200K-step history is tens of MB, rewritten whole, and must stay cheap."""
        now = time.monotonic()
        if not force and now - self.last_flush < max(self.settings.flush_s, 10 * self.write_s):
            return
        self.loss.flush()  # the loss history first: the state never points past what it holds
        with self.lock:
            self.state.flush()
        self.last_flush = time.monotonic()
        self.write_s = self.last_flush - now

    def set_status(self, status: str, **fields: Any) -> None:
        self.state.update(status=status, **fields)
        self.flush()

    def enter_phase(self, idx: int) -> Phase:
        """Start phase idx; when it follows another phase, archive samples and state and start fresh ones."""
        ph = self.schedule.phases[idx]
        prev = self.state.data.get("phase")
        if prev != ph.name:
            if prev is not None:
                self.sampler.drain(self.settings.sample_timeout_s)
                with self.lock:
                    self.state.flush()
                    done = archive([self.paths["samples"], self.paths["state"]], prev, self.run_lock)
                    keep = {k: self.state.data.get(k) for k in ("experiment", "out", "proxy_pid", "dashboard")}
                    self.state.data = {"format": STATE_FORMAT, **self._fresh_state(), **keep, "archived": done}
                    self.samples.data = {"format": SAMPLES_FORMAT, **self._fresh_samples()}
                log(f"entering phase {ph.name!r}: archived {', '.join(done)}")
            self.loss.mark("phase", ph.start, phase=ph.name)
            with self.lock:
                self.samples.update(phase=ph.name)
                self.samples.flush()
        self.state.update(phase=ph.name, phase_index=idx, status="running")
        write_run_file(self.out / "phases" / f"{ph.name}.json", ph.engine, self.run_lock)
        return ph

    def pick_checkpoint(self) -> tuple[Path | None, int]:
        """The newest valid checkpoint the loss history covers (so a resume leaves no gap); corrupt ones skipped."""
        path = checkpoint.latest_valid_checkpoint(
            self.out / "ckpt", max_step=self.loss.covered_step, on_skip=self._skip_checkpoint
        )
        return (path, checkpoint.step_of(path)) if path is not None else (None, 0)

    def _skip_checkpoint(self, path: Path, reason: str) -> None:
        skipped = self.state.data["skipped_checkpoints"]
        if all(s.get("path") != str(path) for s in skipped):
            skipped.append({"path": str(path), "reason": reason, "time": utc_now()})
            log(f"skipping corrupt checkpoint (kept on disk): {reason}")

    # --- the run -----------------------------------------------------------------------------------------
    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        resumed = self.state.data.get("phase") is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGUSR1, self._on_usr1)
        self.sampler = Sampler(self.samples, self.settings, self.lock, log)
        try:
            return self._loop(resumed)
        except (WriteError, runlock.LockError):
            raise  # a run file cannot be written, the status included: main says so in one line
        except BaseException as e:
            self._crashed(f"proxy: {type(e).__name__}: {e}")
            raise
        finally:
            self.sampler.close()

    def _loop(self, resumed: bool) -> int:
        picked = None  # after a failure: the pick made to judge progress, valid while no engine runs
        while True:
            ckpt, step = picked if picked is not None else self.pick_checkpoint()
            picked = None
            idx = self.schedule.phase_at(step)
            if resumed and idx is not None:
                self.loss.mark("resume", self.loss.last_step, status=self.state.data.get("status"))
            resumed = False
            if idx is None:
                self.sampler.drain(self.settings.sample_timeout_s)
                log(f"done: step {step}, checkpoint {ckpt}")
                self.set_status("done", engine_pid=None, step=step, ended=utc_now())
                return 0
            if self.stops:
                return self._stopped()
            ph = self.enter_phase(idx)
            outcome = self.run_engine(ph, ckpt, step)
            if outcome.kind == "done":
                continue  # the next pass picks the final checkpoint and moves to the next phase (or ends)
            if outcome.kind == "stopped":
                return self._stopped()
            if outcome.kind == "fatal":  # run_engine said so, before the engine's error line
                try:
                    self._crashed(outcome.reason)
                except (WriteError, runlock.LockError) as e:  # the same full disk, or the folder moved away
                    if not self.engine_said_error:
                        raise
                    log(f"the run's state not recorded: {e}")  # the engine's error line was the run's one
                return outcome.code
            picked = self.pick_checkpoint()
            self.failures = 1 if picked[0] != ckpt else self.failures + 1
            if self.failures > self.settings.max_restarts:
                log(f"giving up after {self.failures - 1} restarts without progress: {outcome.reason}")
                self._crashed(outcome.reason)
                return 1
            if not self._restart_after(outcome.reason):
                return self._stopped()

    def _crashed(self, reason: str) -> None:
        self.set_status("crashed", engine_pid=None, last_error=reason, ended=utc_now())

    def _stopped(self) -> int:
        self.loss.mark("stop", self.loss.last_step)
        self.set_status("stopped", engine_pid=None, ended=utc_now())
        log(f"stopped at step {self.loss.last_step}; run the same command again to continue")
        return 0

    def _restart_after(self, reason: str) -> bool:
        """Record the failure, wait the backoff; False when a stop request arrives meanwhile."""
        wait = min(self.settings.backoff_s * 2 ** (self.failures - 1), self.settings.backoff_max_s)
        st = self.state.data
        st["restarts"] += 1
        st["restart_log"].append(
            {
                "time": utc_now(),
                "step": self.loss.last_step,
                "reason": reason,
                "attempt": self.failures,
                "backoff_s": wait,
            }
        )
        self.loss.mark("restart", self.loss.last_step, reason=reason, attempt=self.failures)
        self.set_status("running", engine_pid=None, last_error=reason)
        log(f"engine failed ({reason}); restart {self.failures}/{self.settings.max_restarts} in {wait:g} s")
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.stops:
                return False
            time.sleep(min(0.05, wait))
        return not self.stops

    def engine_cmd(self, ph: Phase, ckpt: Path | None) -> list[str]:
        """`microgpt train` of the phase, its records as JSON lines on stdout (--json: what watch() reads)."""
        cmd = [
            sys.executable,
            "-m",
            "microgpt.cli",
            "train",
            str(self.out / "phases" / f"{ph.name}.json"),
            "--out",
            str(self.out),
            "--json",
        ]
        cmd += ["--resume", str(ckpt)] if ckpt else ["--init", self.init] if self.init else []
        cmd += [flag for name in self.track for flag in ("--track", name)]
        return cmd + (["--procs", str(self.procs)] if self.procs else [])

    def run_engine(self, ph: Phase, ckpt: Path | None, step: int) -> Outcome:
        log(f"phase {ph.name!r}: engine from step {step} to {ph.end}" + (f", resuming {ckpt}" if ckpt else ""))
        held = self.run_lock
        env = {**(held.child_env() if held else {}), HEARTBEAT_ENV: f"{self.heartbeat_s():g}"}
        try:
            eng = Engine(self.engine_cmd(ph, ckpt), env, (held.fd,) if held else ())
        except OSError as e:
            return Outcome("failed", f"cannot start the engine: {e}")
        writable, outcome = True, None
        try:
            self.state.update(engine_pid=eng.proc.pid, status="running")
            self.flush()
            outcome = self.watch(eng, ph)
            return outcome
        except (WriteError, runlock.LockError):  # a full disk, or the run folder moved away
            writable = False
            eng.signal(signal.SIGTERM)  # the engine checkpoints what it can (a full disk: its exit 4) and stops
            eng.wait(self.settings.hang_timeout_s)
            raise
        finally:
            eng.signal(signal.SIGKILL)  # the whole group: whatever of this engine is left, before the next one
            eng.wait()
            if outcome is not None and outcome.kind == "fatal":  # said before the engine's error line: it is the last
                why = describe_exit(outcome.code) if eng.held else outcome.reason  # its error line says the rest
                log(f"engine failed in a way a restart cannot fix, not retrying ({why})")
            self.engine_said_error = eng.release(demote=not writable)  # demoted: ours is the run's error line
            self.state.update(engine_pid=None)
            if writable:
                self.flush()

    def heartbeat_s(self) -> float:
        """The engine's heartbeat interval: a tenth of the silence limit, at most events.HEARTBEAT_S."""
        return min(HEARTBEAT_S, self.settings.silence_timeout_s / 10)

    def hung(self, now: float, last_line: float, last_heard: float, first_step: bool) -> str | None:
        """Why the engine counts as hung (then it is killed and restarted), or None: no line at all for
        silence_timeout_s (stopped, frozen), or no line but heartbeats for the progress limit (a deadlock whose
        heartbeat thread still runs): startup_timeout_s before the first step, hang_timeout_s after it."""
        s = self.settings
        if now - last_heard > s.silence_timeout_s:
            return f"silent: not even a heartbeat for {s.silence_timeout_s:g} s (stopped or frozen)"
        limit = s.hang_timeout_s if first_step else s.startup_timeout_s
        return f"hung: no output for {limit:g} s" if now - last_line > limit else None

    def watch(self, eng: Engine, ph: Phase) -> Outcome:
        """Read the engine's lines until it exits or hangs; forward signals; keep the files current."""
        s, seen = self.settings, {"step": False, "done": False}
        last_line = last_heard = time.monotonic()
        term_sent, killed = None, False
        while True:
            now = time.monotonic()
            if self.stops and term_sent is None:
                eng.signal(signal.SIGTERM)
                term_sent = now
                self.set_status("stopping")
            if term_sent is not None and not killed and (self.stops > 1 or now - term_sent > s.stop_timeout_s):
                eng.signal(signal.SIGKILL)  # a second Ctrl-C, or no checkpoint in stop_timeout_s
                killed = True
            if self.usr1 and seen["step"]:  # before its first step the engine may not handle SIGUSR1 yet
                self.usr1 = False
                eng.signal(signal.SIGUSR1)
            try:
                raw = eng.lines.get(timeout=0.05)
            except queue.Empty:
                why = self.hung(now, last_line, last_heard, seen["step"]) if term_sent is None else None
                if why is not None:
                    eng.signal(signal.SIGKILL)
                    return Outcome("failed", why)
                if eng.proc.poll() is not None:  # it exited, but a child of it (a data-parallel rank) holds stdout
                    eng.signal(signal.SIGKILL)
                self.flush(force=False)
                continue
            if raw is None:
                break
            last_heard = time.monotonic()
            if self.on_line(raw, ph, seen) != "heartbeat":
                last_line = last_heard
        rc = eng.wait()
        self.flush()
        if self.stops:
            return Outcome("stopped")
        if seen["done"] and rc == 0:
            return Outcome("done")
        tail = eng.tail[-1] if eng.tail else ""
        reason = f"engine {describe_exit(rc)}" + (f": {tail}" if tail else "")
        if rc in (EXIT_INPUT, EXIT_WRITE):
            return Outcome("fatal", reason, rc)
        return Outcome("failed", reason)

    def on_line(self, raw: bytes, ph: Phase, seen: dict[str, bool]) -> str | None:
        """Act on one line of the engine's stdout; its event kind (None: not an event, passed to stderr)."""
        try:
            ev = json.loads(raw)
            kind = ev["event"]
        except (ValueError, TypeError, KeyError, RecursionError):
            print(f"engine: {raw.decode(errors='replace').rstrip()}", file=sys.stderr, flush=True)
            return None
        stamp = ev.get("time") if isinstance(ev, dict) else None  # the engine stamps each record (runlog.py)
        now = stamp if isinstance(stamp, float) and math.isfinite(stamp) else time.time()  # the history keeps it
        if kind == "start":
            dropped = self.loss.truncate_after(ev["step"])
            if dropped:
                log(f"engine resumes at step {ev['step']}: {dropped} later history rows will be written again")
            meta = {k: ev.get(k) for k in META_FIELDS}
            self.loss.set_meta(meta)
            self.state.update(step=ev["step"], engine=meta)
            self.flush()
        elif kind == "step":
            row = {k: v for k, v in ev.items() if k != "event"}
            self.loss.add("train", {**row, "phase": ph.name, "time": now})
            self.state.update(step=ev["step"], **{k: ev[k] for k in ("mixture",) if k in ev})  # current weights
            seen["step"] = True
            self.flush(force=False)
        elif kind == "eval":
            self.loss.add("val", {**{k: v for k, v in ev.items() if k != "event"}, "phase": ph.name, "time": now})
            self.flush(force=False)
        elif kind == "checkpoint":
            self.state.update(checkpoint=ev["path"], checkpoint_step=ev["step"])
            self.flush()
            if ev.get("reason") != "periodic":
                log(f"checkpoint at step {ev['step']} ({ev.get('reason')}): {ev['path']}")
            self.sampler.request(ev["step"], ph.name, ev["path"], ev.get("reason", ""))
        elif kind == "done":
            seen["done"] = True
        elif kind == "sample":  # an engine that samples by itself: recorded like ours
            with self.lock:
                self.samples.data["samples"].append({**ev, "phase": ph.name, "time": now})
                self.samples.flush()
        return kind

    def _on_stop(self, signum: int, frame: Any) -> None:
        self.stops += 1

    def _on_usr1(self, signum: int, frame: Any) -> None:
        self.usr1 = True


def run_parser() -> ArgParser:
    p = ArgParser(prog="microgpt run", description="Train under the proxy: restarts, phases, dashboard.")
    config.add_experiment_flags(p)  # the flags `microgpt train` takes too; --procs is passed on to the engine
    p.add_argument(
        "--dashboard",
        type=int,
        nargs="?",
        const=8765,
        metavar="PORT",
        help="serve the live dashboard on 127.0.0.1:PORT (default 8765; 0: any free port)",
    )
    p.add_argument("--hang-timeout", type=float, help="override proxy.hang_timeout_s")
    p.add_argument("--max-restarts", type=int, help="override proxy.max_restarts")
    return p


def preflight(engine: dict[str, Any], procs: int) -> None:
    """The engine's own check of one phase's job as `procs` ranks (`microgpt train --check`: the machine's ranks and
    memory), before anything is written; its `error:` line is the proxy's one line (ConfigError). The proxy builds no
    plan itself: the engine's command line is its whole interface."""
    with tempfile.TemporaryDirectory(prefix="microgpt-preflight-") as tmp:
        phase = Path(tmp) / "phase.json"
        phase.write_text(json.dumps(engine))
        cmd = [sys.executable, "-m", "microgpt.cli", "train", str(phase), "--procs", str(procs), "--check"]
        res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        lines = res.stderr.strip().splitlines()
        raise ConfigError(
            lines[-1].removeprefix("error: ")
            if lines
            else f"--procs {procs}: the engine's check ended with exit code {res.returncode}"
        )


def main(argv: list[str] | None = None) -> int:
    """`microgpt run`: bad input (flags, experiment, run files, port) is one `error:` line and exit 2; a run file
    the disk refuses (full, read-only) is one `error:` line and exit 4, the engine stopped first."""
    return exit_on_input_error(supervise, sys.argv[1:] if argv is None else argv)


def supervise(argv: list[str]) -> int:
    """Check every input before anything is written or spawned, then run."""
    args = run_parser().parse_args(argv)
    config.check_flags(args)
    schedule = load_schedule(args.experiment, sets=config.experiment_sets(args), **config.train_flags(args))
    if args.hang_timeout is not None:
        check_number(args.hang_timeout, "--hang-timeout", 0, lo_open=True, error=ConfigError)
        schedule.settings.hang_timeout_s = args.hang_timeout
    if args.max_restarts is not None:
        check_number(args.max_restarts, "--max-restarts", 0, config.INT_MAX, integer=True, error=ConfigError)
        schedule.settings.max_restarts = args.max_restarts
    for ph in schedule.phases if (args.procs or 1) > 1 else []:  # one line now, not one per rank later
        preflight(ph.engine, args.procs)
    if args.init and Path(args.init).exists():  # a pipe or device: refused before the run folder is made
        checkpoint.check_flag_path(args.init, "--init", folder=True)
    out = Path(args.out or Path("runs") / schedule.run)
    # The port is bound first: one in use is bad input, refused before the run folder is created or locked.
    server = DashboardServer(out, schedule.run, args.dashboard) if args.dashboard is not None else None
    try:
        with runlock.acquire(out) as lock:
            sup = Supervisor(schedule, out, args.experiment, args.procs, lock, args.init, args.track)
            if server is not None:
                sup.state.update(dashboard=server.url)
                server.start()
                log(f"dashboard: {server.url}")
            return sup.run()
    finally:
        if server is not None:
            server.linger()  # an open page reads the run's final state before the server goes
            server.close()


if __name__ == "__main__":
    sys.exit(main())
