"""The training proxy's run files: `<run>.loss.json`, `<run>.samples.json`, `<run>.state.json`.

All three are plain JSON objects rewritten whole with an atomic write (temp file in the same folder,
fsync, rename), so a reader (the dashboard, a person with `jq`) never sees half a file and a crash
leaves the previous complete version.

    <run>.loss.json      {"format": "microgpt-loss-1", "run", "meta", "train": [row...], "val": [row...],
                          "marks": [mark...]}
        train row        {"step", "loss", "lr", "grad_norm", "tokens_per_s", "dt_ms", "tokens", "phase",
                          "time"} plus any other field the engine's step event carries (forward-compatible)
        val row          {"step", "val_loss", "phase", "time"} plus any other field of the eval event (HellaSwag's;
                         an evaluation that scored only HellaSwag has no val_loss)
        mark             {"kind": "phase"|"restart"|"resume"|"stop"|"adopt", "step", "time", ...}: the dashboard's
                          vertical lines; marks are history and are never removed
    The loss history is never archived. It holds each step exactly once: when the engine (re)starts from
    step k, rows after k are dropped first, and the resumed engine writes them again (bit-exact resume
    makes them equal), so a restart leaves no gap and no duplicate.
    A folder `microgpt train` wrote (checkpoints past the history) is adopted: the rows of those steps come
    from the engine's own log <out>/train.jsonl (ENGINE_LOG, microgpt/runlog.py: the same rows, times included;
    a log of an older version has none, "time": null), else only the val rows the checkpoints' sidecars carry;
    an "adopt" mark records which.

    <run>.samples.json   {"format": "microgpt-samples-1", "run", "phase", "settings", "samples": [...]}
    <run>.state.json     {"format": "microgpt-proxy-state-1", "run", "status", "phase", "step", ...}; a run
                         with a data mixture also shows its current weights there ("mixture", per source)

On entering a new phase the samples and state files are archived (timestamped copies under archive/)
and fresh ones start; see archive().
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from microgpt.config import INT_MAX
from microgpt.errors import InputError, WriteError, brief
from microgpt.fileio import atomic_write_bytes, atomic_write_json, finite
from microgpt.fileio import read_json as read_json_file
from microgpt.runlock import PID_MAX, RunLock
from microgpt.runlog import LOG_NAME, Log, load_log

LOSS_FORMAT = "microgpt-loss-1"
SAMPLES_FORMAT = "microgpt-samples-1"
STATE_FORMAT = "microgpt-proxy-state-1"
ENGINE_LOG = LOG_NAME  # the engine's own log in the run folder (microgpt/runlog.py)
# the fields of the engine's start line kept as the history's "meta"
META_FIELDS = (
    "n_params",
    "device",
    "memory",
    "versions",
    "git",
    "config",
    "world_size",
    "flops_per_token",
    "peak_flops",
    "memory_measure",
)


class RunFileError(InputError):
    """An existing run file that cannot be read; the proxy stops rather than overwrite it."""


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


NULL = type(None)
NUMBER = (int, float, NULL)  # a number, or null (a diverged loss)
# The fields each run file's readers use, and their JSON types; other fields are kept as they are.
FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    LOSS_FORMAT: {"run": (str,), "meta": (dict,), "train": (list,), "val": (list,), "marks": (list,)},
    STATE_FORMAT: {"run": (str,), "status": (str,), "phase": (str, NULL), "phase_index": (int, NULL),
                   "step": (int,), "restarts": (int,), "restart_log": (list,), "skipped_checkpoints": (list,),
                   "archived": (list,), "experiment": (str, NULL), "out": (str, NULL), "engine_pid": (int, NULL),
                   "proxy_pid": (int, NULL)},
    SAMPLES_FORMAT: {"run": (str,), "phase": (str, NULL), "settings": (dict,), "samples": (list,)},
}  # fmt: skip
ROWS = {LOSS_FORMAT: ("train", "val", "marks"), STATE_FORMAT: ("restart_log", "skipped_checkpoints"),
        SAMPLES_FORMAT: ("samples",)}  # fmt: skip
# Each row list's fields the proxy and the dashboard read, and their types; "step" is checked for every row
# (required in the loss history's rows), "kind" is required in a mark.
ROW_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "train": {"loss": NUMBER, "lr": NUMBER, "grad_norm": NUMBER, "tokens_per_s": NUMBER, "dt_ms": NUMBER,
              "tokens": NUMBER, "time": NUMBER, "phase": (str, NULL), "mixture": (dict, NULL)},
    "val": {"val_loss": NUMBER, "time": NUMBER, "phase": (str, NULL)},
    "marks": {"kind": (str,), "time": NUMBER},
    "skipped_checkpoints": {"path": (str,), "reason": (str,)},
}  # fmt: skip
STEPPED = ("train", "val", "marks")


def _types(types: tuple[type, ...]) -> str:
    """A field's JSON types for a message: 'str or null', 'a number or null' (an int is a number)."""
    shown = [t for t in types if not (t is int and float in types)]
    return " or ".join({NULL: "null", float: "a number"}.get(t, t.__name__) for t in shown)


def row_problem(row: Any, key: str) -> str | None:
    """What is wrong with one row of the row list `key` (ROW_FIELDS), or None: checked before any reader uses it."""
    if not isinstance(row, dict):
        return f"must be an object, got {brief(row)}"
    if "step" not in row and key in STEPPED:
        return "has no step"
    step = row.get("step", 0)
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= INT_MAX:
        return f"field 'step' must be an integer in [0, {INT_MAX}], got {brief(step)}"
    fields = ROW_FIELDS.get(key, {})
    if key == "marks" and "kind" not in row:
        return "has no field 'kind'"
    for name, types in fields.items():
        if name in row and (not isinstance(row[name], types) or isinstance(row[name], bool)):
            return f"field '{name}' must be {_types(types)}, got {brief(row[name])}"
    return None


def read_json(path: Path, fmt: str) -> dict[str, Any] | None:
    """The file's object, None when it does not exist; RunFileError when it exists but is not a `fmt` file whose
    fields (FIELDS), pids and rows (row_problem) have the types and ranges the proxy relies on."""
    try:
        obj = read_json_file(path, "run file", RunFileError, allow_nan=False)
    except FileNotFoundError:
        return None
    except RunFileError as e:
        raise RunFileError(f"{e}; move it away to start over") from None
    if not isinstance(obj, dict) or obj.get("format") != fmt:
        found = brief(obj.get("format")) if isinstance(obj, dict) else f"a JSON {type(obj).__name__}"
        raise RunFileError(f"{path}: not a {fmt} file (format {found}); move it away to start over")
    for name, types in FIELDS[fmt].items():
        if name in obj and (not isinstance(obj[name], types) or isinstance(obj[name], bool)):
            raise RunFileError(
                f"{path}: field '{name}' must be {_types(types)}, got {brief(obj[name])}; move it away to start over"
            )
    for name in ("engine_pid", "proxy_pid"):
        if obj.get(name) is not None and not 0 < obj[name] <= PID_MAX:
            raise RunFileError(
                f"{path}: field '{name}' must be a process id in [1, {PID_MAX}], got "
                f"{brief(obj[name])}; move it away to start over"
            )
    for name in ROWS[fmt]:
        for i, row in enumerate(obj.get(name, [])):
            if (problem := row_problem(row, name)) is not None:
                raise RunFileError(f"{path}: field '{name}' row {i} {problem}; move it away to start over")
    return obj


def run_paths(out: Path, run: str) -> dict[str, Path]:
    return {kind: out / f"{run}.{kind}.json" for kind in ("loss", "samples", "state")}


class LossHistory:
    """The whole training history of a run, one row per step, across restarts and phases."""

    def __init__(self, path: Path | None, run: str):
        """The history in `path`, or a new one (path None: in memory only, see replay_engine_log)."""
        self.path, self.dirty = path, False
        self.lock: RunLock | None = None  # the run folder's lock: checked before each write, written through
        fresh = {"format": LOSS_FORMAT, "run": run, "meta": {}, "train": [], "val": [], "marks": []}
        self.data = {**fresh, **((read_json(path, LOSS_FORMAT) if path is not None else None) or {})}

    @property
    def last_step(self) -> int:
        train = self.data["train"]
        return train[-1]["step"] if train else 0

    @property
    def covered_step(self) -> int:
        """The last step the history accounts for: its last train row, or a later checkpoint it adopted."""
        return max([self.last_step] + [m["step"] for m in self.data["marks"] if m["kind"] == "adopt"])

    def truncate_after(self, step: int, keys: tuple[str, ...] = ("train", "val")) -> int:
        """Drop rows after `step` (the engine is about to write them again); return how many."""
        dropped = 0
        for key in keys:
            rows = self.data[key]
            keep = len(rows)
            while keep and rows[keep - 1]["step"] > step:
                keep -= 1
            dropped += len(rows) - keep
            del rows[keep:]
        self.dirty = self.dirty or dropped > 0
        return dropped

    def add(self, key: str, row: dict[str, Any]) -> None:
        """Append a train or val row; a row at or before the last step of its kind replaces the rows from there."""
        self.truncate_after(row["step"] - 1, (key,))
        self.data[key].append(finite(row))
        self.dirty = True

    def mark(self, kind: str, step: int, **info: Any) -> None:
        self.data["marks"].append({"kind": kind, "step": step, "time": time.time(), **info})
        self.dirty = True

    def set_meta(self, meta: dict[str, Any]) -> None:
        self.data["meta"] = meta
        self.dirty = True

    def flush(self) -> None:
        if self.dirty:
            write_run_file(self.path, self.data, self.lock)
            self.dirty = False


def write_run_file(path: Path | None, data: dict[str, Any], lock: RunLock | None = None) -> None:
    """One run file rewritten whole (atomically: the previous version stays until the new one is complete). A write
    the disk refuses (full, read-only) is a WriteError naming the file: no restart of the engine fixes it. With
    lock (the run folder's, runlock.RunLock), written only while the run folder is the one the proxy locked
    (LockError), and into that folder by its descriptor (RunLock.anchor) wherever its path leads meanwhile."""
    if path is None:
        return
    if lock is not None:
        lock.check()
    try:
        anchor = lock.anchor if lock is not None else None  # a folder below it (phases/) is made there, never anew
        atomic_write_json(path, data, compact=True, sync_dir=False, anchor=anchor)
    except OSError as e:
        if lock is not None:
            lock.check()  # the folder moved away during the write: that, not the OS's word for it, is what happened
        raise WriteError(
            f"{path}: cannot write the run file ({e.strerror or e}); its previous version is intact, "
            "the engine was stopped"
        ) from None


def replay_engine_log(path: Path, run: str) -> tuple[LossHistory, Log] | None:
    """The history the engine's log at `path` (ENGINE_LOG) tells (replay_log), and the log as read (its note says
    what was passed over); None: no such file. A log that cannot be read at all (a named pipe, a folder) is a
    RunFileError naming it."""
    if not os.path.lexists(path):
        return None
    try:
        log = load_log(path)
    except InputError as e:
        raise RunFileError(f"{e}; move it away to continue from the checkpoints' sidecars") from None
    return replay_log(log, run), log


def replay_log(log: Log, run: str) -> LossHistory:
    """The history the engine's records tell, by the proxy's own rules (a start at step k drops the rows after k);
    records of another run are passed over. The log's reader kept only records of their event's shape
    (runlog.RECORD_FIELDS, at least as strict as ROW_FIELDS: tests/proxy/test_runfiles.py), so every row fits."""
    hist, ours = LossHistory(None, run), False
    for ev in log.records:
        kind = ev["event"]
        if kind == "start":
            ours = ev.get("run") == run
            if ours:
                hist.truncate_after(ev["step"])
                hist.set_meta({k: ev.get(k) for k in META_FIELDS})
        elif ours and kind in ("step", "eval"):
            hist.add("train" if kind == "step" else "val", {k: v for k, v in ev.items() if k != "event"})
    return hist


class JsonDoc:
    """A small JSON object file (state, samples) kept in memory and written whole on flush()."""

    def __init__(self, path: Path, fmt: str, fresh: dict[str, Any]):
        self.path, self.fmt = path, fmt
        self.lock: RunLock | None = None  # as LossHistory.lock
        self.data = {"format": fmt, **fresh, **(read_json(path, fmt) or {})}  # fields a file lacks: fresh ones

    def update(self, **fields: Any) -> None:
        self.data.update(fields)

    def flush(self) -> None:
        self.data["updated"] = utc_now()
        write_run_file(self.path, self.data, self.lock)


def archive(paths: list[Path], phase: str, lock: RunLock | None = None) -> list[str]:
    """Copy each existing file to archive/<name-without-.json>.<phase>.<UTC stamp>.json; return the new paths. With
    lock, as write_run_file writes: only while the folder is the locked one, and into it by its descriptor.

    Copies, not moves: the caller then starts a fresh file under the old name, so the file is never missing.
    """
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    done = []
    for path in paths:
        if not path.exists():
            continue
        dest = path.parent / "archive" / f"{path.name.removesuffix('.json')}.{phase}.{stamp}.json"
        if lock is not None:
            lock.check()
        try:
            anchor = lock.anchor if lock is not None else None
            atomic_write_bytes(dest, [path.read_bytes()], sync_dir=False, anchor=anchor)
        except OSError as e:
            raise WriteError(f"{dest}: cannot archive the run file ({e.strerror or e}); {path} is intact") from None
        done.append(str(dest))
    return done
