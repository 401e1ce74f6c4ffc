"""Atomic file writes, and the one strict reader of JSON files.

Every file the project writes that someone else reads (checkpoints and sidecars, shards, tokenizers, the proxy's
run files, pulled data sets) goes through `atomic_write_bytes`: a temp file beside the target, fsync, rename,
and fsync of the folder so the rename itself survives a power cut. A write that fails (a full disk) removes its
temp file and leaves the old file as it was.

Every JSON file the project reads (experiments, checkpoint sidecars, run files, manifests) goes through
`read_json`: UTF-8, valid JSON, no key twice in one object (json.loads would silently keep the last), nesting at
most MAX_DEPTH deep, and (for the files that refuse NaN) no number that overflows to infinity (`1e999`);
anything else is the caller's InputError subclass naming the file. Each format's reader then checks the shape of
what it got. JSON Lines (HellaSwag, pulled data sets, the engine's log) go through `parse_json` line by line.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from microgpt.errors import InputError

MAX_DEPTH = 100  # our files nest a few levels; a hostile one 100,000 deep would exhaust the recursion limit


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, chunks: Iterable[bytes | memoryview], sync_dir: bool = True) -> None:
    """Write chunks to path atomically: temp file beside it, fsync, rename, fsync the folder.

    sync_dir=False skips the folder's fsync (the rename is then durable only once the folder is synced) for
    files rewritten often whose loss in a power cut costs nothing a rerun does not restore (the proxy's files).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir:
        _fsync_dir(path.parent)


def check_parents(path: Path, flag: str, error: type[InputError] = InputError) -> None:
    """An output path's folders can exist: the nearest existing one above `path` is a folder, not a file (which
    would make every write below it fail with "File exists" or "Not a directory"); error naming `flag` otherwise."""
    parent = next((p for p in Path(path).parents if p.exists() or p.is_symlink()), None)
    if parent is not None and not parent.is_dir():
        raise error(f"{flag} {path}: {parent} is not a folder")


def atomic_write_json(path: Path, obj: Any, compact: bool = False, sync_dir: bool = True) -> None:
    """obj as JSON (indented and key-sorted for people, or compact for files rewritten every second); NaN and
    infinities are refused (ValueError) rather than written as invalid JSON."""
    if compact:
        text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    else:
        text = json.dumps(obj, indent=1, sort_keys=True, allow_nan=False)
    atomic_write_bytes(path, [(text + "\n").encode()], sync_dir=sync_dir)


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        raise _Duplicate(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]} overflows a double")
    return value


def finite(value: Any) -> Any:
    """value with every float that is NaN or infinite replaced by None (JSON has no NaN: a diverged loss is
    written as null), in nested lists and objects too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def _depth(value: Any) -> int:
    """How deep lists and objects nest (iteratively: no recursion on hostile input)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse_json(text: str, where: str, error: type[InputError] = InputError, allow_nan: bool = True) -> Any:
    """Strict json.loads: no duplicate keys, nesting at most MAX_DEPTH, NaN/Infinity (and numbers that overflow to
    it) only with allow_nan (the experiment loader lets them through so the field's own check names the field);
    error(...) naming where."""
    hooks: dict[str, Any] = {"object_pairs_hook": _no_duplicates}
    if not allow_nan:
        hooks["parse_constant"], hooks["parse_float"] = _reject_constant, _finite_float
    try:
        value = json.loads(text, **hooks)
    except json.JSONDecodeError as e:
        raise error(f"{where}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except _Duplicate as e:
        raise error(f"{where}: key {str(e.args[0])[:60]!r} appears twice in one JSON object") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:  # NaN/Infinity refused, or an integer of more than 4,300 digits
        raise error(f"{where}: invalid JSON ({str(e).splitlines()[0][:100]})") from None
    if _depth(value) > MAX_DEPTH:
        raise error(f"{where}: JSON nested too deeply (at most {MAX_DEPTH} levels)")
    return value


def read_json(path: Path, what: str, error: type[InputError] = InputError, allow_nan: bool = True) -> Any:
    """The JSON value of the file at path (parse_json); error naming the file when it cannot be read, is not UTF-8
    or is not strict JSON. FileNotFoundError passes through: whether a missing file is an error is the caller's."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start}): the {what} must be UTF-8 JSON") from None
    return parse_json(text, str(path), error, allow_nan)
