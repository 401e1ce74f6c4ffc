"""prep (megachat): mix sources, render chats as ChatML, train or reuse a byte-level BPE tokenizer, and
write train/val token shards (llm.c layout), optional loss-mask shards and a manifest.json.

    microgpt prep --source data/hermes3.jsonl@2 --source notes/ --out data/megachat --vocab-size 8192 --loss-mask
    microgpt prep --builtin --out data/builtin --vocab-size 2048       # no network: stdlib source + synthetic chats
    microgpt prep --check data/megachat                                 # validate every shard header and token id
    microgpt prep --builtin --per-source --out data/builtin-split       # one subfolder of shards per source

Sources: ShareGPT (Hermes-3) or OpenAI-`messages` records in .jsonl/.json/.parquet, {"text": ...} JSONL,
or plain text (a file is one document; a folder gives one document per .txt/.md/.py/.rst file).
PATH@W weights a source: each document is repeated floor(W) times, plus once more with probability
frac(W), so W=0.5 keeps a random half and W=2 doubles it. Documents are split into train/val per
source before weighting (no copy of a val document reaches train), shuffled, and written as
<|endoftext|> doc <|endoftext|> doc ..., as llm.c does. Everything is deterministic for a given --seed.
The output is written to a temporary folder and moved into place at the end, so a failed run leaves
an existing corpus untouched. --per-source writes each source's documents (same split, same tokenizer at
the top) into a subfolder of their own: the layout an online mixture trains on (microgpt/mixing.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from microgpt import data, hermes, shards
from microgpt.chat import parse_record, render, synthetic_conversations
from microgpt.tokenizer import SPECIAL_TOKENS, BPETokenizer, TokenizerError, file_sha256, load_tokenizer, train_bpe

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".text"}
CHAT_SUFFIXES = set(hermes.SUFFIXES)


@dataclass
class Doc:
    text: str
    spans: list[tuple[int, int]] | None = None  # assistant spans (chat) or None (plain text)


@dataclass
class Source:
    name: str
    kind: str  # chat | text | stdlib | synthetic-chat
    weight: float = 1.0
    documents_read: int = 0
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    documents: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)


def parse_source(spec: str) -> tuple[Path, float]:
    path, at, w = spec.rpartition("@")
    if at:
        try:
            return Path(path), float(w)
        except ValueError:
            pass
    return Path(spec), 1.0


def read_text_file(path: Path, src: Source) -> Doc | None:
    try:
        return Doc(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        src.skipped_by_reason["invalid utf-8"] = src.skipped_by_reason.get("invalid utf-8", 0) + 1
        return None


def read_chat(paths: list[Path], src: Source) -> list[Doc]:
    report = hermes.Report()
    docs = []
    for path in paths:
        try:
            for loc, record, reason in hermes.iter_records(path):
                if not reason and isinstance(record, dict) and isinstance(record.get("text"), str):
                    docs.append(Doc(record["text"]))  # plain-text JSONL ({"text": ...}), common for pretraining
                    continue
                messages = parse_record(record) if not reason else reason
                if isinstance(messages, str):
                    report.skip(messages, loc)
                    continue
                text, spans = render(messages)
                docs.append(Doc(text, spans))
        except hermes.InputError as e:
            raise SystemExit(f"error: {e}") from None
    src.skipped_by_reason = dict(sorted(report.skipped.items()))
    return docs


def read_source(spec: str) -> tuple[Source, list[Doc]]:
    path, weight = parse_source(spec)
    if not path.exists():
        raise SystemExit(f"error: {path}: source not found (--source {spec})")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    chat = [p for p in files if p.suffix in CHAT_SUFFIXES]
    if chat:
        src = Source(str(path), "chat", weight)
        docs = read_chat(chat, src)
    else:
        src = Source(str(path), "text", weight)
        texts = [p for p in files if p.suffix in TEXT_SUFFIXES or not path.is_dir()]
        docs = [d for d in (read_text_file(p, src) for p in texts) if d is not None]
    src.documents_read = len(docs)
    if not docs:
        raise SystemExit(f"error: {path}: source has no usable documents (skipped: {src.skipped_by_reason or 'none'})")
    return src, docs


CORPUS_SEED = 1337  # split, weights and shuffle; not the training seed: runs with other seeds share a corpus


def builtin_settings(
    vocab_size: int, val_fraction: float, max_bytes: int, tokenizer: str = "", seed: int = CORPUS_SEED
) -> dict:
    """Everything the built-in corpus depends on; its hash names the cache folder, the manifest keeps it.
    tokenizer: a given tokenizer.json (its hash counts), or "" to train one. About one synthetic chat per 800
    stdlib bytes: chats are ~25% of the text."""
    tokenizer_sha = file_sha256(tokenizer) if tokenizer and Path(tokenizer).is_file() else None
    return {"builtin": True, "vocab_size": vocab_size, "val_fraction": val_fraction, "max_bytes": max_bytes,
            "chats": max_bytes // 800, "seed": seed, "tokenizer_sha256": tokenizer_sha,
            "python": sys.version.split()[0], "format": 1}  # fmt: skip


def builtin_dir(settings: dict) -> Path:
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    return data.cache_root() / "builtin" / f"v{settings['vocab_size']}-{key}"


def builtin_sources(max_bytes: int, n_chats: int, seed: int) -> list[tuple[Source, list[Doc]]]:
    src = Source(f"stdlib:{sysconfig.get_paths()['stdlib']}", "stdlib")
    docs, total = [], 0
    for path in data.stdlib_files():
        doc = read_text_file(path, src)
        if doc is None:
            continue
        if total + len(doc.text.encode()) > max_bytes:
            break  # the cap keeps `prep --builtin` fast on a 2-core CI machine
        docs.append(doc)
        total += len(doc.text.encode())
    src.documents_read = len(docs)
    chats = Source("synthetic-chat", "synthetic-chat")
    chat_docs = [Doc(*render(m)) for m in synthetic_conversations(n_chats, seed)]
    chats.documents_read = len(chat_docs)
    return [(src, docs), (chats, chat_docs)]


def split_and_weight(
    sources: list[tuple[Source, list[Doc]]], val_fraction: float, seed: int
) -> dict[str, list[tuple[Source, Doc]]]:
    """Per-source train/val split of distinct documents, then the weights, then one shuffle per split."""
    rng = np.random.default_rng([seed, 0xDA7A])
    out: dict[str, list[tuple[Source, Doc]]] = {"train": [], "val": []}
    for src, docs in sources:
        order = rng.permutation(len(docs))
        n_val = max(1, round(val_fraction * len(docs))) if len(docs) > 1 else 0
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
    print(f"\r{label:5s} [{bar:30s}] {done}/{total} docs {tokens:,} tokens {tokens / dt:,.0f} tok/s", end=end,
          file=sys.stderr, flush=True)  # fmt: skip


def write_split(
    tok: BPETokenizer, docs: list[tuple[Source, Doc]], writer: shards.ShardWriter, chunk: int, quiet: bool
) -> None:
    """Tokenize in chunks (each chunk in parallel on all cores) and stream into shards."""
    t0 = time.perf_counter()
    eot = np.array([tok.eot_id], dtype=np.uint16)
    zero = np.zeros(1, dtype=np.uint8)
    for lo in range(0, len(docs), chunk):
        batch = docs[lo : lo + chunk]
        # Offsets (for the mask) cost about 2x; only chat documents need them.
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


def get_tokenizer(train: list[tuple[Source, Doc]], tmp: Path, args: argparse.Namespace) -> tuple[BPETokenizer, bool]:
    """Reuse --tokenizer (copied next to the shards) or train one on the train split."""
    dest = tmp / "tokenizer.json"
    if args.tokenizer:
        try:
            load_tokenizer(args.tokenizer)
        except TokenizerError as e:
            raise SystemExit(f"error: {e}") from None
        shutil.copyfile(args.tokenizer, dest)
        return load_tokenizer(dest), False
    t0 = time.perf_counter()
    try:
        tok = train_bpe(tokenizer_texts(train, args.tokenizer_bytes), args.vocab_size)
    except TokenizerError as e:
        raise SystemExit(f"error: --vocab-size: {e}") from None
    tok.save(dest)
    if not args.quiet:
        print(f"trained BPE tokenizer, vocab {tok.vocab_size}, in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return load_tokenizer(dest), True


def prepare(sources: list[tuple[Source, list[Doc]]], out: Path, args: argparse.Namespace) -> dict:
    """Split, tokenize, write shards and manifest.json into a temp folder, then move it to `out`."""
    splits = split_and_weight(sources, args.val_fraction, args.seed)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tok, trained = get_tokenizer(splits["train"], tmp, args)
        groups = source_folders(sources) if args.per_source else {"": None}  # folder -> its source (all: None)
        written = {}
        for split in ("train", "val"):
            names, total = [], 0
            for sub, src in groups.items():
                (tmp / sub).mkdir(exist_ok=True)
                writer = shards.ShardWriter(tmp / sub, split, args.shard_tokens, args.loss_mask)
                write_split(tok, [d for d in splits[split] if src in (None, d[0])], writer, args.chunk, args.quiet)
                names, total = names + [f"{sub}/{n}" if sub else n for n in writer.close()], total + writer.total
            written[split] = {"shards": names, "tokens": total, "documents": len(splits[split])}
        val_bytes = sum(s.bytes.get("val", 0) for s, _ in sources)
        manifest = {
            "format": "microgpt-shards-v1",
            "shard_layout": {"magic": shards.TOKEN_MAGIC, "version": shards.VERSION, "dtype": "uint16"},
            "seed": args.seed,
            "vocab_size": tok.vocab_size,
            "tokenizer": "tokenizer.json",
            "tokenizer_sha256": tok.sha256,
            "tokenizer_trained": trained,
            "special_tokens": {s: tok.tok.token_to_id(s) for s in SPECIAL_TOKENS if tok.tok.token_to_id(s) is not None},
            "val_fraction": args.val_fraction,
            "loss_mask": args.loss_mask,
            "splits": written,
            "per_source": sorted(groups) if args.per_source else None,
            "val_bytes_per_token": round(val_bytes / max(written["val"]["tokens"], 1), 4),
            "sources": [asdict(s) for s, _ in sources],
            "skipped": sum(sum(s.skipped_by_reason.values()) for s, _ in sources),
            "build": args.build,
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def source_folders(sources: list[tuple[Source, list[Doc]]]) -> dict[str, Source]:
    """--per-source: one subfolder per source, named stdlib, synthetic-chat, or after the source path's stem."""
    out: dict[str, Source] = {}
    for src, _ in sources:
        builtin = src.kind in ("stdlib", "synthetic-chat")
        name = src.kind if builtin else re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(src.name).stem).strip(".-") or "source"
        if name in out:
            raise SystemExit(f"error: --per-source: two sources would share the folder {name!r} ({src.name})")
        out[name] = src
    return out


def check(directory: Path, vocab_size: int | None) -> int:
    """`prep --check`: every shard's header, size and ids; one line per bad shard, exit 1 if any."""
    if vocab_size is None and (directory / "tokenizer.json").exists():
        try:
            vocab_size = load_tokenizer(directory / "tokenizer.json").vocab_size
        except TokenizerError as e:
            raise SystemExit(f"error: {e}") from None
    n, errors = shards.check_dir(directory, vocab_size)
    for sub in sorted(p for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else []:  # --per-source
        k, more = shards.check_dir(sub, vocab_size)
        n, errors = n + k, errors + more
    if errors:
        raise SystemExit("\n".join(f"error: {e}" for e in errors))
    if n == 0:
        raise SystemExit(f"error: {directory}: no train_*.bin or val_*.bin shards found")
    print(f"ok: {n} shards in {directory} (vocab_size {vocab_size})", file=sys.stderr)
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="microgpt prep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", action="append", default=[], metavar="PATH[@W]", help="a source, weight W")
    ap.add_argument("--builtin", action="store_true", help="the offline corpus: stdlib source + synthetic chats")
    ap.add_argument("--out", type=Path, help="output folder (default with --builtin: the train command's cache)")
    ap.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size (default: experiment's)")
    ap.add_argument("--tokenizer", help="reuse this tokenizer.json instead of training one")
    ap.add_argument("--experiment", help="take vocab size, val fraction and stdlib bytes from it")
    ap.add_argument("--val-fraction", type=float, default=None, help="share of each source's documents for val")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (llm.c: 1e8)")
    ap.add_argument("--loss-mask", action="store_true", help="also write loss-mask shards (assistant tokens = 1)")
    ap.add_argument("--per-source", action="store_true", help="one subfolder of shards per source (data mixing)")
    ap.add_argument("--seed", type=int, default=None, help=f"split, weights and shuffle (default {CORPUS_SEED})")
    ap.add_argument("--max-bytes", type=int, default=None, help="--builtin: stdlib bytes (default 4e6)")
    ap.add_argument("--tokenizer-bytes", type=int, default=50_000_000, help="text used to train BPE")
    ap.add_argument("--chunk", type=int, default=512, help="documents per parallel tokenize call")
    ap.add_argument("--check", type=Path, metavar="DIR", help="only validate the shards in DIR")
    ap.add_argument("--quiet", action="store_true")
    return ap


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill defaults from --experiment (explicit flags win), then the built-in defaults."""
    exp = None
    if args.experiment:
        from microgpt import config

        try:
            exp = config.load(args.experiment)
        except config.ConfigError as e:
            raise SystemExit(f"error: {e}") from None
    pick = {
        "vocab_size": (exp.model.vocab_size if exp else 2048),
        "val_fraction": (exp.data.val_fraction if exp else 0.05),
        "max_bytes": (exp.data.max_bytes if exp else 4_000_000),
        "seed": CORPUS_SEED,
    }
    if args.builtin and args.loss_mask is False:
        args.loss_mask = True  # the built-in corpus always carries masks (cheap: 1 byte a token)
    for name, default in pick.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if exp and args.tokenizer is None and exp.data.tokenizer not in ("", "bytes"):
        args.tokenizer = exp.data.tokenizer  # the same corpus (and cache folder) the train command would build
    if not args.tokenizer and args.vocab_size <= 256 + len(SPECIAL_TOKENS):
        raise SystemExit(
            f"error: --vocab-size {args.vocab_size}: BPE needs more than {256 + len(SPECIAL_TOKENS)} entries "
            "(256 bytes + special tokens); a vocabulary of 256 trains on raw bytes, which need no prep"
        )
    if not 0 < args.val_fraction < 1:
        raise SystemExit(f"error: --val-fraction must be in (0, 1), got {args.val_fraction}")
    if args.shard_tokens <= 0:
        raise SystemExit(f"error: --shard-tokens must be > 0, got {args.shard_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.check:
        return check(args.check, args.vocab_size)
    if not (args.builtin or args.source) or not (args.out or args.builtin):
        raise SystemExit("error: prep needs --builtin or --source PATH[@W] (and --out DIR with --source)")
    if args.per_source and not args.out:
        raise SystemExit("error: --per-source needs --out DIR (the train command's built-in cache is one shard set)")
    args = resolve(args)
    t0 = time.perf_counter()
    sources, args.build = [], {"builtin": False, "sources": args.source, "python": sys.version.split()[0]}
    if args.builtin:
        settings = builtin_settings(args.vocab_size, args.val_fraction, args.max_bytes, args.tokenizer or "", args.seed)
        sources = builtin_sources(args.max_bytes, settings["chats"], args.seed)
        args.out = args.out or builtin_dir(settings)
        args.build = settings if not args.source else {**settings, "sources": args.source}
    sources += [read_source(spec) for spec in args.source]
    manifest = prepare(sources, args.out, args)
    if not args.quiet:
        tr, va = manifest["splits"]["train"], manifest["splits"]["val"]
        print(
            f"wrote {args.out}: train {tr['tokens']:,} tokens in {len(tr['shards'])} shards, val {va['tokens']:,}; "
            f"val bytes/token {manifest['val_bytes_per_token']}; {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
