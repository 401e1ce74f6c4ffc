"""Atomic file writes, and the one strict reader of JSON files.

Every file the project writes that someone else reads (checkpoints and sidecars, shards, tokenizers, the proxy's
run files, pulled data sets) goes through `atomic_write_bytes`: a temp file beside the target, fsync, rename,
and fsync of the folder so the rename itself survives a power cut. A write that fails (a full disk) removes its
temp file and leaves the old file as it was. A writer holding a run folder's lock passes its Anchor: the write
then goes to the folder it locked, wherever that folder's path leads now.

Every JSON file the project reads (experiments, checkpoint sidecars, run files, manifests) goes through
`read_json`: UTF-8, valid JSON, no key twice in one object (json.loads would silently keep the last), nesting at
most MAX_DEPTH deep, and (for the files that refuse NaN) no number that overflows to infinity (`1e999`);
anything else is the caller's InputError subclass naming the file. Each format's reader then checks the shape of
what it got. JSON Lines (HellaSwag, pulled data sets, the engine's log) go through `parse_json` line by line.

Every path a user gives that is read (an experiment, a checkpoint and its sidecar, --init, `eval --hellaswag` and
`--text`, `prep --source`, a tokenizer, the run's train.jsonl) is opened by `open_input`: without blocking (a named
pipe with no writer would hang an ordinary open), then checked on the open descriptor to be a regular file (a named
pipe, /dev/zero or any device, a socket, a folder: one line saying which); `input_kind` says whether a path that
may be a folder is a folder or a regular file. Files read whole (`read_input`) have a size bound, so no input can
take the memory; text is UTF-8, and a bad byte is named by its offset and line (`decode_utf8`).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from microgpt.errors import InputError

MAX_DEPTH = 100  # our files nest a few levels; a hostile one 100,000 deep would exhaust the recursion limit
# Files read whole: JSON (experiments, sidecars, manifests, run files: a 200,000-step loss history is tens of MB)
# and text (a prep source's plain-text file, `eval --text`, a HellaSwag file, a tokenizer).
MAX_JSON_BYTES = 256 << 20
MAX_TEXT_BYTES = 2 << 30


def file_kind(mode: int) -> str:
    """What a stat (or lstat) mode names, for an error line: 'a folder', 'a named pipe', 'a character device'
    (/dev/zero), 'a symbolic link' (lstat's)..."""
    kinds = (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISREG, "a regular file"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def input_kind(path: str | Path, what: str, error: type[InputError] = InputError, folder: bool = True) -> str:
    """Whether a path the user gives is a "folder" or a "file" (followed through symbolic links; stat never
    blocks); error(...) naming the path and what it is when it is neither (a named pipe, a device, a socket), or
    a folder where folder is False. FileNotFoundError passes through: a missing path is the caller's to judge."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror or e})") from None
    if stat.S_ISREG(mode) or (folder and stat.S_ISDIR(mode)):
        return "folder" if stat.S_ISDIR(mode) else "file"
    want = "a regular file or a folder" if folder else "a regular file"
    raise error(f"{path}: {what} must be {want}, not {file_kind(mode)}")


def open_input(path: str | Path, what: str, error: type[InputError] = InputError) -> BinaryIO:
    """path opened for reading, checked to be a regular file: opened without blocking (O_NONBLOCK: a named pipe
    opens at once, writer or not), then the open descriptor's own stat (no race with a rename) must say regular
    file; a named pipe, a device (/dev/zero), a socket or a folder is error(...) naming path and what it is.
    FileNotFoundError passes through: whether a missing file is an error is the caller's."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{path}: {what} must be a regular file, not {file_kind(mode)}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_input(path: str | Path, what: str, error: type[InputError] = InputError, limit: int = MAX_TEXT_BYTES) -> bytes:
    """The bytes of the regular file at path (open_input), at most `limit` of them: a larger file is error(...)
    naming the path, its size and the bound, before it is read."""
    try:
        with open_input(path, what, error) as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(limit + 1) if size <= limit else b""  # + 1: a file that grew since the stat is caught too
    except (FileNotFoundError, InputError):
        raise
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror or e})") from None
    if size > limit or len(data) > limit:
        raise error(f"{path}: {what} is {max(size, len(data)):,} bytes, more than the {limit:,} it may have")
    return data


def decode_utf8(data: bytes, where: str, what: str, error: type[InputError] = InputError) -> str:
    """data as UTF-8 text; error(...) naming `where` and the first bad byte (its offset and line) otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise error(f"{where}: not UTF-8 text (byte {e.start}, line {line}): the {what} must be UTF-8") from None


def read_input_text(
    path: str | Path, what: str, error: type[InputError] = InputError, limit: int = MAX_TEXT_BYTES
) -> str:
    """The UTF-8 text of the regular file at path (read_input, decode_utf8)."""
    return decode_utf8(read_input(path, what, error, limit), str(path), what, error)


class Anchor(NamedTuple):
    """A folder held open by a descriptor (the run folder's lock: runlock.RunLock.anchor). A write to a path below
    `folder` is made relative to `fd`, so it lands in the folder that was locked even where that folder was moved
    aside between the writer's check and its write (and another made in its place): never in the one made again."""

    fd: int
    folder: Path


@contextmanager
def _parent_fd(path: Path, anchor: Anchor | None, make_folder: bool) -> Iterator[int]:
    """A descriptor of path's folder: opened by its path, or (anchor) walked down from anchor.fd one name at a
    time, never through a symbolic link; folders are made where missing when make_folder."""
    if anchor is None:
        if make_folder:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    else:
        fd = os.dup(anchor.fd)
        try:
            for name in path.parent.relative_to(anchor.folder).parts:  # ValueError: path is not below the anchor
                if make_folder:
                    with suppress(FileExistsError):
                        os.mkdir(name, dir_fd=fd)
                below = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = below
        except BaseException:
            os.close(fd)
            raise
    try:
        yield fd
    finally:
        os.close(fd)


def atomic_write_bytes(
    path: Path,
    chunks: Iterable[bytes | memoryview],
    sync_dir: bool = True,
    make_folder: bool = True,
    anchor: Anchor | None = None,
) -> None:
    """Write chunks to path atomically: temp file beside it, fsync, rename, fsync the folder (made first unless
    make_folder is False: a run file's folder must be the run folder itself, never one made again after a move).
    The temp file, the rename and the folder's fsync all go through one descriptor of the folder, so they act on
    one folder even where its path is moved meanwhile; with anchor, that folder is found from the anchor's.

    sync_dir=False skips the folder's fsync (the rename is then durable only once the folder is synced) for
    files rewritten often whose loss in a power cut costs nothing a rerun does not restore (the proxy's files).
    """
    path = Path(path)
    tmp = f".{path.name}.tmp{os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    with _parent_fd(path, anchor, make_folder) as folder:
        try:
            fd = os.open(tmp, flags, 0o666, dir_fd=folder)
            with open(fd, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException as e:
            with suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=folder)
            if isinstance(e, OSError) and e.filename in (tmp, path.name):
                e.filename = str(path)  # the OS names what it was given, a name in the folder: say which file
            raise
        if sync_dir:
            os.fsync(folder)


def open_at(path: Path, flags: int, mode: int = 0o644, anchor: Anchor | None = None) -> int:
    """os.open of path, or with anchor of its name in the anchored folder (as atomic_write_bytes writes there)."""
    with _parent_fd(Path(path), anchor, make_folder=False) as folder:
        return os.open(Path(path).name, flags, mode, dir_fd=folder)


def remove(path: Path, anchor: Anchor | None = None) -> None:
    """Remove the file at path if it is there (with anchor: in the anchored folder, as atomic_write_bytes writes)."""
    try:
        with _parent_fd(Path(path), anchor, make_folder=False) as folder:
            os.unlink(Path(path).name, dir_fd=folder)
    except FileNotFoundError:
        pass


def check_parents(path: Path, flag: str, error: type[InputError] = InputError) -> None:
    """An output path's folders can exist: the nearest existing one above `path` is a folder, not a file (which
    would make every write below it fail with "File exists" or "Not a directory"); error naming `flag` otherwise."""
    parent = next((p for p in Path(path).parents if p.exists() or p.is_symlink()), None)
    if parent is not None and not parent.is_dir():
        raise error(f"{flag} {path}: {parent} is not a folder")


def folder_problem(path: Path) -> str | None:
    """What keeps path from being a folder files are written into, where something is there: "a link to nothing"
    (a dangling symbolic link) or "not a folder" (a file, or a link to one); None for a folder, a link to one, or
    nothing at all (it is made when first written)."""
    if path.is_dir() or not (path.exists() or path.is_symlink()):
        return None
    return "not a folder" if path.exists() else "a link to nothing"


def atomic_write_json(
    path: Path,
    obj: Any,
    compact: bool = False,
    sync_dir: bool = True,
    make_folder: bool = True,
    anchor: Anchor | None = None,
) -> None:
    """obj as JSON (indented and key-sorted for people, or compact for files rewritten every second); NaN and
    infinities are refused (ValueError) rather than written as invalid JSON."""
    if compact:
        text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    else:
        text = json.dumps(obj, indent=1, sort_keys=True, allow_nan=False)
    atomic_write_bytes(path, [(text + "\n").encode()], sync_dir=sync_dir, make_folder=make_folder, anchor=anchor)


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


def dumps_strict(obj: Any) -> str:
    """obj as one line of strict JSON: every number that is not finite written as null (finite)."""
    return json.dumps(finite(obj), separators=(",", ":"), allow_nan=False)


def _depth(value: Any) -> int:
    """How deep lists and objects nest (iteratively: no recursion on hostile input)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # JSON's escape of a UTF-16 surrogate


def _lone_surrogate(value: Any) -> str | None:
    """The first string (key or value) holding a lone surrogate, which no UTF-8 encoder (a tokenizer) takes."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, str) and not v.isascii():
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return v
    return None


def parse_json(text: str, where: str, error: type[InputError] = InputError, allow_nan: bool = True) -> Any:
    """Strict json.loads: no duplicate keys, nesting at most MAX_DEPTH, NaN/Infinity (and numbers that overflow to
    it) only with allow_nan (the experiment loader lets them through so the field's own check names the field), no
    string holding a lone surrogate (a `\\ud800` escape without its pair is no text: every encode of it fails);
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
    if SURROGATE_ESCAPE.search(text) and (lone := _lone_surrogate(value)) is not None:
        bad = next(i for i, c in enumerate(lone) if 0xD800 <= ord(c) <= 0xDFFF)
        raise error(f"{where}: a string holds a lone surrogate (\\u{ord(lone[bad]):04x} without its pair): not text")
    return value


def read_json(path: Path, what: str, error: type[InputError] = InputError, allow_nan: bool = True) -> Any:
    """The JSON value of the file at path (parse_json); error naming the file when it cannot be read, is not a
    regular file of at most MAX_JSON_BYTES (read_input), is not UTF-8 or is not strict JSON. FileNotFoundError
    passes through: whether a missing file is an error is the caller's."""
    text = read_input_text(path, what, error, MAX_JSON_BYTES)
    return parse_json(text, str(path), error, allow_nan)
