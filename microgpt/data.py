"""Token data for training: the batch for (step, micro) is a pure function of (seed, step, micro).

The built-in corpus needs no network: the Python standard library's own source files, read in a fixed
order from the running interpreter, tokenized byte by byte. Documents (files) are split between train
and validation by a hash of their path, so the split does not move when the corpus is capped.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np

from microgpt.config import ConfigError, Experiment


class ByteTokenizer:
    """Bytes are tokens: 256 ids, lossless on any text."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"kind": self.name, "vocab_size": self.vocab_size, "sha256": hashlib.sha256(b"bytes").hexdigest()}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def builtin_corpus(max_bytes: int, val_fraction: float) -> tuple[bytes, bytes]:
    """(train, val) text of the standard library's source, each document ended by a NUL separator."""
    train, val, total = [], [], 0
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files():
        data = path.read_bytes()
        rel = str(path.relative_to(root)).encode()
        bucket = int.from_bytes(hashlib.sha256(rel).digest()[:4], "little") / 2**32
        (val if bucket < val_fraction else train).append(data + b"\0")
        total += len(data) + 1
        if total >= max_bytes:
            break
    return b"".join(train), b"".join(val)


class Loader:
    """Random windows of T+1 tokens; (x, y) = (window[:-1], window[1:]), both int32 (B, T)."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, where: str = "data"):
        if tokens.size < seq_len + 2:
            raise ConfigError(f"{where}: only {tokens.size} tokens, fewer than seq_len + 2 = {seq_len + 2}")
        self.tokens, self.B, self.T, self.seed = tokens, batch_size, seq_len, seed
        self.offsets = np.arange(seq_len + 1)

    def _windows(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w = self.tokens[starts[:, None] + self.offsets].astype(np.int32)
        return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])

    def batch(self, step: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
        """The training batch of optimizer step `step` (0-based), micro-batch `micro`."""
        rng = np.random.default_rng([self.seed, step, micro])
        return self._windows(rng.integers(0, self.tokens.size - self.T - 1, size=self.B))

    def val_batch(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """The i-th validation batch: consecutive windows, the same for every run."""
        n_windows = (self.tokens.size - 1) // self.T
        idx = (np.arange(self.B) + i * self.B) % n_windows
        return self._windows(idx * self.T)


def make_tokenizer(exp: Experiment) -> ByteTokenizer:
    if exp.data.source != "builtin":
        raise ConfigError(f"data.source: unknown source {exp.data.source!r} (known: builtin)")
    if exp.model.vocab_size < ByteTokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size {exp.model.vocab_size} is smaller than the byte tokenizer's 256")
    return ByteTokenizer()


def make_loaders(exp: Experiment, batch_size: int) -> tuple[Loader, Loader]:
    """(train, val) loaders for the experiment's data section."""
    make_tokenizer(exp)
    train, val = builtin_corpus(exp.data.max_bytes, exp.data.val_fraction)
    B, T, seed = batch_size, exp.model.seq_len, exp.train.seed
    to_ids = lambda b: np.frombuffer(b, dtype=np.uint8).astype(np.uint16)  # noqa: E731
    return Loader(to_ids(train), B, T, seed, "builtin train"), Loader(to_ids(val), B, T, seed, "builtin val")


def data_description(exp: Experiment) -> dict:
    return {"source": exp.data.source, "max_bytes": exp.data.max_bytes, "val_fraction": exp.data.val_fraction}
