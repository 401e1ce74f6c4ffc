"""Checkpoints in the seed's binary format, plus a JSON sidecar for what the format has no room for.

    [int32 step][int32 n_params][n_params f32 weights][n_params f32 adam m][n_params f32 adam v]

little-endian, parameters in the canonical order (microgpt/engine/params.py). The file is the same for every
backend and precision. Writes are atomic: a temp file in the same folder, fsync, rename, fsync of the
folder; so a reader (or a crash) never sees half a checkpoint and an existing file is only ever
replaced by a complete one. Readers check the size (8 + 12 * n_params) and n_params against the model
and say what is wrong in one sentence.

The sidecar `<name>.state.json` holds the config, seed, tokenizer, data sources, loss scale and the
sha256 of the .bin. This module does not depend on the training step.

`load` is the one reader of a checkpoint with its sidecar (resume, sample, chat, eval, export, `--resume latest`):
the .bin's size, header, finite weights and Adam m, finite non-negative Adam v; the sidecar's shape (SIDECAR_FIELDS);
and the two agree (sha256, step, n_params). Anything else is one CheckpointError line naming the file.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from microgpt.errors import InputError, brief
from microgpt.fileio import Anchor, atomic_write_bytes, atomic_write_json, input_kind, open_input, read_json, remove

HEADER = struct.Struct("<ii")
CKPT_RE = re.compile(r"^step-(\d{8})\.bin$")
TEMP_RE = re.compile(r"^\.step-\d{8}\.(bin|state\.json)\.tmp\d+$")  # fileio's temp files of checkpoint writes


class CheckpointError(InputError):
    """A missing, truncated, mismatched or corrupt checkpoint. str(err) is one line naming the file."""


@dataclass
class Checkpoint:
    step: int
    weights: np.ndarray  # (n_params,) float32
    m: np.ndarray
    v: np.ndarray
    path: Path
    sha256: str = ""  # of the file's bytes as read


def ckpt_name(step: int) -> str:
    return f"step-{step:08d}.bin"


def sidecar_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name.removesuffix(".bin") + ".state.json")


def write_checkpoint(
    path: str | Path,
    step: int,
    weights: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    meta: dict[str, Any] | None = None,
    anchor: Anchor | None = None,
) -> Path:
    """Write the seed-format file and its sidecar (the sidecar last: it names the .bin's sha256); with anchor (the
    run folder's lock), both relative to the locked folder's descriptor (fileio.Anchor)."""
    path = Path(path)
    n = weights.size
    arrays = [np.ascontiguousarray(a, dtype="<f4").reshape(-1) for a in (weights, m, v)]
    if any(a.size != n for a in arrays):
        raise ValueError("weights, m and v must have the same number of elements")
    header = HEADER.pack(step, n)
    digest = hashlib.sha256(header)
    for a in arrays:
        digest.update(memoryview(a).cast("B"))
    existed = path.exists()
    atomic_write_bytes(path, [header, *(memoryview(a).cast("B") for a in arrays)], anchor=anchor)
    side = {"format": "microgpt-ckpt-1", "step": step, "n_params": n, "bin": path.name, "sha256": digest.hexdigest()}
    side.update(meta or {})
    try:
        atomic_write_json(sidecar_path(path), side, anchor=anchor)
    except BaseException:
        if not existed:  # a new .bin without its sidecar would pass for a checkpoint with no metadata
            remove(path, anchor)
        raise
    return path


def read_step(path: str | Path) -> int | None:
    """The step in a checkpoint's header (8 bytes read), None if it has none; read_checkpoint validates the rest."""
    try:
        with open_input(path, "checkpoint", CheckpointError) as f:
            head = f.read(HEADER.size)
    except (OSError, CheckpointError):
        return None
    return HEADER.unpack(head)[0] if len(head) == HEADER.size else None


def read_checkpoint(path: str | Path, n_params: int | None = None) -> Checkpoint:
    """Read and validate a checkpoint; CheckpointError with one sentence on anything wrong.

    The header and the size are checked before the body is read (a truncated file fails at once); the body is read
    in chunks into one buffer while a worker thread hashes each chunk as it lands (hashlib and the read both
    release the GIL), so the sha256 costs little beyond the read; finiteness is checked by min/max reductions (a
    NaN or an infinity propagates into them) rather than a boolean array per element."""
    path = Path(path)
    try:
        with open_input(path, "checkpoint", CheckpointError) as f:  # a regular file: no named pipe, no device
            data, digest = _read_hashed(f, path, n_params)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint not found") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint ({e.strerror or e})") from None
    step, n = HEADER.unpack_from(data)
    flat = data[HEADER.size :].view("<f4")  # views of the one buffer: no copy
    w, m, v = flat[:n], flat[n : 2 * n], flat[2 * n :]
    if not _finite(w):
        raise CheckpointError(f"{path}: weights contain NaN or inf")
    if not _finite(m):
        raise CheckpointError(f"{path}: Adam m contains NaN or inf")
    if not (_finite(v) and v.min() >= 0):  # -0.0 passes, as a square's mean may be
        raise CheckpointError(f"{path}: Adam v contains NaN, inf or a negative value (it is a mean of squares)")
    return Checkpoint(step, w, m, v, path, digest.result())


READ_CHUNK = 64 << 20  # bytes read (and handed to the hashing thread) at a time


def _read_hashed(f: BinaryIO, path: Path, n_params: int | None) -> tuple[np.ndarray, Future[str]]:
    """The whole file as one uint8 array and the future of its sha256 hex digest (still being computed when this
    returns), once its header and size are known to be a checkpoint's (of n_params parameters, if given)."""
    size, head = os.fstat(f.fileno()).st_size, f.read(HEADER.size)
    if len(head) < HEADER.size:
        raise CheckpointError(f"{path}: truncated checkpoint: {len(head)} bytes, shorter than the 8-byte header")
    step, n = HEADER.unpack(head)
    if n <= 0 or step < 0:
        raise CheckpointError(f"{path}: corrupt header: step {step}, n_params {n}")
    expected = HEADER.size + 12 * n
    if size != expected:
        what = "truncated" if size < expected else "oversized"
        raise CheckpointError(f"{path}: {what} checkpoint: {size} bytes, expected {expected} for n_params {n}")
    if n_params is not None and n != n_params:
        raise CheckpointError(f"{path}: checkpoint holds {n} parameters but the model has {n_params}")
    # Allocated once the size is known to be a checkpoint's, as an anonymous mapping: 4 KiB pages the read faults in
    # as it fills them. np.empty asks the kernel for transparent huge pages for a buffer this large (madvise), and
    # on a machine whose memory is fragmented the compaction that finds them can stall the read for longer than the
    # read itself takes.
    data = np.frombuffer(mmap.mmap(-1, size), np.uint8)
    data[: HEADER.size] = np.frombuffer(head, np.uint8)
    view, sha = memoryview(data), hashlib.sha256(head)
    hasher = ThreadPoolExecutor(1)  # one worker: the chunks are hashed in the order they were read
    try:
        done = HEADER.size
        while done < size:
            got = f.readinto(view[done : min(size, done + READ_CHUNK)])
            if not got:
                raise CheckpointError(f"{path}: truncated checkpoint: it shrank to {done} bytes while being read")
            hasher.submit(sha.update, view[done : done + got])
            done += got
        return data, hasher.submit(sha.hexdigest)  # the caller checks the values while the last chunks hash
    finally:
        hasher.shutdown(wait=False)


def _finite(x: np.ndarray) -> bool:
    """No NaN and no infinity in x (NaN propagates into min and max; an infinity is one of them)."""
    return bool(np.isfinite(x.min()) and np.isfinite(x.max()))


# The sidecar's fields this module reads, and the JSON types each must have (None: null allowed). Others are kept:
# what a precision keeps there is checked by the precision (microgpt/engine/precision.py check_sidecar).
SIDECAR_FIELDS: dict[str, tuple[type, ...]] = {
    "format": (str,), "step": (int,), "n_params": (int,), "bin": (str,), "sha256": (str,), "config": (dict,),
    "tokenizer": (dict,), "params": (list,), "loss_scale": (int, float), "loss_scale_good_steps": (int,),
    "val_loss": (int, float, type(None)), "val_step": (int, type(None)), "mixing": (dict, type(None)),
    "seed": (int,), "backend": (str,), "precision": (str,), "reason": (str,),
}  # fmt: skip


def read_sidecar(path: str | Path) -> dict[str, Any]:
    """The sidecar of checkpoint path ({} when there is none), its fields' types checked; CheckpointError naming
    the sidecar and the field otherwise."""
    side = sidecar_path(path)
    try:
        obj = read_json(side, "checkpoint sidecar", CheckpointError, allow_nan=False)
    except FileNotFoundError:
        return {}
    if not isinstance(obj, dict):
        raise CheckpointError(f"{side}: a checkpoint sidecar must be a JSON object, got {type(obj).__name__}")
    for name, types in SIDECAR_FIELDS.items():
        value = obj.get(name)
        if name in obj and (not isinstance(value, types) or isinstance(value, bool)):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise CheckpointError(f"{side}: field '{name}' must be {want}, got {type(value).__name__} {brief(value)}")
    if "loss_scale" in obj and not 1 <= obj["loss_scale"] <= 2.0**24:
        raise CheckpointError(f"{side}: field 'loss_scale' must be in [1, 2**24], got {brief(obj['loss_scale'])}")
    if obj.get("loss_scale_good_steps", 0) < 0:
        raise CheckpointError(f"{side}: field 'loss_scale_good_steps' must be >= 0")
    params = obj.get("params", [])
    if not all(
        isinstance(p, list)
        and len(p) == 2
        and isinstance(p[0], str)
        and isinstance(p[1], list)
        and all(isinstance(d, int) and not isinstance(d, bool) for d in p[1])
        for p in params
    ):
        raise CheckpointError(f"{side}: field 'params' must be a list of [name, [sizes...]] pairs")
    return obj


def load(path: str | Path, n_params: int | None = None) -> tuple[Checkpoint, dict[str, Any]]:
    """The checkpoint and its sidecar ({} if none), checked against each other: the sidecar's sha256, step and
    n_params describe this .bin. CheckpointError naming the file otherwise."""
    ck = read_checkpoint(path, n_params)
    side = read_sidecar(path)
    if side.get("sha256", ck.sha256) != ck.sha256:
        raise CheckpointError(f"{path}: sha256 does not match its sidecar (checkpoint replaced or corrupt)")
    for name, value in (("step", ck.step), ("n_params", ck.weights.size)):
        if side.get(name, value) != value:
            raise CheckpointError(
                f"{sidecar_path(path)}: field '{name}' is {side[name]}, but the checkpoint's is {value}"
            )
    return ck, side


def verify_sha(path: str | Path) -> bool:
    """True when the sidecar's sha256 matches the .bin (or there is no sidecar to compare with)."""
    want = read_sidecar(path).get("sha256")
    if want is None:
        return True
    with open_input(path, "checkpoint", CheckpointError) as f:
        return hashlib.file_digest(f, "sha256").hexdigest() == want


def step_of(path: str | Path) -> int:
    """The step a checkpoint's file name says (step-<8 digits>.bin)."""
    return int(CKPT_RE.match(Path(path).name).group(1))


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Checkpoints in folder, newest step first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if CKPT_RE.match(p.name)]
    return sorted(found, key=step_of, reverse=True)


def remove_temp_files(folder: str | Path) -> list[Path]:
    """Delete the temp files of checkpoint writes a killed writer left in folder (each up to a checkpoint's size);
    the removed paths. Only the holder of the run folder's lock (runlock) may call this: no one else writes here."""
    folder = Path(folder)
    found = [p for p in folder.iterdir() if TEMP_RE.match(p.name)] if folder.is_dir() else []
    for p in found:
        p.unlink(missing_ok=True)
    return found


Loaded = tuple[Checkpoint, dict[str, Any]]  # a checkpoint and its sidecar, as load gives them


def latest_valid(
    folder: str | Path,
    n_params: int | None = None,
    max_step: int | None = None,
    on_skip: Callable[[Path, str], None] | None = None,
) -> Loaded | None:
    """The newest checkpoint (at most max_step) that reads back whole and matches its sidecar, with its sidecar, as
    load gives them; corrupt ones are skipped and kept on disk, each reported to on_skip(path, reason)."""
    for path in list_checkpoints(folder):
        if max_step is not None and step_of(path) > max_step:
            continue
        try:
            return load(path, n_params)
        except CheckpointError as e:
            reason = str(e)
        if on_skip is not None:
            on_skip(path, reason)
    return None


def latest_valid_checkpoint(
    folder: str | Path,
    n_params: int | None = None,
    max_step: int | None = None,
    on_skip: Callable[[Path, str], None] | None = None,
) -> Path | None:
    """The path of latest_valid's checkpoint, or None."""
    found = latest_valid(folder, n_params, max_step, on_skip)
    return None if found is None else found[0].path


def check_flag_path(path: str | Path, flag: str, folder: bool = False) -> None:
    """The checkpoint (or, with folder, the run folder) a flag names exists and is a regular file (or a folder):
    never a named pipe or a device, whose open would hang or never end. CheckpointError naming the flag."""
    what = "run folder or checkpoint" if folder else "checkpoint"
    try:
        input_kind(path, what, CheckpointError, folder)
    except FileNotFoundError:
        raise CheckpointError(f"{flag} {path}: no such {what}{'' if folder else ' file'}") from None
    except CheckpointError as e:
        raise CheckpointError(f"{flag} {e}") from None


def _folder_or_file(where: str | Path) -> tuple[Path, bool]:
    """(where, whether it is a run or ckpt folder); CheckpointError where it is neither a folder nor a file."""
    p = Path(where)
    what = "checkpoint" if p.suffix == ".bin" else "run folder or checkpoint"
    try:
        kind = input_kind(p, what, CheckpointError)  # a named pipe or a device: one line, never an open that hangs
    except FileNotFoundError:
        raise CheckpointError(f"{p}: no such {what}") from None
    if kind == "folder":
        return (p / "ckpt" if (p / "ckpt").is_dir() else p), True
    return p, False


def resolve_loaded(where: str | Path) -> Loaded:
    """A step-*.bin as given, or a run folder's (or a ckpt folder's) newest valid checkpoint, read once and checked
    against its sidecar (load)."""
    p, folder = _folder_or_file(where)
    if not folder:
        return load(p)
    found = latest_valid(p)
    if found is None:
        raise CheckpointError(f"{where}: no valid checkpoint in this folder")
    return found


def resolve(where: str | Path) -> Path:
    """A step-*.bin as given, or a run folder's (or a ckpt folder's) newest valid checkpoint."""
    p, folder = _folder_or_file(where)
    return resolve_loaded(p)[0].path if folder else p
