"""Reading data sources: Hermes-3 / ShareGPT / OpenAI-messages records in .jsonl/.json/.parquet, {"text": ...}
JSON Lines, and plain text files, into documents (`Doc`) counted per source (`Source`).

A malformed record is skipped and counted by reason and location (file:line for JSONL, file#row for JSON and
Parquet); reasons are those of chat.parse_record, plus "invalid utf-8" and "invalid json". A file that cannot be
read at all, or a source with nothing usable, is a SourceError: one line naming the file.
Used by prep (microgpt/data/prep.py) and pull-hermes3 (microgpt/data/pull.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from microgpt.data.chatml import parse_record, render
from microgpt.errors import InputError, brief, check_finite
from microgpt.fileio import MAX_JSON_BYTES, input_kind, open_input, parse_json, read_input, read_input_text

SUFFIXES = (".jsonl", ".json", ".parquet")  # record files (chat or {"text": ...})
TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".text"}
MAX_WHERE = 1000  # locations kept per reason in a report (counts stay exact)
MAX_LINE_BYTES = 64 << 20  # a JSONL record longer than this is skipped ("line too long"), never held whole


class SourceError(InputError):
    """A data source that cannot be used (unreadable, empty, missing, ran dry). One line naming it."""


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


@dataclass
class Report:
    """Records kept and skipped (by reason, with locations), and the files that could not be read."""

    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    where: dict[str, list[str]] = field(default_factory=dict)
    bad_files: list[str] = field(default_factory=list)

    def skip(self, reason: str, loc: str) -> None:
        self.skipped[reason] += 1
        locs = self.where.setdefault(reason, [])
        if len(locs) < MAX_WHERE:
            locs.append(loc)

    def to_dict(self) -> dict:
        return {
            "kept": self.kept,
            "skipped": sum(self.skipped.values()),
            "skipped_by_reason": dict(sorted(self.skipped.items())),
            "where": {k: self.where[k] for k in sorted(self.where)},
            "unreadable_files": self.bad_files,
        }


# --- record files ----------------------------------------------------------------------------------------------
def kind_of(path: Path) -> str:
    """Whether a source path is a "folder" or a "file" (fileio.input_kind: a named pipe or a device is refused, one
    line); SourceError when it is missing."""
    try:
        return input_kind(path, "source", SourceError)
    except FileNotFoundError:
        raise SourceError(f"{path}: no such file or folder") from None


def files_under(folder: Path) -> list[Path]:
    """The regular files under a folder, in sorted (deterministic) order: named pipes, devices and sockets in it are
    passed over (is_file is a regular file's test), as folders are."""
    return sorted(p for p in folder.rglob("*") if p.is_file())


def input_files(path: str | Path) -> list[Path]:
    """A file, or every .jsonl/.json/.parquet file under a folder, in sorted (deterministic) order."""
    path = Path(path)
    if kind_of(path) == "folder":
        return [p for p in files_under(path) if p.suffix in SUFFIXES]
    return [path]


def _lines(f: BinaryIO) -> Iterator[bytes | None]:
    """The lines of f, None for one longer than MAX_LINE_BYTES (read past in bounded pieces, never held whole)."""
    while raw := f.readline(MAX_LINE_BYTES + 1):
        if len(raw) <= MAX_LINE_BYTES:
            yield raw
            continue
        while raw and not raw.endswith(b"\n"):
            raw = f.readline(MAX_LINE_BYTES + 1)
        yield None


def _jsonl(path: Path) -> Iterator[tuple[str, object | None, str]]:
    with open_input(path, "source file", SourceError) as f:
        for lineno, raw in enumerate(_lines(f), 1):
            if raw is None:
                yield f"{path}:{lineno}", None, "line too long"
                continue
            if not raw.strip():
                continue
            loc = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield loc, None, "invalid utf-8"
                continue
            try:
                record = parse_json(text, loc)  # the strict reader: nesting, duplicate keys
            except InputError:
                yield loc, None, "invalid json"
                continue
            yield loc, record, ""


def _json(path: Path) -> Iterator[tuple[str, object | None, str]]:
    try:
        data = parse_json(read_input_text(path, "source file", limit=MAX_JSON_BYTES), str(path))
    except InputError:
        # Many ".json" files on the hub are JSON Lines; read them as such (per-line errors then count), as is one
        # too large to parse whole.
        yield from _jsonl(path)
        return
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise SourceError(f"{path}: expected a JSON list of records (or JSON Lines), got {type(data).__name__}")
    for i, record in enumerate(data):
        yield f"{path}#{i}", record, ""


def _parquet(path: Path) -> Iterator[tuple[str, object | None, str]]:
    try:
        import pyarrow.parquet as pq  # the `data` extra: only Parquet input needs it
    except ImportError:
        raise SourceError(f"{path}: reading Parquet needs pyarrow (pip install 'microgpt[data]')") from None
    row = 0
    try:
        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield f"{path}#{row}", record, ""
                row += 1
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError; truncated footers land here
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SourceError(f"{path}: unreadable Parquet after {row} rows ({msg})") from None


def iter_records(path: Path) -> Iterator[tuple[str, object | None, str]]:
    """(location, record or None, reason) for every record of one file; raises SourceError for the file."""
    readers = {".jsonl": _jsonl, ".json": _json, ".parquet": _parquet}
    reader = readers.get(path.suffix)
    if reader is None:
        raise SourceError(f"{path}: unknown format '{path.suffix}' (expected one of {', '.join(SUFFIXES)})")
    try:
        yield from reader(path)
    except OSError as e:
        raise SourceError(f"{path}: cannot read ({e.strerror})") from None


# --- prep's sources: PATH[@W] -> documents -----------------------------------------------------------------------
MAX_WEIGHT = 1000.0  # PATH@W repeats each document W times: more is a typo that would fill the disk


def parse_source(spec: str) -> tuple[Path, float]:
    """PATH[@W] -> (path, weight); W must be a finite number in [0, MAX_WEIGHT] (a PATH may hold '@' itself)."""
    path, at, w = spec.rpartition("@")
    if at:
        try:
            weight = float(w)
        except ValueError:
            return Path(spec), 1.0
        check_finite(weight, f"--source {brief(spec)}: weight", SourceError)
        if not 0 <= weight <= MAX_WEIGHT:
            raise SourceError(f"--source {brief(spec)}: weight must be in [0, {MAX_WEIGHT:g}], got {w}")
        return Path(path), weight
    return Path(spec), 1.0


def read_text_file(path: Path, src: Source) -> Doc | None:
    """One plain-text document (a regular file of at most fileio.MAX_TEXT_BYTES: SourceError otherwise); None, counted
    as "invalid utf-8", for a file that is not UTF-8."""
    data = read_input(path, "source file", SourceError)
    try:
        return Doc(data.decode("utf-8"))
    except UnicodeDecodeError:
        src.skipped_by_reason["invalid utf-8"] = src.skipped_by_reason.get("invalid utf-8", 0) + 1
        return None


def read_chat(paths: list[Path], src: Source) -> list[Doc]:
    """Chat records rendered as ChatML (with their assistant spans), or {"text": ...} records as they are."""
    report = Report()
    docs = []
    for path in paths:
        for loc, record, reason in iter_records(path):
            if not reason and isinstance(record, dict) and isinstance(record.get("text"), str):
                docs.append(Doc(record["text"]))  # plain-text JSONL ({"text": ...}), common for pretraining
                continue
            messages = parse_record(record) if not reason else reason
            if isinstance(messages, str):
                report.skip(messages, loc)
                continue
            text, spans = render(messages)
            docs.append(Doc(text, spans))
    src.skipped_by_reason = dict(sorted(report.skipped.items()))
    return docs


def read_source(spec: str) -> tuple[Source, list[Doc]]:
    """--source PATH[@W]: record files (chat) if the path holds any, else plain text (one document a file)."""
    path, weight = parse_source(spec)
    if not path.exists():
        raise SourceError(f"{path}: source not found (--source {spec})")
    folder = kind_of(path) == "folder"  # a named pipe or /dev/zero: one line, before anything is read
    files = files_under(path) if folder else [path]
    chat = [p for p in files if p.suffix in SUFFIXES]
    if chat:
        src = Source(str(path), "chat", weight)
        docs = read_chat(chat, src)
    else:
        src = Source(str(path), "text", weight)
        texts = [p for p in files if p.suffix in TEXT_SUFFIXES or not folder]
        docs = [d for d in (read_text_file(p, src) for p in texts) if d is not None]
    src.documents_read = len(docs)
    if not docs:
        raise SourceError(f"{path}: source has no usable documents (skipped: {src.skipped_by_reason or 'none'})")
    return src, docs
