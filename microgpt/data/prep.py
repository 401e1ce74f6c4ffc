"""prep (megachat): mix sources, render chats as ChatML, train or reuse a byte-level BPE tokenizer, and
write train/val token shards (llm.c layout), optional loss-mask shards and a manifest.json.

    microgpt prep --source data/hermes3.jsonl@2 --source notes/ --out data/megachat --vocab-size 8192 --loss-mask
    microgpt prep --builtin --out data/builtin --vocab-size 2048       # no network: the built-in corpus (corpus.py)
    microgpt prep --check data/megachat                                 # validate every shard header and token id
    microgpt prep --builtin --per-source --out data/builtin-split       # one subfolder of shards per source
    microgpt prep --experiment experiments/ANDREA-12M-TRAIN.json        # the experiment's data.prep recipe
    microgpt prep --builtin-chats 2000 --loss-mask --tokenizer runs/ANDREA-tiny/tokenizer.json --out data/tiny-chat

Sources: ShareGPT (Hermes-3) or OpenAI-`messages` records in .jsonl/.json/.parquet, {"text": ...} JSONL,
or plain text (a file is one document; a folder gives one document per .txt/.md/.py/.rst file); --builtin-chats N
adds N synthetic conversations (corpus.chat_set: a chat set made offline, for fine-tuning). A source of one
document is split in two (split_document: at the paragraph, else the line, nearest to val_fraction of its
characters from the end), so every source has val text; a document too short to split is refused, one line.
PATH@W weights a source: each document is repeated floor(W) times, plus once more with probability
frac(W), so W=0.5 keeps a random half and W=2 doubles it. Documents are split into train/val per
source before weighting (no copy of a val document reaches train), shuffled, and written as
<|endoftext|> doc <|endoftext|> doc ..., as llm.c does. Everything is deterministic for a given --seed.
The output is written to a temporary folder and moved into place at the end, so a failed run leaves
an existing corpus untouched. prep replaces only what it wrote: an existing --out must be empty or hold exactly
the files its manifest.json lists (the manifest, tokenizer.json, each shard and its mask; --per-source folders),
else it is refused, one line, and nothing is touched. --per-source writes each source's documents (same split, same
tokenizer at the top) into a subfolder of their own: the layout an online mixture trains on (microgpt/data/mixing.py).
--tokenizer bytes (implied by --vocab-size 256) writes raw UTF-8 bytes as tokens, documents separated by NUL.

As a library: prepare(sources, out, PrepSettings(...)) is all of the above for documents already read
(sources.read_source, corpus.builtin_sources); the train command builds the built-in corpus through it.
Bad input (flags, sources, a tokenizer, a shard under --check) raises an InputError subclass: one `error:`
line and exit 2 (microgpt/errors.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from microgpt import config
from microgpt.data import corpus, recipe, shards
from microgpt.data.sources import Doc, Source, read_source
from microgpt.data.tokenizer import SPECIAL_TOKENS, BPETokenizer, ByteTokenizer, load_tokenizer, train_bpe
from microgpt.errors import ArgParser, InputError, check_number, exit_on_input_error, output_error
from microgpt.fileio import read_json
from microgpt.runlock import pid_alive

Tokenizer = BPETokenizer | ByteTokenizer


# train takes shards whose tokenizer has model.vocab_size entries or up to PADDING - 1 fewer (a table padded for
# speed: GPT-2's 50,257 -> 50,304); prep refuses to train a tokenizer smaller than that (data/experiment.py)
PADDING = 128


class PrepError(InputError):
    """A bad prep flag or combination of flags. One line naming the flag."""


@dataclass
class PrepSettings:
    """How prepare() tokenizes, splits and writes; build is recorded in the manifest (the built-in cache's key)."""

    tokenizer: str = ""  # "" train a BPE of vocab_size entries | "bytes" | a tokenizer.json to reuse
    vocab_size: int = 2048
    val_fraction: float = 0.05
    seed: int = corpus.CORPUS_SEED
    loss_mask: bool = False
    per_source: bool = False
    shard_tokens: int = 100_000_000  # llm.c: 1e8
    tokenizer_bytes: int = 50_000_000  # text used to train BPE
    chunk: int = 512  # documents per parallel tokenize call
    quiet: bool = False
    window: int = 2  # tokens each split must hold: train reads windows of model.seq_len + 1 (--experiment's)
    window_of: str = ""  # where `window` comes from, for the error line
    vocab_of: str = ""  # where vocab_size comes from (the flag, or the experiment's field), for the error line
    build: dict = field(default_factory=dict)


def split_document(doc: Doc, val_fraction: float, where: str) -> list[Doc]:
    """One document as two, [train part, val part]: cut at the paragraph break (a blank line) nearest to
    val_fraction of its characters from the end, else at the nearest line break, else at that character. A chat
    document's assistant spans are cut with it. PrepError when it has fewer than two characters."""
    text = doc.text
    if len(text) < 2:
        raise PrepError(
            f"--source {where}: a single document of {len(text)} characters cannot be split into train and "
            "val text; give the source more text (or more documents)"
        )
    at = min(len(text) - 1, max(1, round(len(text) * (1 - val_fraction))))
    for sep in ("\n\n", "\n"):
        before, after = text.rfind(sep, 0, at + len(sep)), text.find(sep, at + 1)  # breaks starting <= at, > at
        cuts = [c + len(sep) for c in (before, after) if c >= 0 and 0 < c + len(sep) < len(text)]
        if cuts:
            at = min(cuts, key=lambda c: abs(c - at))
            break
    if doc.spans is None:
        return [Doc(text[:at]), Doc(text[at:])]
    head = [(a, min(b, at)) for a, b in doc.spans if a < at]
    tail = [(max(a, at) - at, b - at) for a, b in doc.spans if b > at]
    return [Doc(text[:at], head), Doc(text[at:], tail)]


def split_and_weight(
    sources: list[tuple[Source, list[Doc]]], val_fraction: float, seed: int
) -> dict[str, list[tuple[Source, Doc]]]:
    """Per-source train/val split of distinct documents, then the weights, then one shuffle per split. A source of
    one document gives a train and a val part of it (split_document): no split is ever empty."""
    rng = np.random.default_rng([seed, 0xDA7A])
    out: dict[str, list[tuple[Source, Doc]]] = {"train": [], "val": []}
    for src, docs in sources:
        if len(docs) == 1:
            docs = split_document(docs[0], val_fraction, src.name)
            order = np.array([1, 0])  # the val part first: it is the tail
        else:
            order = rng.permutation(len(docs))
        n_val = max(1, round(val_fraction * len(docs)))
        for split, idx in (("val", order[:n_val]), ("train", order[n_val:])):
            reps = np.floor(src.weight) + (rng.random(len(idx)) < src.weight % 1)
            picked = [(src, docs[i]) for i, r in zip(idx, reps) for _ in range(int(r))]
            src.documents[split] = len(picked)
            out[split] += picked
    for split in out:
        perm = rng.permutation(len(out[split]))
        out[split] = [out[split][i] for i in perm]
    return out


def tokenizer_texts(docs: list[tuple[Source, Doc]], max_bytes: int) -> list[str]:
    """Training text for BPE: the special tokens' strings are removed so no merge learns them."""
    texts, total = [], 0
    for _, doc in docs:
        text = doc.text
        for s in SPECIAL_TOKENS:
            text = text.replace(s, "\n")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def assistant_mask(starts: np.ndarray, spans: list[tuple[int, int]] | None) -> np.ndarray:
    """1 for tokens whose first character lies in an assistant span, else 0."""
    if not spans:
        return np.zeros(len(starts), dtype=np.uint8)
    lo = np.array([s for s, _ in spans])
    hi = np.array([e for _, e in spans])
    k = np.searchsorted(lo, starts, side="right") - 1
    return ((k >= 0) & (starts < hi[np.maximum(k, 0)])).astype(np.uint8)


def progress(label: str, done: int, total: int, tokens: int, t0: float, quiet: bool) -> None:
    """A one-line bar redrawn in place on a terminal; in a log (not a tty), only the final line."""
    if quiet or (done < total and not sys.stderr.isatty()):
        return
    dt = max(time.perf_counter() - t0, 1e-9)
    bar = "#" * int(30 * done / max(total, 1))
    end = "\n" if done == total else ""
    print(
        f"\r{label:5s} [{bar:30s}] {done}/{total} docs {tokens:,} tokens {tokens / dt:,.0f} tok/s",
        end=end,
        file=sys.stderr,
        flush=True,
    )


def write_split(
    tok: Tokenizer, docs: list[tuple[Source, Doc]], writer: shards.ShardWriter, chunk: int, quiet: bool
) -> None:
    """Tokenize in chunks (each chunk in parallel on all cores) and stream into shards."""
    t0 = time.perf_counter()
    eot = np.array([tok.eot_id], dtype=np.uint16)
    zero = np.zeros(1, dtype=np.uint8)
    for lo in range(0, len(docs), chunk):
        batch = docs[lo : lo + chunk]
        # Offsets (for the mask) make tokenizing slower; only chat documents need them.
        chat = [i for i, (_, d) in enumerate(batch) if writer.with_mask and d.spans]
        plain = [i for i in range(len(batch)) if not (writer.with_mask and batch[i][1].spans)]
        pairs: list = [None] * len(batch)
        for i, ids in zip(plain, tok.encode_batch([batch[i][1].text for i in plain])):
            pairs[i] = (ids, np.zeros(len(ids), dtype=np.uint8) if writer.with_mask else None)
        for i, (ids, starts) in zip(chat, tok.encode_batch_offsets([batch[i][1].text for i in chat])):
            pairs[i] = (ids, assistant_mask(starts, batch[i][1].spans))
        for (src, doc), (ids, mask) in zip(batch, pairs):
            writer.add(np.concatenate([eot, ids]), None if mask is None else np.concatenate([zero, mask]))
            src.tokens[writer.split] = src.tokens.get(writer.split, 0) + len(ids) + 1
            src.bytes[writer.split] = src.bytes.get(writer.split, 0) + len(doc.text.encode())
        progress(writer.split, min(lo + chunk, len(docs)), len(docs), writer.total, t0, quiet)


def get_tokenizer(train: list[tuple[Source, Doc]], tmp: Path, s: PrepSettings) -> tuple[Tokenizer, bool]:
    """The byte tokenizer, or reuse s.tokenizer (copied next to the shards), or train a BPE on the train split."""
    if s.tokenizer == "bytes":
        return ByteTokenizer(), False
    dest = tmp / "tokenizer.json"
    if s.tokenizer:
        load_tokenizer(s.tokenizer)  # a TokenizerError names the file
        shutil.copyfile(s.tokenizer, dest)
        return load_tokenizer(dest), False
    t0 = time.perf_counter()
    texts = tokenizer_texts(train, s.tokenizer_bytes)
    tok = train_bpe(texts, s.vocab_size)
    if tok.vocab_size <= s.vocab_size - PADDING:  # train would refuse these shards for a model of vocab_size
        raise PrepError(
            f"{s.vocab_of or f'--vocab-size {s.vocab_size}'}: the text ({sum(len(t) for t in texts):,} characters "
            f"of the train split) holds only enough to learn {tok.vocab_size:,} tokenizer entries; add text, or "
            f"use a vocabulary of {tok.vocab_size}"
        )
    tok.save(dest)
    if not s.quiet:
        print(f"trained BPE tokenizer, vocab {tok.vocab_size}, in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return load_tokenizer(dest), True


MANIFEST_FORMAT = "microgpt-shards-v1"


def manifest_files(manifest: Any) -> tuple[set[str], set[str]] | None:
    """(files, folders) a prep wrote, relative to its folder, as its manifest lists them: manifest.json, tokenizer.json
    (unless bytes), every shard of each split and, with loss_mask, each shard's mask; the --per-source folders. None
    when `manifest` is not one prep writes."""
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None
    splits, subs = manifest.get("splits"), manifest.get("per_source") or []
    if not isinstance(splits, dict) or not isinstance(subs, list) or not all(isinstance(d, str) for d in subs):
        return None
    files = {"manifest.json"} | ({"tokenizer.json"} if manifest.get("tokenizer") == "tokenizer.json" else set())
    for split in splits.values():
        names = split.get("shards") if isinstance(split, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) and n.endswith(".bin") for n in names):
            return None
        files |= set(names) | ({shards.mask_path(n).as_posix() for n in names} if manifest.get("loss_mask") else set())
    return files, set(subs)


def foreign_entry(out: Path) -> str | None:
    """The first thing in folder `out` (recursively, in sorted order) that no manifest.json of a prep there lists
    (manifest_files), as a path relative to `out`; "manifest.json" itself when there is no manifest of ours; None when
    prep wrote all of it."""
    try:
        owned = manifest_files(read_json(out / "manifest.json", "corpus manifest", PrepError))
    except (FileNotFoundError, PrepError):
        owned = None
    if owned is None:
        return "manifest.json"
    files, folders = owned
    for entry in sorted(out.rglob("*")):
        rel = entry.relative_to(out).as_posix()
        plain = entry.is_file() and not entry.is_symlink()  # a link is never ours, whatever it is named
        ours = rel in files if plain else rel in folders and entry.is_dir() and not entry.is_symlink()
        if not ours:
            return rel
    return None


def check_out(out: Path, flag: str = "--out") -> None:
    """`out` may be replaced by a prepared corpus: it is missing, an empty folder, or a corpus of an earlier prep
    and nothing else (foreign_entry: every file there listed by its manifest.json). A regular file, or a folder that
    holds anything prep did not write, is refused (PrepError) and left alone: prep never deletes what it did not
    write."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise PrepError(f"{flag} {out}: exists and is not a folder; prep writes a folder of shards there")
    if not out.is_dir() or not any(out.iterdir()):
        return
    foreign = foreign_entry(out)
    if foreign == "manifest.json":
        raise PrepError(
            f"{flag} {out}: a folder that holds no prepared corpus (no manifest.json of prep's); prep "
            "would replace it; choose a new or empty folder"
        )
    if foreign is not None:
        raise PrepError(
            f"{flag} {out}: holds {foreign}, which its manifest.json does not list; prep replaces only a "
            "corpus it wrote, so it leaves this folder alone; choose a new or empty folder"
        )


def remove_stale(out: Path) -> None:
    """Remove what a killed prep into `out` left beside it: its `.<out>.tmp-<pid>` (and `.old-<pid>`) folder, when
    that process is gone. A running prep's folders are left to it."""
    for leftover in out.parent.glob(f".{out.name}.*-*"):
        kind, _, pid = leftover.name[len(out.name) + 2 :].partition("-")
        if kind in ("tmp", "old") and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def prepare(sources: list[tuple[Source, list[Doc]]], out: Path, s: PrepSettings) -> dict:
    """Split, tokenize, write shards and manifest.json into a temp folder, then move it to `out` (check_out)."""
    check_out(out)
    remove_stale(out)
    splits = split_and_weight(sources, s.val_fraction, s.seed)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        tok, trained = get_tokenizer(splits["train"], tmp, s)
        groups = source_folders(sources) if s.per_source else {"": None}  # folder -> its source (all: None)
        written = {}
        for split in ("train", "val"):
            names, total = [], 0
            for sub, src in groups.items():
                (tmp / sub).mkdir(exist_ok=True)
                writer = shards.ShardWriter(tmp / sub, split, s.shard_tokens, s.loss_mask)
                write_split(tok, [d for d in splits[split] if src in (None, d[0])], writer, s.chunk, s.quiet)
                names, total = names + [f"{sub}/{n}" if sub else n for n in writer.close()], total + writer.total
            written[split] = {"shards": names, "tokens": total, "documents": len(splits[split])}
        check_windows(written, s)
        val_bytes = sum(src.bytes.get("val", 0) for src, _ in sources)
        manifest = {
            "format": MANIFEST_FORMAT,
            "shard_layout": {"magic": shards.TOKEN_MAGIC, "version": shards.VERSION, "dtype": "uint16"},
            "seed": s.seed,
            "vocab_size": tok.vocab_size,
            "tokenizer": "bytes" if isinstance(tok, ByteTokenizer) else "tokenizer.json",
            "tokenizer_sha256": tok.sha256,
            "tokenizer_trained": trained,
            "special_tokens": tok.special_ids(),
            "val_fraction": s.val_fraction,
            "loss_mask": s.loss_mask,
            "splits": written,
            "per_source": sorted(groups) if s.per_source else None,
            "val_bytes_per_token": round(val_bytes / max(written["val"]["tokens"], 1), 4),
            "sources": [asdict(src) for src, _ in sources],
            "skipped": sum(sum(src.skipped_by_reason.values()) for src, _ in sources),
            "build": s.build,
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        check_out(out)  # again: the folder may have changed while the corpus was made
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:  # a full disk (exit 4), a parent that is a file (exit 2): an existing corpus is intact
        raise output_error(e, f"--out {out}: cannot write the corpus") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def check_windows(written: dict[str, dict], s: PrepSettings) -> None:
    """Refuse (before anything is moved into place) a corpus whose train or val split holds less than one window of
    the experiment's model.seq_len + 1 tokens: `microgpt train` would refuse it."""
    for split, info in written.items():
        if info["tokens"] < s.window:
            raise PrepError(
                f"{split} split: {info['tokens']:,} tokens, fewer than one window of {s.window:,} "
                f"({s.window_of or 'two tokens'}) that train reads; add text, or change --val-fraction "
                f"({s.val_fraction})"
            )


def source_folders(sources: list[tuple[Source, list[Doc]]]) -> dict[str, Source]:
    """--per-source: one subfolder per source, named stdlib, synthetic-chat, or after the source path's stem."""
    out: dict[str, Source] = {}
    for src, _ in sources:
        builtin = src.kind in ("stdlib", "synthetic-chat")
        name = src.kind if builtin else re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(src.name).stem).strip(".-") or "source"
        if name in out:
            raise PrepError(f"--per-source: two sources would share the folder {name!r} ({src.name})")
        out[name] = src
    return out


# --- the command ----------------------------------------------------------------------------------------------
def check(directory: Path, vocab_size: int | None) -> int:
    """`prep --check`: every shard's header, size and ids; one `error:` line per bad shard (the last raised)."""
    if vocab_size is None and (directory / "tokenizer.json").exists():
        vocab_size = load_tokenizer(directory / "tokenizer.json").vocab_size
    n, errors = shards.check_dir(directory, vocab_size)
    for sub in sorted(p for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else []:  # --per-source
        k, more = shards.check_dir(sub, vocab_size)
        n, errors = n + k, errors + more
    for e in errors[:-1]:
        print(f"error: {e}", file=sys.stderr)
    if errors:
        raise shards.ShardError(errors[-1])
    if n == 0:
        raise shards.ShardError(f"{directory}: no train_*.bin or val_*.bin shards found")
    print(f"ok: {n} shards in {directory} (vocab_size {vocab_size})", file=sys.stderr)
    return 0


def parser() -> ArgParser:
    ap = ArgParser(prog="microgpt prep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", action="append", default=[], metavar="PATH[@W]", help="a source, weight W")
    ap.add_argument("--builtin", action="store_true", help="the offline corpus: stdlib source + synthetic chats")
    ap.add_argument("--builtin-chats", type=int, metavar="N", help="N synthetic chat conversations (offline)")
    ap.add_argument("--out", type=Path, help="output folder (default with --builtin: the train command's cache)")
    ap.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size (default: experiment's)")
    ap.add_argument("--tokenizer", help="reuse this tokenizer.json instead of training one; 'bytes': raw bytes")
    ap.add_argument("--experiment", help="take vocab size, tokenizer, val fraction and stdlib bytes from it")
    ap.add_argument("--val-fraction", type=float, default=None, help="share of each source's documents for val")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (llm.c: 1e8)")
    ap.add_argument("--loss-mask", action="store_true", help="also write loss-mask shards (assistant tokens = 1)")
    ap.add_argument("--per-source", action="store_true", help="one subfolder of shards per source (data mixing)")
    ap.add_argument("--seed", type=int, default=None, help=f"split, weights and shuffle (default {corpus.CORPUS_SEED})")
    ap.add_argument("--max-bytes", type=int, default=None, help="--builtin: stdlib bytes (default 4e6)")
    ap.add_argument("--tokenizer-bytes", type=int, default=50_000_000, help="text used to train BPE")
    ap.add_argument("--chunk", type=int, default=512, help="documents per parallel tokenize call")
    ap.add_argument("--check", type=Path, metavar="DIR", help="only validate the shards in DIR")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    return ap


def resolve(args: argparse.Namespace) -> tuple[PrepSettings, int]:
    """(settings, stdlib max bytes): defaults from --experiment (explicit flags win), then the built-in ones."""
    exp = config.load(args.experiment) if args.experiment else None
    base = config.Experiment() if exp is None else exp  # its defaults are the built-in corpus's
    vocab_size = base.model.vocab_size if args.vocab_size is None else args.vocab_size
    val_fraction = base.data.val_fraction if args.val_fraction is None else args.val_fraction
    max_bytes = base.data.max_bytes if args.max_bytes is None else args.max_bytes
    tokenizer = args.tokenizer
    if tokenizer is None and exp is not None:  # the same corpus (and cache folder) the train command would build
        tokenizer = "bytes" if corpus.uses_bytes(exp) else exp.data.tokenizer
    if tokenizer is None and vocab_size == 256:
        tokenizer = "bytes"
    vocab_flag = f"--vocab-size {vocab_size}"  # the flag, or the experiment field it came from
    if args.vocab_size is None and exp is not None:
        vocab_flag = f"{args.experiment}: model.vocab_size {vocab_size}"
    if not tokenizer and not 256 + len(SPECIAL_TOKENS) < vocab_size <= 65536:
        raise PrepError(
            f"{vocab_flag}: BPE needs more than {256 + len(SPECIAL_TOKENS)} entries "
            "(256 bytes + special tokens) and at most 65536; a vocabulary of 256 trains on raw bytes "
            "(--tokenizer bytes)"
        )
    check_number(val_fraction, "--val-fraction", 0, 1, lo_open=True, hi_open=True, error=PrepError)
    for flag in ("shard_tokens", "tokenizer_bytes", "chunk", "max_bytes"):  # a shard's header counts in int32
        if getattr(args, flag) is not None:
            check_number(
                getattr(args, flag), f"--{flag.replace('_', '-')}", 1, config.INT_MAX, integer=True, error=PrepError
            )
    if args.seed is not None:
        check_number(args.seed, "--seed", 0, config.SEED_MAX, integer=True, error=PrepError)
    settings = PrepSettings(
        tokenizer=tokenizer or "",
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        seed=corpus.CORPUS_SEED if args.seed is None else args.seed,
        loss_mask=args.loss_mask or args.builtin,  # the built-in corpus always carries masks (1 byte a token)
        per_source=args.per_source,
        shard_tokens=args.shard_tokens,
        tokenizer_bytes=args.tokenizer_bytes,
        chunk=args.chunk,
        quiet=args.quiet,
        window=exp.model.seq_len + 1 if exp else 2,
        window_of=f"{args.experiment}: model.seq_len + 1" if exp else "",
        vocab_of=vocab_flag,
    )
    return settings, max_bytes


def main(argv: list[str]) -> int:
    """`microgpt prep`; bad input raises an InputError (cli.py and the script print it as one line)."""
    args = parser().parse_args(recipe.expand(argv))  # `prep --experiment FILE` alone: FILE's data.prep
    if args.check:
        return check(args.check, args.vocab_size)
    if not (args.builtin or args.source or args.builtin_chats) or not (args.out or args.builtin):
        raise PrepError(
            "prep needs --builtin, --source PATH[@W] or --builtin-chats N (and --out DIR without "
            "--builtin), or --experiment FILE alone (its data.prep)"
        )
    if args.builtin_chats is not None:
        check_number(args.builtin_chats, "--builtin-chats", 1, config.INT_MAX, integer=True, error=PrepError)
    if args.per_source and not args.out:
        raise PrepError("--per-source needs --out DIR (the train command's built-in cache is one shard set)")
    if args.out:
        check_out(args.out)  # before any source is read
    s, max_bytes = resolve(args)
    t0 = time.perf_counter()
    sources, build, out = [], {"builtin": False, "sources": args.source, "python": sys.version.split()[0]}, args.out
    if args.builtin:
        build = corpus.builtin_settings(s.vocab_size, s.val_fraction, max_bytes, s.tokenizer, s.seed)
        sources = corpus.builtin_sources(build)
        out = out or corpus.builtin_dir(build)
        build = build if not args.source else {**build, "sources": args.source}
    build = {**build, "builtin_chats": args.builtin_chats} if args.builtin_chats else build
    sources += [read_source(spec) for spec in args.source]
    sources += [corpus.chat_set(args.builtin_chats, s.seed)] if args.builtin_chats else []
    manifest = prepare(sources, out, replace(s, build=build))
    if not s.quiet:
        tr, va = manifest["splits"]["train"], manifest["splits"]["val"]
        print(
            f"wrote {out}: train {tr['tokens']:,} tokens in {len(tr['shards'])} shards, val {va['tokens']:,}; "
            f"val bytes/token {manifest['val_bytes_per_token']}; {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_input_error(main, sys.argv[1:]))
