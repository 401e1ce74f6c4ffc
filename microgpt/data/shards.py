"""Token shards in llm.c's layout (dev/data/data_common.py), read by memmap as in nanoGPT.

A shard is a 256 x int32 little-endian header, then the payload:
    header[0] magic     20240520 for tokens (llm.c's GPT-2 shards), 20240521 for loss masks (ours)
    header[1] version   1
    header[2] count     number of tokens (or mask entries) that follow
    payload             count x uint16 token ids, or count x uint8 mask values (1 = train on this token)
The rest of the header is zero. Token shards written here are byte-identical to llm.c's, so its
FineWeb/TinyStories shards load unchanged, under llm.c's own names too: a file is a shard of split "train"
(or "val") when that word is one "_"-separated part of its name (train_000000.bin, fineweb_train_000001.bin,
TinyStories_train.bin). A loss-mask shard sits next to its token shard
(train_000000.bin -> train_000000.mask.bin) and has the same count.

Every reader checks every header field and the file size, and rejects what it does not understand
with one line naming the file and the field (ShardError).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from microgpt.errors import InputError
from microgpt.fileio import atomic_write_bytes, open_input

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_MAGIC = 20240520
MASK_MAGIC = 20240521
VERSION = 1
KINDS = {"tokens": (TOKEN_MAGIC, np.uint16), "mask": (MASK_MAGIC, np.uint8)}
# Seen in the wild: llm.c's Llama-3 shards (uint32 ids). Named in the error so the hint is useful.
KNOWN_OTHER = {20240801: "llm.c Llama-3 shard (uint32 tokens), not supported"}


class ShardError(InputError):
    """A shard that cannot be used. str(err) is the whole one-line message (the CLI's `error:` line)."""


def mask_path(path: str | Path) -> Path:
    """The loss-mask shard that belongs to token shard `path`."""
    path = Path(path)
    return path.with_name(path.name[: -len(".bin")] + ".mask.bin")


def is_split_shard(name: str, split: str) -> bool:
    """Whether file `name` is a token shard of `split`: the split is one "_"-separated word of the name, as in
    ours (train_000000.bin) and llm.c's (fineweb_train_000001.bin, TinyStories_train.bin, tiny_shakespeare_val.bin)."""
    if not name.endswith(".bin") or name.endswith(".mask.bin"):
        return False
    return split in name.removesuffix(".bin").split("_")


def list_shards(directory: str | Path, split: str) -> list[Path]:
    """Token shards of one split in `directory`, in name order (see is_split_shard)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if is_split_shard(p.name, split) and p.is_file())


def write_shard(path: str | Path, values: NDArray, kind: str = "tokens") -> None:
    """Write one shard atomically (temp file + rename), so a crash never leaves half a shard behind."""
    magic, dtype = KINDS[kind]
    values = np.asarray(values)
    if values.ndim != 1:
        raise ValueError(f"{path}: a shard holds a 1-D array, got shape {values.shape}")
    if values.size and (values.min() < 0 or values.max() > np.iinfo(dtype).max):
        raise ValueError(f"{path}: values out of range for {np.dtype(dtype).name}")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (magic, VERSION, values.size)
    body = values.astype(np.dtype(dtype).newbyteorder("<"), copy=False)
    atomic_write_bytes(Path(path), [header.tobytes(), body.tobytes()], sync_dir=False)


def read_header(path: str | Path, kind: str = "tokens") -> int:
    """Check magic, version and count against the file size; return the count."""
    magic, dtype = KINDS[kind]
    path = Path(path)
    try:
        with open_input(path, "shard", ShardError) as f:  # a regular file: a named pipe or a device is refused
            size, raw = os.fstat(f.fileno()).st_size, f.read(HEADER_BYTES)
    except OSError as e:
        raise ShardError(f"{path}: cannot read shard ({e.strerror})") from None
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"{path}: field 'header' has {len(raw)} bytes, expected {HEADER_BYTES} (truncated file?)")
    header = np.frombuffer(raw, dtype="<i4")
    if header[0] != magic:
        hint = KNOWN_OTHER.get(int(header[0]), f"not a microgpt/llm.c {kind} shard")
        raise ShardError(f"{path}: field 'magic' is {header[0]}, expected {magic} ({hint})")
    if header[1] != VERSION:
        raise ShardError(f"{path}: field 'version' is {header[1]}, expected {VERSION} (written by a newer tool?)")
    count = int(header[2])
    expected = HEADER_BYTES + count * np.dtype(dtype).itemsize
    if count < 0 or size != expected:
        raise ShardError(
            f"{path}: field 'count' is {count}, which needs a file of {expected} bytes, "
            f"but the file has {size} bytes (truncated or corrupt shard)"
        )
    return count


def open_shard(path: str | Path, kind: str = "tokens", vocab_size: int | None = None) -> NDArray:
    """Memory-map a validated shard. With vocab_size, also check every token id is < vocab_size
    (one linear pass over the file; a mask must hold only 0 and 1)."""
    count = read_header(path, kind)
    _, dtype = KINDS[kind]
    if count == 0:
        return np.zeros(0, dtype=dtype)
    data = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", offset=HEADER_BYTES, shape=(count,))
    if kind == "tokens" and vocab_size is not None:
        top = int(data.max())
        if top >= vocab_size:
            where = int(np.argmax(data >= vocab_size))
            raise ShardError(
                f"{path}: field 'tokens' holds id {top} >= vocab_size {vocab_size} (first at index {where}); "
                "was it written with another tokenizer?"
            )
    if kind == "mask" and int(data.max()) > 1:
        raise ShardError(f"{path}: field 'mask' holds {int(data.max())}, expected only 0 and 1")
    return data


def read_tokens(paths: list[Path], vocab_size: int | None = None) -> NDArray[np.uint16]:
    """All tokens of several shards, concatenated in memory (for tests and small corpora)."""
    parts = [np.asarray(open_shard(p, "tokens", vocab_size)) for p in paths]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def open_mask(token_path: str | Path, n: int) -> NDArray:
    """The loss-mask shard of a token shard of n tokens; a count other than n is a ShardError."""
    mask = open_shard(mask_path(token_path), "mask")
    if len(mask) != n:
        raise ShardError(f"{mask_path(token_path)}: field 'count' is {len(mask)}, expected {n} (its token shard)")
    return mask


def check_dir(directory: str | Path, vocab_size: int | None) -> tuple[int, list[str]]:
    """Validate every shard (and mask shard) in a prepared folder. Returns (n_shards, error lines)."""
    errors: list[str] = []
    shards = list_shards(directory, "train") + list_shards(directory, "val")
    for path in shards:
        try:
            n = len(open_shard(path, "tokens", vocab_size))
            if mask_path(path).exists():
                open_mask(path, n)
        except ShardError as e:
            errors.append(str(e))
    return len(shards), errors


class ShardWriter:
    """Streams token arrays (documents) into shards of exactly shard_tokens each (the last one shorter);
    a document may span two shards, as in llm.c."""

    def __init__(self, out: Path, split: str, shard_tokens: int, with_mask: bool):
        """Shards are named <split>_000000.bin, ... in out; with_mask: each add() brings a uint8 mask too."""
        self.out, self.split, self.shard_tokens, self.with_mask = out, split, shard_tokens, with_mask
        self.toks: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.pending = 0
        self.names: list[str] = []
        self.total = 0

    def add(self, tokens: NDArray, mask: NDArray | None) -> None:
        self.toks.append(tokens)
        if self.with_mask:
            self.masks.append(mask)
        self.pending += len(tokens)
        self.total += len(tokens)
        while self.pending >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def _flush(self, n: int) -> None:
        toks = np.concatenate(self.toks)
        name = f"{self.split}_{len(self.names):06d}.bin"
        write_shard(self.out / name, toks[:n])
        self.toks = [toks[n:]]
        if self.with_mask:
            masks = np.concatenate(self.masks)
            write_shard(mask_path(self.out / name), masks[:n], kind="mask")
            self.masks = [masks[n:]]
        self.pending -= n
        self.names.append(name)

    def close(self) -> list[str]:
        if self.pending:
            self._flush(self.pending)
        return self.names
