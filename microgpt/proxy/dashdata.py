"""What the dashboard server answers from run files: run discovery, cached parsing, new points, downsampling.

A 200,000-step `.loss.json` is about 46 MB: the page must never download it. The server parses each file once
per version (mtime, size, inode) into columns, and answers

    view(columns, width)                  every series downsampled to `width` buckets of steps: in each bucket the
                                          minimum and the maximum (in step order), so at most 2*width + 2 points per
                                          series and a one-step spike still shows
    view(columns, width, since=S)         only the rows after step S (the live poll), downsampled the same way
                                          when more than 2*width are new (a page that slept)
    view(columns, width, lo=A, hi=B)      the steps in [A, B] at full detail up to 2*width (the page's zoom)

The eval rows give `val` (val_loss) and `hellaswag` (acc and acc_norm, train.hellaswag's fields), whole; with
vsince=V only their points after step V, V being the answer's `last_val_step`: the last step of any of them (an
evaluation may score one and not the other).
Each series is its own (step, y) pair of lists because min and max fall on different steps per series. Rows
whose value is null (a diverged loss) are left out of that series. `clock` maps step to cumulative tokens, wall
time (`time`, Unix seconds) and training time (`elapsed`: the engine's elapsed_s, seconds of training up to the
step across resumes), for the page's tokens and time x axes; a row that does not say its time (a log of an older
version) has null there, and the page leaves a gap rather than draw it at the Unix epoch.

A run folder `microgpt train` wrote (its log `train.jsonl`, microgpt/runlog.py, and no `.loss.json`) is a run here
too: its history is the log's, read by the log's one reader (runlog.parse_log: what it cannot read is passed over)
and the proxy's own rules (runfiles.replay_log), so the same page shows a `make train` run, live or finished.

The proxy rewrites its files atomically, so a read sees a whole version; anything else that writes them (a
person, a copy in progress) may leave half a file, in which case the last good version is served, and with
none yet, RunNotReady (a 503 the page retries). Values that are not finite numbers (NaN, Infinity, 1e999 in a
file the proxy did not write) are left out of the series, and become null in meta and marks: the answer is
always valid JSON.

Every file is opened through RunFolder.open, the one resolver: relative to the root, one path component at a
time, never through a symbolic link; a run whose files are links is not listed. Nothing outside the folder is
ever read, whatever the links in it point to.
"""

from __future__ import annotations

import json
import math
import os
import stat
import threading
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

from microgpt.errors import InputError
from microgpt.fileio import MAX_JSON_BYTES, finite, parse_json
from microgpt.proxy.runfiles import replay_log
from microgpt.runlock import pid_alive
from microgpt.runlog import LOG_NAME, MAX_LOG_BYTES, parse_log

SERIES = ("loss", "lr", "grad_norm", "tokens_per_s")  # the train row fields the charts draw
HELLASWAG = {"acc": "hellaswag", "acc_norm": "hellaswag_acc_norm"}  # the eval row fields of train.hellaswag
KINDS = ("loss", "samples", "state")
LOG_PHASE = "train"  # a `train` folder's one phase: what the proxy names a run without phases
REPORT_NAME = "report.json"  # a `train` folder's report card, whose samples the page shows (microgpt/run/report.py)
SKIP_DIRS = {"ckpt", "archive", "phases", "data"}  # a run folder's own subfolders: never runs themselves
MAX_WIDTH = 4096


class RunUnavailable(Exception):
    """No such run here (a 404)."""


class RunNotReady(RunUnavailable):
    """The run's history has no complete version yet (a 503: the page retries)."""


@dataclass
class Columns:
    """One parsed version of a .loss.json: per-series (steps, ys) without nulls, and the raw small parts."""

    version: str
    meta: dict[str, Any]
    marks: list[dict[str, Any]]
    steps: list[int]  # every train row's step, ascending
    series: dict[str, tuple[list[int], list[float]]]
    tokens: list[float]  # cumulative tokens at each train row
    times: list[float | None]  # each train row's wall time (unix seconds); None: unknown
    elapsed: list[float | None]  # each train row's training time (elapsed_s); None: unknown
    val: tuple[list[int], list[float]]
    memory_peak: float | None = None  # the last row's measured peak memory (bytes; the page's header shows it)
    hellaswag: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)  # HELLASWAG's, from eval rows
    views: dict[tuple, dict[str, Any]] = field(default_factory=dict)  # memoized full-range answers
    raw: bytes = b""  # the file as read, and the offset just past its last train row (-1: not found)
    rows_end: int = -1


def _number(v: Any) -> bool:
    """A value the page can draw: a finite float, or an int that a JavaScript number holds exactly."""
    if isinstance(v, float):
        return math.isfinite(v)
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) <= 2**53


MAX_TIME = datetime(9999, 12, 31, tzinfo=timezone.utc).timestamp()  # the last Unix time a date can say
KIND_CHECKS = {
    "number": _number,
    "time": lambda v: _number(v) and 0 <= v <= MAX_TIME,
    "str": lambda v: isinstance(v, str),
    "list": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
}


def field_of(obj: Any, key: str, kind: str) -> Any:
    """The one check of a value the dashboard reads from a file someone else wrote (a log record, a report card, a
    history row): obj[key] where obj is an object and the value is of `kind` (KIND_CHECKS: a number the page can
    draw, a Unix time a date can say, a string, a list, an object), else None. Whatever a file holds, an answer is
    then made of values of the kinds it promises: a field of another kind is left out, never a 500."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if value is not None and KIND_CHECKS[kind](value) else None


def columns(obj: dict[str, Any], version: str, base: Columns | None = None) -> Columns:
    """One pass over the train rows (200K rows: about a second in pure Python, so it runs once per version);
    with `base`, obj's train rows are the ones after base's and are appended to copies of its columns."""
    steps: list[int] = list(base.steps) if base else []
    tokens: list[float] = list(base.tokens) if base else []
    times: list[float | None] = list(base.times) if base else []
    elapsed: list[float | None] = list(base.elapsed) if base else []
    series = {key: (list(xs), list(ys)) for key, (xs, ys) in base.series.items()} if base else {}
    for key in SERIES:
        series.setdefault(key, ([], []))
    cols = [(key, *series[key]) for key in SERIES]
    total = tokens[-1] if tokens else 0.0
    memory_peak = base.memory_peak if base else None
    for r in obj.get("train") or []:
        if not isinstance(r, dict) or not _number(step := r.get("step")):
            continue
        memory_peak = r["memory_peak"] if _number(r.get("memory_peak")) else memory_peak
        steps.append(step)
        total += r["tokens"] if _number(r.get("tokens")) else 0
        tokens.append(total)
        t, e = field_of(r, "time", "time"), field_of(r, "elapsed_s", "number")
        times.append(None if t is None else float(t))
        elapsed.append(None if e is None else float(e))
        for key, xs, ys in cols:
            y = r.get(key)
            if y is not None and _number(y):
                xs.append(step)
                ys.append(y)
        mix = field_of(r, "mixture", "dict")  # a data mixture's sampling weights (docs/FIREHOSE-BANDIT.md)
        if mix is not None:
            for name, w in mix.items():  # series "mix:<source>"
                if _number(w):
                    xs, ys = series.setdefault(f"mix:{name}", ([], []))
                    xs.append(step)
                    ys.append(w)
    evals = [r for r in obj.get("val") or [] if isinstance(r, dict) and _number(r.get("step"))]
    marks = [finite(m) for m in obj.get("marks") or [] if isinstance(m, dict) and _number(m.get("step"))]
    meta = base.meta if base else finite(obj.get("meta")) if isinstance(obj.get("meta"), dict) else {}
    hellaswag = {name: _eval_series(evals, key) for name, key in HELLASWAG.items()}
    return Columns(
        version,
        meta,
        marks,
        steps,
        series,
        tokens,
        times,
        elapsed,
        _eval_series(evals, "val_loss"),
        memory_peak,
        hellaswag,
    )


def _eval_series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the eval rows whose `key` is a number: the val loss, or a HellaSwag accuracy (the rows of
    an evaluation that scored only the other have none)."""
    pairs = [(r["step"], float(r[key])) for r in rows if _number(r.get(key))]
    return [s for s, _ in pairs], [y for _, y in pairs]


def downsample(xs: list[int], ys: list[float], a: int, b: int, lo: float, hi: float, width: int) -> tuple[list, list]:
    """Points a..b-1 of (xs, ys) in `width` equal step buckets over [lo, hi]: the min and max of each bucket, in
    step order, and the first and last point (at most 2*width + 2 points). Bucket edges are found by bisection
    and min/max run over list slices, so a 200K-point series takes milliseconds in pure Python (the server needs
    nothing beyond the standard library)."""
    if b - a <= 2 * width:
        return xs[a:b], ys[a:b]
    ox: list[int] = []
    oy: list[float] = []
    span = (hi - lo) / width or 1.0
    start = a
    for k in range(1, width + 1):
        end = b if k == width else max(start, bisect_right(xs, lo + k * span, start, b))
        if end - start <= 2:
            ox.extend(xs[start:end])
            oy.extend(ys[start:end])
        elif end > start:
            chunk = ys[start:end]
            i_min = start + chunk.index(min(chunk))
            i_max = start + chunk.index(max(chunk))
            ends = {a} if k == 1 else {b - 1} if k == width else set()  # the line spans the whole range
            for i in sorted({i_min, i_max} | ends):
                ox.append(xs[i])
                oy.append(ys[i])
        start = end
    return ox, oy


def view(
    c: Columns,
    width: int,
    since: int | None = None,
    vsince: int | None = None,
    lo: int | None = None,
    hi: int | None = None,
) -> dict[str, Any]:
    """The answer to one /api/loss request (see the module docstring); JSON-ready."""
    width = max(16, min(MAX_WIDTH, width))
    key = (width, since, vsince, lo, hi)
    if since is None and key in c.views:
        return c.views[key]
    first = since + 1 if since is not None else (lo if lo is not None else -(2**62))
    last = hi if hi is not None else 2**62
    out_series = {}
    for name, (xs, ys) in c.series.items():
        a, b = bisect_left(xs, first), bisect_right(xs, last)
        if since is None and lo is not None:  # a zoomed view: one point beyond each edge so lines reach it
            a, b = max(0, a - 1), min(len(xs), b + 1)
        x0, x1 = (xs[a], xs[b - 1]) if b > a else (0, 0)
        sx, sy = downsample(xs, ys, a, b, x0, x1, width)
        out_series[name] = {"step": sx, "y": sy}
    a, b = bisect_left(c.steps, first), bisect_right(c.steps, last)
    clock: dict[str, list] = {"step": [], "tokens": [], "time": [], "elapsed": []}
    if b > a:  # step -> tokens and times are monotone: every bucket's first row is enough to interpolate
        stride = max(1, (b - a) // (2 * width))
        idx = list(range(a, b, stride)) + ([b - 1] if (b - 1 - a) % stride else [])
        clock = {
            "step": [c.steps[i] for i in idx],
            "tokens": [c.tokens[i] for i in idx],
            "time": [c.times[i] for i in idx],
            "elapsed": [c.elapsed[i] for i in idx],
        }
    evals = [c.val, *c.hellaswag.values()]
    last_eval = max([xs[-1] for xs, _ in evals if xs], default=0)  # the poll's vsince: every eval series' cursor
    ans = {
        "version": c.version,
        "meta": c.meta,
        "marks": c.marks,
        "rows": len(c.steps),
        "first_step": c.steps[0] if c.steps else 0,
        "last_step": c.steps[-1] if c.steps else 0,
        "first_time": next((t for t in c.times if t is not None), None),
        "memory_peak": c.memory_peak,
        "last_val_step": last_eval,
        "width": width,
        "since": since,
        "lo": lo,
        "hi": hi,
        "series": out_series,
        "clock": clock,
        "val": _after(*c.val, vsince),
        "hellaswag": {name: _after(xs, ys, vsince) for name, (xs, ys) in c.hellaswag.items()},
        "points": sum(len(s["step"]) for s in out_series.values()),
    }
    if since is None:
        if len(c.views) > 64:
            c.views.clear()
        c.views[key] = ans
    return ans


def _after(xs: list[int], ys: list[float], vsince: int | None) -> dict[str, list]:
    """An eval series' points after step vsince (all of them without one): evaluations are few, never downsampled."""
    a = bisect_right(xs, vsince) if vsince is not None else 0
    return {"step": xs[a:], "y": ys[a:]}


class RunFolder:
    """The runs under a root folder: `<root>/<run>.loss.json` (one run folder, as `microgpt run` writes) and
    `<root>/<sub>/<run>.loss.json` (a folder of run folders), named `<run>` and `<sub>/<run>`."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.cache: dict[Path, Columns] = {}  # by the file's path: one parse per version
        self.lock = threading.Lock()  # one parse per file version, whatever the number of polling pages

    def runs(self) -> dict[str, Path]:
        """Run name -> folder; rescanned on each call (a listing, cheap), so runs started later appear. Symbolic
        links are never followed: a linked history or a linked folder of runs is not a run here."""
        found: dict[str, Path] = {}
        try:
            entries = sorted(os.scandir(self.root), key=lambda e: e.name)
        except OSError:
            return found
        for e in entries:
            if e.name.endswith(".loss.json") and e.is_file(follow_symlinks=False):
                found[e.name.removesuffix(".loss.json")] = self.root
        if not found and (name := self.log_run()):
            found[name] = self.root
        for e in entries:
            if e.name.startswith(".") or e.name in SKIP_DIRS or not e.is_dir(follow_symlinks=False):
                continue
            try:
                subs = sorted(os.scandir(e.path), key=lambda s: s.name)
            except OSError:
                continue
            names = [
                sub.name.removesuffix(".loss.json")
                for sub in subs
                if sub.name.endswith(".loss.json")
                and not sub.name.startswith(".")
                and sub.is_file(follow_symlinks=False)
            ]
            if not names and any(sub.name == LOG_NAME for sub in subs) and (name := self.log_run(e.name)):
                names = [name]
            for name in names:
                found[f"{e.name}/{name}"] = Path(e.path)
        return found

    def log_run(self, *sub: str) -> str | None:
        """The run a folder's train.jsonl belongs to (its first record, the start record, names it); None: no log
        (or a linked one: it is opened through open() like every other file)."""
        try:
            f, _ = self.open(*sub, LOG_NAME)
        except RunUnavailable:
            return None
        try:
            with f:
                first = json.loads(f.readline(1 << 22))
        except (OSError, ValueError, RecursionError):
            return None
        name = first.get("run") if isinstance(first, dict) else None
        ok = isinstance(name, str) and 0 < len(name) <= 250 and not name.startswith(".") and "/" not in name
        return name if ok and "\0" not in name else None

    def parts(self, run: str, kind: str) -> tuple[str, ...]:
        """The path below the root of one run's file; RunUnavailable for a name that is not a run here (so no path
        is ever built from what the request says: only from what the listing found)."""
        folder = self.runs().get(run)
        if folder is None or kind not in KINDS:
            raise RunUnavailable(f"no run {run!r} here")
        *sub, name = run.split("/")
        if kind == "loss" and not os.path.lexists(folder / f"{name}.loss.json"):
            return (*sub, LOG_NAME)  # a `microgpt train` folder: its history is its log
        return (*sub, f"{name}.{kind}.json")

    def open(self, *parts: str) -> tuple[BinaryIO, os.stat_result]:
        """The regular file root/parts[0]/.../parts[-1], open for reading, and its stat: opened relative to the root
        one component at a time with O_NOFOLLOW (a link anywhere below the root is refused, as ".." is) and
        O_NONBLOCK (a FIFO cannot hang the reader); RunUnavailable for anything else."""
        if not parts or any(p in ("", ".", "..") or "/" in p or "\0" in p for p in parts):
            raise RunUnavailable(f"{'/'.join(parts)}: not a file of this folder")
        opened: list[int] = []
        try:
            opened.append(os.open(self.root, os.O_RDONLY | os.O_DIRECTORY))
            for part in parts[:-1]:
                opened.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=opened[-1]))
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=opened[-1])
        except OSError as e:  # ELOOP: a link; ENAMETOOLONG, EACCES...: not something we serve
            raise RunUnavailable(f"{'/'.join(parts)}: not a file of this folder ({e.strerror or e})") from None
        finally:
            for d in opened:
                os.close(d)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise RunUnavailable(f"{'/'.join(parts)}: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st

    def loss(self, run: str) -> Columns:
        parts = self.parts(run, "loss")
        key = self.root.joinpath(*parts)
        with self.lock:
            cached = self.cache.get(key)
            try:
                f, st = self.open(*parts)
                with f:
                    version = f"{st.st_mtime_ns:x}-{st.st_size:x}-{st.st_ino:x}"
                    if cached is not None and cached.version == version:
                        return cached
                    raw = _read_bounded(f, st, parts)
                if parts[-1] == LOG_NAME:
                    hist = replay_log(parse_log(raw.decode(errors="replace")), run.rsplit("/", 1)[-1])
                    cached = self.cache[key] = columns(hist.data, version)
                else:
                    cached = self.cache[key] = _appended(cached, raw, version) or _parse(raw, version)
            except (InputError, RunUnavailable, OSError, ValueError, TypeError, KeyError, RecursionError) as e:
                if cached is None:
                    raise RunNotReady(f"{parts[-1]}: not readable yet ({type(e).__name__})") from None
            return cached

    def log_state(self, run: str) -> dict[str, Any]:
        """A `train` folder's state, as the proxy's state file would say it, from its log: status done or stopped
        from its last records, else running while the process that wrote its last start record lives (else
        crashed); the step, the target step; the log's lines passed over as unreadable (runlog.parse_log)."""
        parts = self.parts(run, "loss")
        if parts[-1] != LOG_NAME:
            raise RunUnavailable(f"no run {run!r} here")
        f, st = self.open(*parts)
        with f:
            text = _read_bounded(f, st, parts).decode(errors="replace")
        last: dict[str, Any] = {}
        log = parse_log(text)
        for rec in log.records:
            if rec["event"] == "start":
                last = {"start": rec}
            last[rec["event"]] = rec
        start = last.get("start", {})
        ended = "done" if "done" in last else "stopped" if "stopped" in last else None
        status = ended or ("running" if pid_alive(field_of(start, "pid", "number")) else "crashed")
        steps = [field_of(r, "step", "number") for k, r in last.items() if k in ("step", "done", "stopped")]
        train = field_of(field_of(start, "config", "dict"), "train", "dict")
        times = [t for r in last.values() if (t := field_of(r, "time", "time")) is not None]
        updated = datetime.fromtimestamp(max(times, default=0.0), timezone.utc)
        return {
            "format": "microgpt-proxy-state-1",
            "run": run.rsplit("/", 1)[-1],
            "status": status,
            "step": max([s for s in steps if s is not None], default=field_of(start, "step", "number") or 0),
            "target_step": field_of(train, "steps", "number"),
            "phase": LOG_PHASE,
            "restarts": 0,
            "source": LOG_NAME,
            "updated": updated.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "unreadable_lines": log.unreadable,
        }

    def log_samples(self, run: str) -> dict[str, Any]:
        """A `train` folder's samples, as the proxy's samples file would hold them: those of its report card
        (report.json, written at the run's end from its final weights); RunUnavailable before there is one."""
        *sub, _ = self.parts(run, "loss")
        f, st = self.open(*sub, REPORT_NAME)
        with f:
            try:
                card = parse_json(_read_bounded(f, st, (*sub, REPORT_NAME)).decode(), REPORT_NAME)
            except (UnicodeDecodeError, InputError):
                card = None
        if not isinstance(card, dict):
            raise RunUnavailable(f"{REPORT_NAME}: not a report card (yet)")
        ckpts = field_of(card, "checkpoints", "list") or [None]
        final = field_of(ckpts[0], "path", "str")
        samples = [
            {
                "step": field_of(s, "seed", "number") if "seed" in s else field_of(card, "step", "number"),
                "phase": LOG_PHASE,
                "prompt": field_of(s, "prompt", "str"),
                "temperature": field_of(s, "temperature", "number"),
                "tokens": field_of(s, "tokens", "number"),
                "checkpoint": final,
                **(
                    {"error": field_of(s, "error", "str") or ""}
                    if "error" in s
                    else {"text": field_of(s, "text", "str") or ""}
                ),
            }
            for s in field_of(card, "samples", "list") or []
            if isinstance(s, dict)
        ]
        return {
            "format": "microgpt-samples-1",
            "run": run.rsplit("/", 1)[-1],
            "phase": LOG_PHASE,
            "settings": {"source": REPORT_NAME},
            "samples": samples,
        }


def _read_bounded(f: BinaryIO, st: os.stat_result, parts: tuple[str, ...]) -> bytes:
    """A run file or log read whole, within the bound its readers have (fileio.MAX_JSON_BYTES for run files,
    runlog.MAX_LOG_BYTES for a log): a larger one is RunUnavailable, never read into memory."""
    limit = MAX_LOG_BYTES if parts[-1] == LOG_NAME else MAX_JSON_BYTES
    if st.st_size > limit:
        raise RunUnavailable(f"{'/'.join(parts)}: {st.st_size:,} bytes, more than the {limit:,} it may have")
    raw = f.read(limit + 1)
    if len(raw) > limit:
        raise RunUnavailable(f"{'/'.join(parts)}: more than the {limit:,} bytes it may have")
    return raw


TRAIN_START, TRAIN_END = b'"train":[', b'],"val":['  # the proxy's compact writer: meta, train, val, marks


def _tail(raw: bytes, end: int) -> dict[str, Any] | None:
    """The val and marks after a train array ending at `end`, or None when raw does not continue that way."""
    if raw[end : end + len(TRAIN_END)] != TRAIN_END:
        return None
    try:
        tail = json.loads(b"{" + raw[end + 2 :])
    except ValueError:
        return None
    return tail if isinstance(tail, dict) and list(tail) == ["val", "marks"] else None


def _parse(raw: bytes, version: str) -> Columns:
    """A whole file; also finds where its train rows end, for _appended next time."""
    obj = json.loads(raw)
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    c = columns(obj, version)
    end = raw.rfind(TRAIN_END)
    tail = _tail(raw, end) if end > 0 else None
    if tail is not None and tail == {"val": obj.get("val"), "marks": obj.get("marks")}:
        c.raw, c.rows_end = raw, end
    return c


def _appended(old: Columns | None, raw: bytes, version: str) -> Columns | None:
    """The new version when it only appends train rows to the old one (a live run: the proxy rewrites the whole
    file, the same bytes up to the old last row), parsing only what follows; None otherwise. A 200K-row file then
    costs a byte comparison and the parse of the new rows and the val/marks tail, not a 2-4 s parse."""
    if old is None or old.rows_end < 0 or raw[: old.rows_end] != old.raw[: old.rows_end]:
        return None
    sep = raw[old.rows_end : old.rows_end + 1]
    end = raw.find(TRAIN_END, old.rows_end) if sep == b"," else old.rows_end if sep == b"]" else -1
    tail = _tail(raw, end) if end >= 0 else None
    if tail is None:
        return None
    try:
        rows = json.loads(b"[" + raw[old.rows_end + 1 : end] + b"]") if end > old.rows_end else []
    except ValueError:
        return None
    last = old.steps[-1] if old.steps else -(2**62)
    if not all(isinstance(r, dict) and _number(r.get("step")) for r in rows):
        return None
    if [r["step"] for r in rows] != sorted(r["step"] for r in rows) or (rows and rows[0]["step"] <= last):
        return None
    c = columns({"train": rows, **tail}, version, base=old)
    c.raw, c.rows_end = raw, end
    return c
