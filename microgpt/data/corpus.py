"""The built-in corpus, defined once: no network, the same documents and split whatever the tokenizer.

Documents: the running interpreter's standard library .py files (sorted by path, UTF-8 only, up to max_bytes of
text) and about one synthetic chat conversation per 800 of those bytes (small exact tasks rendered as ChatML, so
the corpus exercises the chat template and the loss mask, and a tiny model has something checkable to learn).
prep (microgpt/data/prep.py) splits them per source by the corpus seed, separates documents with the
tokenizer's end-of-text id and writes the shards; bytes vs BPE is only the tokenizer prep is given.

The settings (builtin_settings) name the cache folder by their hash and are kept in the manifest's "build", so a
corpus is built once per settings and reused: $MICROGPT_DATA_DIR/builtin/v<vocab>-<key>, or
<repo>/data/builtin/v<vocab>-<key>, unless data.path names the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from microgpt.config import Experiment
from microgpt.data.chatml import Message, render
from microgpt.data.sources import Doc, Source, read_text_file
from microgpt.data.tokenizer import file_sha256

REPO = Path(__file__).resolve().parents[2]
CORPUS_SEED = 1337  # split, weights and shuffle; not the training seed: runs with other seeds share a corpus
STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "site-packages", "encodings", "__pycache__", "turtledemo"}
BYTES_PER_CHAT = 800  # about one synthetic chat per 800 stdlib bytes: chats are ~25% of the text
CHAT_SET_SEED = 0xF17E  # added to the prep seed for `prep --builtin-chats`: another stream than the corpus's chats


def uses_bytes(exp: Experiment) -> bool:
    """The byte tokenizer: asked for, or implied by a 256-entry vocabulary (too small for BPE + specials)."""
    return exp.data.tokenizer == "bytes" or (exp.data.tokenizer == "" and exp.model.vocab_size == 256)


def builtin_settings(
    vocab_size: int, val_fraction: float, max_bytes: int, tokenizer: str = "", seed: int = CORPUS_SEED
) -> dict:
    """Everything the built-in corpus depends on; its hash names the cache folder, the manifest keeps it.
    tokenizer: "bytes", a given tokenizer.json (its hash counts), or "" to train a BPE of vocab_size entries."""
    kind = "bytes" if tokenizer == "bytes" else "bpe"
    tokenizer_sha = file_sha256(tokenizer) if kind == "bpe" and tokenizer and Path(tokenizer).is_file() else None
    return {
        "builtin": True,
        "tokenizer": kind,
        "vocab_size": 256 if kind == "bytes" else vocab_size,
        "val_fraction": val_fraction,
        "max_bytes": max_bytes,
        "chats": max_bytes // BYTES_PER_CHAT,
        "seed": seed,
        "tokenizer_sha256": tokenizer_sha,
        "python": sys.version.split()[0],
        "format": 2,
    }


def settings_for(exp: Experiment) -> dict:
    """The built-in corpus an experiment trains on."""
    d = exp.data
    return builtin_settings(
        exp.model.vocab_size, d.val_fraction, d.max_bytes, "bytes" if uses_bytes(exp) else d.tokenizer
    )


def cache_root() -> Path:
    if os.environ.get("MICROGPT_DATA_DIR"):
        return Path(os.environ["MICROGPT_DATA_DIR"])
    return REPO / "data" if (REPO / "pyproject.toml").exists() else Path("data")


def builtin_dir(settings: dict) -> Path:
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    return cache_root() / "builtin" / f"v{settings['vocab_size']}-{key}"


def stdlib_files() -> list[Path]:
    """The running interpreter's standard library .py files, sorted by relative path (deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not STDLIB_SKIP.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def builtin_sources(settings: dict) -> list[tuple[Source, list[Doc]]]:
    """The corpus's two sources and their documents, before the split (prep.split_and_weight does that)."""
    src = Source(f"stdlib:{sysconfig.get_paths()['stdlib']}", "stdlib")
    docs, total = [], 0
    for path in stdlib_files():
        doc = read_text_file(path, src)
        if doc is None:
            continue
        if total + len(doc.text.encode()) > settings["max_bytes"]:
            break  # the cap keeps the build fast on a 2-core CI machine
        docs.append(doc)
        total += len(doc.text.encode())
    src.documents_read = len(docs)
    chats = Source("synthetic-chat", "synthetic-chat")
    chat_docs = [Doc(*render(m)) for m in synthetic_conversations(settings["chats"], settings["seed"])]
    chats.documents_read = len(chat_docs)
    return [(src, docs), (chats, chat_docs)]


def chat_set(n: int, seed: int) -> tuple[Source, list[Doc]]:
    """`prep --builtin-chats N`: N synthetic conversations as one chat source (a fine-tuning set with no network).
    The seed is mixed apart from the built-in corpus's chats, so the set is not the pretraining corpus's chats again
    (the tasks are small: some questions recur)."""
    src = Source("builtin-chats", "synthetic-chat")
    docs = [Doc(*render(m)) for m in synthetic_conversations(n, seed + CHAT_SET_SEED)]
    src.documents_read = len(docs)
    return src, docs


# --- synthetic conversations: small exact tasks, deterministic for a seed --------------------------------------
SYSTEMS = ["You are ANDREA, a small and precise assistant.", "Answer briefly.", ""]
WORDS = "apple river stone cloud maple tiger violet engine garden silver pocket lantern orbit".split()


def _task(rng: np.random.Generator) -> tuple[str, str]:
    kind = int(rng.integers(6))
    a, b = (int(x) for x in rng.integers(0, 100, size=2))
    w = WORDS[int(rng.integers(len(WORDS)))]
    nums = [int(x) for x in rng.integers(0, 50, size=int(rng.integers(3, 7)))]
    if kind == 0:
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    if kind == 1:
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
    if kind == 2:
        return f"Spell '{w}' backwards.", f"'{w}' backwards is '{w[::-1]}'."
    if kind == 3:
        return f"Sort these numbers: {', '.join(map(str, nums))}", f"Sorted: {', '.join(map(str, sorted(nums)))}."
    if kind == 4:
        return f"How many letters are in the word '{w}'?", f"The word '{w}' has {len(w)} letters."
    return f"Write '{w}' in capital letters.", f"{w.upper()}"


def synthetic_conversations(n: int, seed: int) -> list[list[Message]]:
    rng = np.random.default_rng([seed, 0x5C4A7])
    convs = []
    for _ in range(n):
        system = SYSTEMS[int(rng.integers(len(SYSTEMS)))]
        messages = [{"role": "system", "content": system}] if system else []
        for _turn in range(int(rng.integers(1, 4))):
            question, answer = _task(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        convs.append(messages)
    return convs
