"""Checkpoints in the seed's binary format, plus a JSON sidecar for what the format has no room for.

    [int32 step][int32 n_params][n_params f32 weights][n_params f32 adam m][n_params f32 adam v]

little-endian, parameters in the canonical order (memory.param_shapes). The file is the same for every
backend and precision. Writes are atomic: a temp file in the same folder, fsync, rename, fsync of the
folder; so a reader (or a crash) never sees half a checkpoint and an existing file is only ever
replaced by a complete one. Readers check the size (8 + 12 * n_params) and n_params against the model
and say what is wrong in one sentence.

The sidecar `<name>.state.json` holds the config, seed, tokenizer, data sources, loss scale and the
sha256 of the .bin. This module does not depend on the training step.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from microgpt import config, memory
from microgpt.errors import InputError
from microgpt.fileio import atomic_write_bytes, atomic_write_json

HEADER = struct.Struct("<ii")
CKPT_RE = re.compile(r"^step-(\d{8})\.bin$")


class CheckpointError(InputError):
    """A missing, truncated, mismatched or corrupt checkpoint. str(err) is one line naming the file."""


@dataclass
class Checkpoint:
    step: int
    weights: np.ndarray  # (n_params,) float32
    m: np.ndarray
    v: np.ndarray
    path: Path


def ckpt_name(step: int) -> str:
    return f"step-{step:08d}.bin"


def sidecar_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name.removesuffix(".bin") + ".state.json")


def write_checkpoint(
    path: str | Path, step: int, weights: np.ndarray, m: np.ndarray, v: np.ndarray, meta: dict[str, Any] | None = None
) -> Path:
    """Write the seed-format file and its sidecar (the sidecar last: it names the .bin's sha256)."""
    path = Path(path)
    n = weights.size
    arrays = [np.ascontiguousarray(a, dtype="<f4").reshape(-1) for a in (weights, m, v)]
    if any(a.size != n for a in arrays):
        raise ValueError("weights, m and v must have the same number of elements")
    header = HEADER.pack(step, n)
    digest = hashlib.sha256(header)
    for a in arrays:
        digest.update(memoryview(a).cast("B"))
    atomic_write_bytes(path, [header, *(memoryview(a).cast("B") for a in arrays)])
    side = {"format": "microgpt-ckpt-1", "step": step, "n_params": n, "bin": path.name, "sha256": digest.hexdigest()}
    side.update(meta or {})
    atomic_write_json(sidecar_path(path), side)
    return path


def read_checkpoint(path: str | Path, n_params: int | None = None) -> Checkpoint:
    """Read and validate a checkpoint; CheckpointError with one sentence on anything wrong."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint not found") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint ({e.strerror})") from None
    if len(data) < HEADER.size:
        raise CheckpointError(f"{path}: truncated checkpoint: {len(data)} bytes, shorter than the 8-byte header")
    step, n = HEADER.unpack_from(data)
    if n <= 0 or step < 0:
        raise CheckpointError(f"{path}: corrupt header: step {step}, n_params {n}")
    expected = HEADER.size + 12 * n
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "oversized"
        raise CheckpointError(f"{path}: {what} checkpoint: {len(data)} bytes, expected {expected} for n_params {n}")
    if n_params is not None and n != n_params:
        raise CheckpointError(f"{path}: checkpoint holds {n} parameters but the model has {n_params}")
    flat = np.frombuffer(data, dtype="<f4", offset=HEADER.size).astype(np.float32)
    if not np.isfinite(flat[:n]).all():
        raise CheckpointError(f"{path}: weights contain NaN or inf")
    return Checkpoint(step, flat[:n], flat[n : 2 * n], flat[2 * n :], path)


def read_sidecar(path: str | Path) -> dict[str, Any]:
    side = sidecar_path(path)
    try:
        return json.loads(side.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{side}: unreadable checkpoint sidecar ({e})") from None


def verify_sha(path: str | Path) -> bool:
    """True when the sidecar's sha256 matches the .bin (or there is no sidecar to compare with)."""
    want = read_sidecar(path).get("sha256")
    return want is None or hashlib.sha256(Path(path).read_bytes()).hexdigest() == want


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


def latest_valid_checkpoint(folder: str | Path, n_params: int | None = None, max_step: int | None = None,
                            on_skip: Callable[[Path, str], None] | None = None) -> Path | None:  # fmt: skip
    """The newest checkpoint (at most max_step) that reads back whole and matches its sidecar; corrupt ones are
    skipped and kept on disk, each reported to on_skip(path, reason)."""
    for path in list_checkpoints(folder):
        if max_step is not None and step_of(path) > max_step:
            continue
        try:
            read_checkpoint(path, n_params)
            if verify_sha(path):
                return path
            reason = f"{path}: sha256 does not match its sidecar"
        except CheckpointError as e:
            reason = str(e)
        if on_skip is not None:
            on_skip(path, reason)
    return None


def resolve(where: str | Path) -> Path:
    """A step-*.bin as given, or a run folder's (or a ckpt folder's) newest valid checkpoint."""
    p = Path(where)
    if p.is_dir():
        found = latest_valid_checkpoint(p / "ckpt" if (p / "ckpt").is_dir() else p)
        if found is None:
            raise CheckpointError(f"{p}: no valid checkpoint in this folder")
        return found
    return p


@dataclass
class Trained:
    """A checkpoint read back with everything needed to use its model elsewhere (sample, chat, export, eval)."""

    path: Path
    exp: config.Experiment
    step: int
    weights: np.ndarray  # (n_params,) float32, canonical order
    side: dict[str, Any]

    def params(self) -> dict[str, np.ndarray]:
        """Named views of the weights, in the canonical order (memory.param_shapes)."""
        P, off = {}, 0
        for name, shape in memory.param_shapes(self.exp.model):
            n = int(np.prod(shape))
            P[name] = self.weights[off : off + n].reshape(shape)
            off += n
        return P


def load_trained(where: str | Path) -> Trained:
    """A step-*.bin or a run folder (its newest valid checkpoint), checked against its sidecar's model."""
    path = resolve(where)
    side = read_sidecar(path)
    if "config" not in side:
        raise config.ConfigError(f"{sidecar_path(path)}: missing (or has no 'config'): cannot rebuild the model")
    exp = config.from_dict(side["config"], str(sidecar_path(path)))
    saved = side.get("params")
    if saved is not None and [(k, tuple(v)) for k, v in saved] != memory.param_shapes(exp.model):
        raise CheckpointError(f"{sidecar_path(path)}: field 'params' does not match its 'config.model'; "
                              "checkpoint is for another model")  # fmt: skip
    try:
        ck = read_checkpoint(path, memory.n_params(exp.model))
    except CheckpointError as e:
        raise CheckpointError(f"{e} (the sidecar's model); checkpoint is for another model") from None
    if not verify_sha(path):
        raise CheckpointError(f"{path}: sha256 does not match its sidecar (checkpoint replaced?)")
    return Trained(path, exp, ck.step, ck.weights, side)
