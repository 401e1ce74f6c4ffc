"""The experiment's "data" and "mixing" sections -> what a run trains on.

  source "builtin"  no network: the built-in corpus (microgpt/data/corpus.py: stdlib source plus synthetic chats),
                    prepared on first use into data.path or the cache, with the byte tokenizer (model.vocab_size
                    256 or data.tokenizer "bytes") or a byte-level BPE of model.vocab_size entries.
  source "shards"   data.path: a folder of train_*.bin / val_*.bin shards, `microgpt prep`'s or llm.c's;
                    or one subfolder of them per source (`prep --per-source`): a mixture, one source per
                    micro-batch, weighted by the experiment's "mixing" section (microgpt/data/mixing.py).
  data.tokenizer    "" (auto), "bytes", or a tokenizer.json (for shards that have none beside them).
  data.loss_mask    true: targets are -1 wherever the loss-mask shard is 0 (train on assistant tokens only).
  data.prep         shards: the `microgpt prep` arguments that make data.path (microgpt/data/recipe.py), so that
                    `microgpt prep --experiment FILE` makes them; check_data's error line gives that command.

config.py keeps the "mixing" section verbatim; `validate` here checks it (the CLI calls it on load, and
make_loaders builds from it), so the config layer knows nothing of the data layer.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from microgpt.config import ConfigError, Experiment
from microgpt.data import corpus, mixing, prep, recipe, shards
from microgpt.data.corpus import uses_bytes  # noqa: F401 (the CLI's name for it: microgpt.data.uses_bytes)
from microgpt.data.loader import ONE, Batches, Loader, MicroSchedule, Validation, open_split
from microgpt.data.tokenizer import SPECIAL_TOKENS, ByteTokenizer, file_sha256, load_tokenizer
from microgpt.errors import InputError, output_error
from microgpt.fileio import Anchor, atomic_write_bytes, read_json


def validate(exp: Experiment, src: str) -> Experiment:
    """The sections the data layer owns ("mixing"), field by field; ConfigError names src and the field."""
    if "mixing" in exp.extra:
        mixing.parse(exp.extra["mixing"], src)
    return exp


PADDING = prep.PADDING  # model.vocab_size may exceed the data's tokenizer by fewer ids than this


def check_data(exp: Experiment, experiment: str, where: str = "") -> None:
    """Data of source "shards" exist and were tokenized for this model, checked before anything is built or written:
    data.path is a folder, and its tokenizer has model.vocab_size entries or up to PADDING - 1 fewer (a table padded
    for speed); more would put ids past the model's table, far fewer means data prepared for another model. A
    ConfigError otherwise, one line ending with the prep command that makes the right data (recipe.prep_command).
    Shards with no tokenizer to read (llm.c's) are checked id by id as they load (shards.open_shard). where: what
    the line names first (default the experiment file; the proxy names the phase)."""
    if exp.data.source != "shards" or multi_source(exp, shard_dir(exp)):
        return
    folder, V = shard_dir(exp), exp.model.vocab_size
    make = f"make them with `{recipe.prep_command(exp, experiment)}`"
    where = where or experiment
    if not folder.is_dir():
        raise ConfigError(f"{where}: data.path {folder} does not exist (a folder of token shards); {make}")
    empty = next((split for split in ("train", "val") if not shards.list_shards(folder, split)), None)
    if empty is not None:  # the engine would find out only once a run folder was written and an engine started
        raise ConfigError(f"{where}: data.path {folder} holds no {empty} shards ({empty}_000000.bin); {make}")
    n, what = data_vocab(exp, folder)
    if n is None or n <= V < n + PADDING:
        return
    if n > V:
        raise ConfigError(
            f"{where}: data.path {folder}: {what} has {n:,} entries, more than model.vocab_size {V:,}: "
            f"prepared for another model; {make}"
        )
    raise ConfigError(  # the same prep command again could make the same tokenizer: say what else fixes it
        f"{where}: data.path {folder}: {what} has {n:,} entries, far fewer than model.vocab_size {V:,}: prepared "
        f"for another model, or from too little text to learn {V:,}; {make} from more text, or set "
        f"model.vocab_size {n}"
    )


def data_vocab(exp: Experiment, folder: Path) -> tuple[int | None, str]:
    """(the entries of the tokenizer the shards in folder were made with, what was read), (None, "") if unknown."""
    tok = exp.data.tokenizer or (folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else "")
    if str(tok) == "bytes":
        return 256, "the byte tokenizer"
    if tok:
        return load_tokenizer(tok).vocab_size, f"its tokenizer ({tok})"
    try:
        manifest = read_json(folder / "manifest.json", "corpus manifest")
    except (FileNotFoundError, InputError):
        return None, ""
    if isinstance(manifest, dict) and manifest.get("tokenizer") == "bytes":
        return 256, "its byte tokenizer (manifest.json)"
    return None, ""


def shard_dir(exp: Experiment) -> Path:
    """The folder of shards this experiment trains on (may not exist yet for "builtin")."""
    d = exp.data
    if d.source == "shards":
        if not d.path:
            raise ConfigError("data.path: required with data.source 'shards' (a folder of train_*.bin/val_*.bin)")
        return Path(d.path)
    if d.source != "builtin":
        raise ConfigError(f"data.source: unknown source {d.source!r} (known: builtin, shards)")
    return Path(d.path) if d.path else corpus.builtin_dir(corpus.settings_for(exp))


def built_with(folder: Path, settings: dict) -> bool | None:
    """True if folder holds a finished corpus built with these settings, False if another, None if none."""
    try:
        manifest = read_json(folder / "manifest.json", "corpus manifest")  # the strict reader; a bad one: another
    except FileNotFoundError:
        return None
    except InputError:
        return False
    return isinstance(manifest, dict) and manifest.get("build") == settings


def ensure_builtin(exp: Experiment, folder: Path) -> None:
    """Prepare the built-in corpus into folder unless one with the same settings is already there. What can be
    checked is checked before anything is made or said (a data.tokenizer to reuse, a corpus too small for one
    window of model.seq_len + 1: prep refuses it before it is moved into place). A lock file serializes builders
    (data-parallel ranks, or two runs, starting together build it once) and goes when the build ends."""
    settings = corpus.settings_for(exp)
    if built_with(folder, settings):
        return
    if settings["tokenizer"] == "bpe" and exp.model.vocab_size <= 256 + len(SPECIAL_TOKENS):
        raise ConfigError(
            f"model.vocab_size {exp.model.vocab_size}: BPE needs more than {256 + len(SPECIAL_TOKENS)} "
            "entries (256 bytes + special tokens); 256 trains on raw bytes"
        )
    tokenizer = "bytes" if uses_bytes(exp) else exp.data.tokenizer
    if tokenizer not in ("", "bytes"):
        load_tokenizer(tokenizer)  # a TokenizerError names the file, before the cache is touched
    with build_lock(folder.parent / f".{folder.name}.lock", "the built-in corpus cache"):
        found = built_with(folder, settings)
        if found:
            return
        if found is False and exp.data.path:  # the user's folder: never overwrite it silently
            raise ConfigError(f"data.path: {folder} holds a corpus built with other settings (manifest 'build')")
        if found is None and exp.data.path and folder.is_dir() and any(folder.iterdir()):
            raise ConfigError(f"data.path: {folder} is not empty and holds no built-in corpus; choose an empty folder")
        print(f"building the built-in corpus into {folder} (first use)", file=sys.stderr, flush=True)
        how = prep.PrepSettings(
            tokenizer=tokenizer,
            vocab_size=exp.model.vocab_size,
            val_fraction=settings["val_fraction"],
            seed=settings["seed"],
            loss_mask=True,
            quiet=True,
            window=exp.model.seq_len + 1,
            window_of="model.seq_len + 1; raise data.max_bytes",
            vocab_of=f"model.vocab_size {exp.model.vocab_size} (the built-in corpus of data.max_bytes "
            f"{exp.data.max_bytes})",
            build=settings,
        )
        prep.prepare(corpus.builtin_sources(settings), folder, how)


@contextlib.contextmanager
def build_lock(path: Path, what: str) -> Iterator[None]:
    """An exclusive flock on the lock file at path, held for the block; the file is removed before the lock is
    released. A waiter that then holds the flock of a removed file (no longer the one at path) opens it again, so
    two builders never hold it at once. An OS error making it is one line naming the folder and `what`."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    break
            except FileNotFoundError:
                pass  # removed by the builder we waited for: open it again
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
    except OSError as e:
        raise output_error(
            e, f"{path.parent}: cannot write {what} there (set data.path or MICROGPT_DATA_DIR)"
        ) from None
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def tokenizer_path(exp: Experiment) -> Path | None:
    if uses_bytes(exp):
        return None
    if exp.data.tokenizer:
        return Path(exp.data.tokenizer)
    path = shard_dir(exp) / "tokenizer.json"
    return path if path.exists() or exp.data.source == "builtin" else None


def make_loaders(exp: Experiment, batch_size: int, shard: tuple[int, int] = (0, 1)) -> tuple[Batches, Validation]:
    """(train, val) for the experiment's data section; shard=(rank, world_size): see microgpt/data/loader.py."""
    B, T, seed, micro = batch_size, exp.model.seq_len, exp.train.seed, MicroSchedule.of(exp.train)
    if exp.data.source == "builtin" and uses_bytes(exp) and exp.model.vocab_size < 256:
        raise ConfigError(f"model.vocab_size {exp.model.vocab_size} is smaller than the byte tokenizer's 256")
    folder = shard_dir(exp)
    if exp.data.source == "builtin":
        ensure_builtin(exp, folder)
    elif not folder.is_dir():
        raise ConfigError(f"data.path: {folder} is not a folder")
    tok = tokenizer_path(exp)
    if tok is not None and load_tokenizer(tok).vocab_size > exp.model.vocab_size:
        raise ConfigError(f"model.vocab_size {exp.model.vocab_size} is smaller than the tokenizer's ({tok})")
    check_doc_mask(exp, tok)
    if multi_source(exp, folder):  # one shard set per source: the FIREHOSE mixture (microgpt/data/mixing.py)
        return mixing.make_loaders(exp, folder, mixing.source_dirs(folder), B, shard)
    loaders = []
    for split in ("train", "val"):
        parts, masks = open_split(folder, split, exp)
        n = micro if split == "train" else ONE
        loaders.append(Loader(parts, B, T, seed, n, masks, f"{folder} {split}", shard))
    return loaders[0], Validation({"all": loaders[1]}, {"all": 1.0})


def check_doc_mask(exp: Experiment, tok: Path | None) -> None:
    """model.doc_mask must be the id of <|endoftext|> in the data's tokenizer (the byte tokenizer's NUL, 0), which
    prep puts before every document: ConfigError naming the field otherwise, or where the tokenizer is unknown."""
    want = exp.model.doc_mask
    if want < 0:
        return
    if uses_bytes(exp):
        eot, which = ByteTokenizer.eot_id, "the byte tokenizer's"
    elif tok is not None and tok.exists():
        eot, which = load_tokenizer(tok).eot_id, f"the tokenizer's ({tok})"
    else:
        raise ConfigError(
            f"model.doc_mask {want}: the data's tokenizer is unknown, so its <|endoftext|> is; set data.tokenizer"
        )
    if eot != want:
        raise ConfigError(f"model.doc_mask must be the data's <|endoftext|> id, {which} {eot}, got {want}")


def multi_source(exp: Experiment, folder: Path) -> bool:
    """True when the mixing section or the layout (one subfolder of shards per source) asks for a mixture."""
    return mixing.parse(exp.extra.get("mixing")).policy != "fixed" or bool(mixing.source_dirs(folder))


def tokenizer_info(exp: Experiment, out: Path | None = None, anchor: Anchor | None = None) -> dict:
    """What a checkpoint's .state.json records. With out, tokenizer.json is copied into the run folder
    (the tokenizer travels with the run; through anchor, the run folder's lock, where one is held: fileio.Anchor); a
    different one already there is an error, never overwritten."""
    if uses_bytes(exp):
        return ByteTokenizer().describe()
    path = tokenizer_path(exp)
    if path is None or not path.exists():
        return {"kind": "unknown", "note": "shards without a tokenizer.json (e.g. llm.c's): set data.tokenizer"}
    sha, vocab_size = file_sha256(path), load_tokenizer(path).vocab_size
    if out is not None:
        dest = Path(out) / "tokenizer.json"
        if dest.exists() and file_sha256(dest) != sha:
            raise ConfigError(f"{dest}: the run's tokenizer differs from {path} (sha256); use another --out")
        if not dest.exists():
            atomic_write_bytes(dest, [path.read_bytes()], anchor=anchor)
        path = dest
    return {"kind": "bpe", "path": str(path.resolve()), "sha256": sha, "vocab_size": vocab_size}


def data_description(exp: Experiment) -> dict:
    d = exp.data
    desc = {"source": d.source, "max_bytes": d.max_bytes, "val_fraction": d.val_fraction, "loss_mask": d.loss_mask}
    folder = shard_dir(exp)
    desc["path"] = str(folder)
    if (folder / "manifest.json").exists():
        desc["manifest_sha256"] = hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
    return desc
