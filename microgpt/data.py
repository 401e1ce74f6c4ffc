"""Token data for training: the batch for (step, micro) is a pure function of (seed, step, micro).

The experiment's "data" section picks the tokens:
  source "builtin"  no network: the shards of `microgpt prep --builtin` (the Python standard library's
                    source plus synthetic chats, byte-level BPE with model.vocab_size entries), built on
                    first use into data.path, or else $MICROGPT_DATA_DIR/builtin/v<vocab>-<key>, or else
                    <repo>/data/builtin/v<vocab>-<key>; the key hashes every build setting.
                    With model.vocab_size 256 (or data.tokenizer "bytes") the same stdlib text as raw bytes.
  source "shards"   data.path: a folder of train_*.bin / val_*.bin shards, `microgpt prep`'s or llm.c's;
                    or one subfolder of them per source (`prep --per-source`): a mixture, one source per
                    micro-batch, weighted by the experiment's "mixing" section (microgpt/mixing.py).
  data.tokenizer    "" (auto), "bytes", or a tokenizer.json (for shards that have none beside them).
  data.loss_mask    true: targets are -1 wherever the loss-mask shard is 0 (train on assistant tokens only).

Batches: each split is cut into windows of T+1 tokens at stride T (x = w[:-1], y = w[1:]) that never
cross a shard boundary. Row r of micro-batch `micro` of step `step` takes global position
p = ((step * n_micro) + micro) * B + r, i.e. window perm_e[p mod W] of epoch e = p // W, where perm_e is
a permutation drawn from (seed, e). So every window (every token) of an epoch is visited exactly once,
each epoch is reshuffled, and any batch is computed without the ones before it: resume is bit-exact.

Data parallel (microgpt/distributed.py): `shard=(rank, world_size)` makes B the per-process micro-batch of
a global micro-batch of world_size * B rows, of which this process reads rows [rank*B, (rank+1)*B); so N
processes with micro-batch b read exactly the rows of one process with micro-batch N*b (validation alike).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import numpy as np

from microgpt import shards
from microgpt.config import ConfigError, Experiment

REPO = Path(__file__).resolve().parent.parent
STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "site-packages", "encodings", "__pycache__", "turtledemo"}


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
    """The running interpreter's standard library .py files, sorted by relative path (deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not STDLIB_SKIP.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def builtin_corpus(max_bytes: int, val_fraction: float) -> tuple[bytes, bytes]:
    """(train, val) stdlib source as bytes, each document ended by NUL; split by a hash of the path."""
    train, val, total = [], [], 0
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files():
        data = path.read_bytes()
        rel = path.relative_to(root).as_posix().encode()
        bucket = int.from_bytes(hashlib.sha256(rel).digest()[:4], "little") / 2**32
        (val if bucket < val_fraction else train).append(data + b"\0")
        total += len(data) + 1
        if total >= max_bytes:
            break
    return b"".join(train), b"".join(val)


class Loader:
    """Windows of T+1 tokens over one split's shards (memmaps); (x, y) int32 (B, T), y = -1 where masked."""

    def __init__(self, parts: list[np.ndarray], batch_size: int, seq_len: int, seed: int, n_micro: int = 1,
                 masks: list[np.ndarray] | None = None, where: str = "data",
                 shard: tuple[int, int] = (0, 1)):  # fmt: skip
        self.parts, self.masks = parts, masks
        self.B, self.T, self.seed, self.n_micro = batch_size, seq_len, seed, n_micro
        rank, world = shard
        if not 0 <= rank < world:
            raise ValueError(f"shard={shard}: need 0 <= rank < world_size")
        self.row0, self.global_B = rank * batch_size, world * batch_size  # this rank's rows of the global batch
        counts = np.array([max(0, (len(p) - 1) // seq_len) for p in parts], dtype=np.int64)
        self.n_windows = int(counts.sum())
        if self.n_windows == 0:
            n = sum(len(p) for p in parts)
            raise ConfigError(f"{where}: {n} tokens, no shard holds seq_len + 1 = {seq_len + 1}")
        self.first = np.concatenate([[0], np.cumsum(counts)])  # first global window of each part
        self._perms: dict[int, np.ndarray] = {}  # memo only: at most two epochs (a batch may straddle one)

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            self._perms[epoch] = np.random.default_rng([self.seed, epoch, 0xDA7A]).permutation(self.n_windows)
        return self._perms[epoch]

    def _windows(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        part = np.searchsorted(self.first, g, side="right") - 1
        off = (g - self.first[part]) * self.T
        x = np.empty((len(g), self.T), dtype=np.int32)
        y = np.empty((len(g), self.T), dtype=np.int32)
        for r, (k, o) in enumerate(zip(part, off)):
            w = self.parts[k][o : o + self.T + 1]
            x[r], y[r] = w[:-1], w[1:]
            if self.masks is not None:
                y[r][self.masks[k][o + 1 : o + self.T + 1] == 0] = -1
        return x, y

    def _positions_at(self, k: int) -> np.ndarray:
        p = k * self.global_B + self.row0 + np.arange(self.B, dtype=np.int64)
        epoch, idx = np.divmod(p, self.n_windows)
        return np.array([self._perm(int(e))[i] for e, i in zip(epoch, idx)], dtype=np.int64)

    def batch(self, step: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
        """The training batch of optimizer step `step` (0-based), micro-batch `micro`."""
        if not 0 <= micro < self.n_micro or step < 0:
            raise ValueError(f"batch(step={step}, micro={micro}): need step >= 0 and 0 <= micro < {self.n_micro}")
        return self.batch_at(step * self.n_micro + micro)

    def batch_at(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k-th micro-batch of this loader's sequence (batch(step, micro) is batch_at(step * n_micro + micro));
        mixing.MixtureLoader reads each source's sequence at its own pace."""
        return self._windows(self._positions_at(k))

    def val_batch(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """The i-th validation batch: consecutive windows in file order, the same for every run."""
        rows = np.arange(self.B, dtype=np.int64) + i * self.global_B + self.row0
        return self._windows(rows % self.n_windows)


# --- which tokens: resolve the data section, build the built-in corpus on first use -------------------------
def cache_root() -> Path:
    if os.environ.get("MICROGPT_DATA_DIR"):
        return Path(os.environ["MICROGPT_DATA_DIR"])
    return REPO / "data" if (REPO / "pyproject.toml").exists() else Path("data")


def uses_bytes(exp: Experiment) -> bool:
    """The byte tokenizer: asked for, or implied by a 256-entry vocabulary (too small for BPE + specials)."""
    return exp.data.tokenizer == "bytes" or (exp.data.tokenizer == "" and exp.model.vocab_size == 256)


def builtin_settings(exp: Experiment) -> dict:
    from microgpt import prep

    d = exp.data
    return prep.builtin_settings(exp.model.vocab_size, d.val_fraction, d.max_bytes, d.tokenizer)


def shard_dir(exp: Experiment) -> Path:
    """The folder of BPE shards this experiment trains on (may not exist yet for "builtin")."""
    from microgpt import prep

    d = exp.data
    if d.source == "shards":
        if not d.path:
            raise ConfigError("data.path: required with data.source 'shards' (a folder of train_*.bin/val_*.bin)")
        return Path(d.path)
    if d.source != "builtin":
        raise ConfigError(f"data.source: unknown source {d.source!r} (known: builtin, shards)")
    return Path(d.path) if d.path else prep.builtin_dir(builtin_settings(exp))


def built_with(folder: Path, settings: dict) -> bool | None:
    """True if folder holds a finished corpus built with these settings, False if another, None if none."""
    try:
        return json.loads((folder / "manifest.json").read_text()).get("build") == settings
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError):
        return False


def ensure_builtin(exp: Experiment, folder: Path) -> None:
    """Run `microgpt prep --builtin` into folder unless a corpus with the same settings is already there.
    A lock file serializes builders: data-parallel ranks (or two runs) starting together build it once."""
    from microgpt import prep

    settings = builtin_settings(exp)
    if built_with(folder, settings):
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        found = built_with(folder, settings)
        if found:
            return
        if found is False and exp.data.path:  # the user's folder: never overwrite it silently
            raise ConfigError(f"data.path: {folder} holds a corpus built with other settings (manifest 'build')")
        if found is None and exp.data.path and folder.is_dir() and any(folder.iterdir()):
            raise ConfigError(f"data.path: {folder} is not empty and holds no built-in corpus; choose an empty folder")
        d = exp.data
        print(f"building the built-in corpus into {folder} (first use)", file=sys.stderr, flush=True)
        argv = ["--builtin", "--out", str(folder), "--vocab-size", str(exp.model.vocab_size), "--val-fraction",
                str(d.val_fraction), "--max-bytes", str(d.max_bytes), "--loss-mask", "--quiet"]  # fmt: skip
        prep.main(argv + (["--tokenizer", d.tokenizer] if d.tokenizer else []))


def tokenizer_path(exp: Experiment) -> Path | None:
    if uses_bytes(exp):
        return None
    if exp.data.tokenizer:
        return Path(exp.data.tokenizer)
    path = shard_dir(exp) / "tokenizer.json"
    return path if path.exists() or exp.data.source == "builtin" else None


def open_split(folder: Path, split: str, exp: Experiment) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    paths = shards.list_shards(folder, split)
    if not paths:
        raise ConfigError(f"data.path: {folder} has no {split}_*.bin shards (run `microgpt prep`)")
    parts = [shards.open_shard(p, "tokens", exp.model.vocab_size) for p in paths]
    if not exp.data.loss_mask:
        return parts, None
    missing = [shards.mask_path(p) for p in paths if not shards.mask_path(p).exists()]
    if missing:
        raise ConfigError(f"data.loss_mask: {missing[0]} is missing (prepare with `microgpt prep --loss-mask`)")
    return parts, [shards.open_mask(p, len(t)) for p, t in zip(paths, parts)]


def make_loaders(exp: Experiment, batch_size: int, shard: tuple[int, int] = (0, 1)) -> tuple[Loader, Loader]:
    """(train, val) loaders for the experiment's data section; shard=(rank, world_size): see the docstring."""
    B, T, seed, n_micro = batch_size, exp.model.seq_len, exp.train.seed, exp.train.n_micro
    if exp.data.source == "builtin" and uses_bytes(exp):
        if exp.model.vocab_size < 256:
            raise ConfigError(f"model.vocab_size {exp.model.vocab_size} is smaller than the byte tokenizer's 256")
        if multi_source(exp, None):
            raise ConfigError("mixing.policy: the byte-level built-in corpus is one stream; a mixture needs one "
                              "shard set per source (microgpt prep --builtin --per-source)")  # fmt: skip
        train, val = builtin_corpus(exp.data.max_bytes, exp.data.val_fraction)
        ids = [np.frombuffer(b, dtype=np.uint8).astype(np.uint16) for b in (train, val)]
        return Loader([ids[0]], B, T, seed, n_micro, None, "builtin train", shard), Loader(
            [ids[1]], B, T, seed, 1, None, "builtin val", shard
        )
    folder = shard_dir(exp)
    if exp.data.source == "builtin":
        ensure_builtin(exp, folder)
    elif not folder.is_dir():
        raise ConfigError(f"data.path: {folder} is not a folder")
    tok = tokenizer_path(exp)
    if tok is not None:
        from microgpt.tokenizer import load_tokenizer

        if load_tokenizer(tok).vocab_size > exp.model.vocab_size:
            raise ConfigError(f"model.vocab_size {exp.model.vocab_size} is smaller than the tokenizer's ({tok})")
    if multi_source(exp, folder):  # one shard set per source: the FIREHOSE mixture (microgpt/mixing.py)
        from microgpt import mixing

        return mixing.make_loaders(exp, folder, mixing.source_dirs(folder), B, shard)
    loaders = []
    for split in ("train", "val"):
        parts, masks = open_split(folder, split, exp)
        n = n_micro if split == "train" else 1
        loaders.append(Loader(parts, B, T, seed, n, masks, f"{folder} {split}", shard))
    return loaders[0], loaders[1]


def multi_source(exp: Experiment, folder: Path | None) -> bool:
    """True when the mixing section or the layout (one subfolder of shards per source) asks for a mixture."""
    from microgpt import mixing

    if mixing.parse(exp.extra.get("mixing")).policy != "fixed":
        return True
    return folder is not None and bool(mixing.source_dirs(folder))


def tokenizer_info(exp: Experiment, out: Path | None = None) -> dict:
    """What a checkpoint's .state.json records. With out, tokenizer.json is copied into the run folder
    (the tokenizer travels with the run); a different one already there is an error, never overwritten."""
    if uses_bytes(exp):
        return ByteTokenizer().describe()
    path = tokenizer_path(exp)
    if path is None or not path.exists():
        return {"kind": "unknown", "note": "shards without a tokenizer.json (e.g. llm.c's): set data.tokenizer"}
    from microgpt.tokenizer import file_sha256, load_tokenizer

    sha = file_sha256(path)
    if out is not None:
        dest = Path(out) / "tokenizer.json"
        if dest.exists() and file_sha256(dest) != sha:
            raise ConfigError(f"{dest}: the run's tokenizer differs from {path} (sha256); use another --out")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists():
            shutil.copyfile(path, dest)
        path = dest
    return {"kind": "bpe", "path": str(path.resolve()), "sha256": sha, "vocab_size": load_tokenizer(path).vocab_size}


def data_description(exp: Experiment) -> dict:
    d = exp.data
    desc = {"source": d.source, "max_bytes": d.max_bytes, "val_fraction": d.val_fraction, "loss_mask": d.loss_mask}
    if not (d.source == "builtin" and uses_bytes(exp)):
        folder = shard_dir(exp)
        desc["path"] = str(folder)
        if (folder / "manifest.json").exists():
            desc["manifest_sha256"] = hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
    return desc
