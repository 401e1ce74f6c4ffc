"""Byte-level BPE (Hugging Face `tokenizers`) with the chat special tokens.

GPT-2's scheme: text is split by GPT-2's regex, each piece is mapped byte by byte onto 256 printable
characters, and merges are learned on top, so every string (any UTF-8, any code) round-trips exactly:
decode(encode(s)) == s. The special tokens are atomic: the ChatML markers never get split or merged
with neighbouring text.

The byte tokenizer (ByteTokenizer) is the other choice: 256 ids, one per byte, no file, no special tokens;
documents are separated by byte 0 (NUL), which no text file holds. A corpus is the same documents and split
with either tokenizer: microgpt/data/prep.py takes whichever it is given.

The whole BPE tokenizer is one `tokenizer.json`. It travels with a prepared corpus and with a run; its
sha256 (of the file's bytes) is what the manifest and a checkpoint's .state.json record.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from microgpt.errors import InputError, brief
from microgpt.fileio import open_input, parse_json, read_input_text

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
# Ids 0..3, in this order, in every tokenizer we train: the engine can rely on eot == 0.
SPECIAL_TOKENS = (EOT, IM_START, IM_END, PAD)


class TokenizerError(InputError):
    """A tokenizer file that cannot be used. str(err) is the whole one-line message."""


def file_sha256(path: str | Path) -> str:
    with open_input(path, "tokenizer", TokenizerError) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class BPETokenizer:
    """A thin wrapper: the ids the engine needs, and encode/decode that never drop special tokens."""

    def __init__(self, tok: Tokenizer, path: Path | None = None):
        self.tok = tok
        self.path = path
        missing = [s for s in SPECIAL_TOKENS[:3] if tok.token_to_id(s) is None]
        if missing:
            raise TokenizerError(f"{path or '<tokenizer>'}: field 'added_tokens' lacks {', '.join(missing)}")
        self.eot_id = tok.token_to_id(EOT)
        self.bos_id = self.eot_id  # documents start after <|endoftext|>: an empty prompt starts with it
        self.im_start_id = tok.token_to_id(IM_START)
        self.im_end_id = tok.token_to_id(IM_END)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def sha256(self) -> str:
        if self.path is None:
            raise TokenizerError("<tokenizer>: not saved yet, so it has no file hash")
        return file_sha256(self.path)

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        path = Path(path)
        try:
            text = read_input_text(path, "tokenizer", TokenizerError)  # a regular file, size-bound
        except FileNotFoundError:
            raise TokenizerError(f"{path}: cannot read tokenizer (No such file or directory)") from None
        parse_json(text, f"{path}: not a tokenizers tokenizer.json", TokenizerError)  # strict: nesting, duplicates
        try:
            tok = Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception for schema errors
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerError(f"{path}: not a tokenizers tokenizer.json ({first})") from None
        return cls(tok, path)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        self.tok.save(str(path), pretty=False)
        self.path = path

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[NDArray[np.uint16]]:
        """Many documents at once, in parallel on all cores (tokenizers' thread pool); order kept."""
        encs = self.tok.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint16) for e in encs]

    def encode_batch_offsets(self, texts: list[str]) -> list[tuple[NDArray[np.uint16], NDArray[np.int64]]]:
        """Ids plus each token's start offset (in characters of the text), for loss masks."""
        encs = self.tok.encode_batch(texts, add_special_tokens=False)
        return [
            (np.asarray(e.ids, dtype=np.uint16), np.array(e.offsets, dtype=np.int64).reshape(-1, 2)[:, 0]) for e in encs
        ]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def special_ids(self) -> dict[str, int]:
        return {s: self.tok.token_to_id(s) for s in SPECIAL_TOKENS if self.tok.token_to_id(s) is not None}


class ByteTokenizer:
    """Bytes are tokens: 256 ids, lossless on any text. eot_id 0: documents are separated by a NUL byte."""

    name = "bytes"
    vocab_size = 256
    eot_id = 0
    sha256 = hashlib.sha256(b"bytes").hexdigest()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[NDArray[np.uint16]]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint16) for t in texts]

    def encode_batch_offsets(self, texts: list[str]) -> list[tuple[NDArray[np.uint16], NDArray[np.int64]]]:
        """Ids plus the character each byte belongs to (its token's start offset, as BPETokenizer gives)."""
        out = []
        for ids, t in zip(self.encode_batch(texts), texts):
            chars = np.arange(len(t), dtype=np.int64)
            out.append((ids, chars if t.isascii() else np.repeat(chars, [len(c.encode("utf-8")) for c in t])))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def special_ids(self) -> dict[str, int]:
        return {}

    def describe(self) -> dict:
        return {"kind": self.name, "vocab_size": self.vocab_size, "sha256": self.sha256}


class PieceCache:
    """encode(text) equal to tok.encode(text), each piece of text between special tokens encoded once and kept (the
    least recently used dropped past max_chars characters in all). A chat's history renders as the same pieces turn
    after turn (ChatML: a message's role and content lie between <|im_start|> and <|im_end|>), so a later turn encodes
    only what is new; serve encodes every request on its event loop, where a whole history's encode holds every
    stream's writes (docs/SERVE.md has the figures).
    Equal by construction: `tokenizers` finds its added tokens in the text first and encodes what lies between them
    each on its own; so where an added token strips no space around it (lstrip, rstrip), matches only whole words or
    is normalized, its matches are not the plain string's, and this encodes the text whole, as tok.encode does.
    Threads may share one (serve encodes a large body in a worker): the kept pieces change under a lock."""

    def __init__(self, tok: BPETokenizer | ByteTokenizer, max_chars: int = 1 << 20) -> None:
        self.tok, self.max_chars, self.chars = tok, max_chars, 0
        self.pieces: OrderedDict[str, list[int]] = OrderedDict()
        self.lock = threading.Lock()
        added = tok.tok.get_added_tokens_decoder().values() if isinstance(tok, BPETokenizer) else ()
        plain = all(not (a.lstrip or a.rstrip or a.single_word or a.normalized) for a in added)
        self.specials = {a.content: tok.tok.token_to_id(a.content) for a in added} if plain else {}
        # the longest first where one special token's string holds another's
        alts = "|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True))
        self.split = re.compile(f"({alts})").split if alts else None

    def encode(self, text: str) -> list[int]:
        if self.split is None:
            return self.tok.encode(text)
        out: list[int] = []
        for i, piece in enumerate(self.split(text)):
            if i % 2:  # a special token's string (re.split keeps the separators at the odd places)
                out.append(self.specials[piece])
            elif piece:
                out += self._piece(piece)
        return out

    def _piece(self, piece: str) -> list[int]:
        with self.lock:
            ids = self.pieces.get(piece)
            if ids is not None:
                self.pieces.move_to_end(piece)
                return ids
        ids = self.tok.encode(piece)  # outside the lock: another thread's pieces need not wait for this one
        if len(piece) <= self.max_chars:
            with self.lock:
                if piece not in self.pieces:
                    self.pieces[piece] = ids
                    self.chars += len(piece)
                while self.chars > self.max_chars:
                    self.chars -= len(self.pieces.popitem(last=False)[0])
        return ids


def new_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a document's first word is not silently changed; round-trip stays exact.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


# The longest run of non-space (or of space) characters the BPE trainer sees whole. tokenizers' trainer costs the
# square of a pre-tokenized piece's length (a 100 KB line of letters is one GPT-2 piece: seconds; 3 MB: hours),
# and a GPT-2 piece lies within one such run (plus at most one leading space), so cutting longer runs bounds the
# trainer's cost by a constant per character. No merge this long is ever learned from prose or code.
MAX_TRAIN_RUN = 256
LONG_RUN = re.compile(rf"\S{{{MAX_TRAIN_RUN + 1},}}|\s{{{MAX_TRAIN_RUN + 1},}}")


def bounded_runs(texts: Iterable[str]) -> Iterator[str]:
    """texts for the BPE trainer, each cut inside any run of more than MAX_TRAIN_RUN non-space (or space)
    characters, every MAX_TRAIN_RUN characters: text without such a run passes whole, so its counts are unchanged."""
    for text in texts:
        start = 0
        for m in LONG_RUN.finditer(text):
            for cut in range(m.start() + MAX_TRAIN_RUN, m.end(), MAX_TRAIN_RUN):
                yield text[start:cut]
                start = cut
        yield text[start:]


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Learn merges until the vocabulary (256 bytes + special tokens + merges) has vocab_size entries, in time
    linear in the text (bounded_runs). Training text should not contain the special tokens' strings: the trainer
    counts them as text."""
    if not len(SPECIAL_TOKENS) + 256 < vocab_size <= 65536:
        raise TokenizerError(f"vocab_size must be in ({len(SPECIAL_TOKENS) + 256}, 65536], got {vocab_size}")
    tok = new_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(bounded_runs(texts), trainer=trainer)
    return BPETokenizer(tok)


def load_tokenizer(where: str | Path | dict) -> BPETokenizer | ByteTokenizer:
    """From a tokenizer.json path, or from a run's record (data.tokenizer_info, kept in every checkpoint's sidecar):
    {"kind": "bytes"} (or no record) is the byte tokenizer; a BPE record {"path", "sha256", ...} must still hash to
    the recorded sha256."""
    if not isinstance(where, dict):
        return BPETokenizer.load(where)
    bad = [k for k in ("kind", "path", "sha256") if k in where and not isinstance(where[k], str)]
    if bad:
        got = type(where[bad[0]]).__name__
        raise TokenizerError(f"tokenizer record: field '{bad[0]}' must be a string, got {got}")
    if where.get("kind", "bpe" if where.get("path") else "bytes") == "bytes":
        return ByteTokenizer()
    if not where.get("path"):
        raise TokenizerError(f"tokenizer record {brief(where)}: field 'path' is missing")
    tok = BPETokenizer.load(where["path"])
    if where.get("sha256") and tok.sha256 != where["sha256"]:
        raise TokenizerError(f"{where['path']}: field 'sha256' differs from the run's record (tokenizer replaced?)")
    return tok
