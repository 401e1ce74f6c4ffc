"""Atomic file writes: a reader, or a crash, sees the old file or the new one, never half of either.

Every file the project writes that someone else reads (checkpoints and sidecars, shards, tokenizers, the proxy's
run files, pulled data sets) goes through `atomic_write_bytes`: a temp file beside the target, fsync, rename,
and fsync of the folder so the rename itself survives a power cut.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


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


def atomic_write_json(path: Path, obj: Any, compact: bool = False, sync_dir: bool = True) -> None:
    """obj as JSON (indented and key-sorted for people, or compact for files rewritten every second); NaN and
    infinities are refused (ValueError) rather than written as invalid JSON."""
    if compact:
        text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    else:
        text = json.dumps(obj, indent=1, sort_keys=True, allow_nan=False)
    atomic_write_bytes(path, [(text + "\n").encode()], sync_dir=sync_dir)
