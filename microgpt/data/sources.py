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

from microgpt.data.chatml import parse_record, render
from microgpt.errors import InputError, brief, check_finite
from microgpt.fileio import parse_json

SUFFIXES = (".jsonl", ".json", ".parquet")  # record files (chat or {"text": ...})
TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".text"}
MAX_WHERE = 1000  # locations kept per reason in a report (counts stay exact)


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
def input_files(path: str | Path) -> list[Path]:
    """A file, or every .jsonl/.json/.parquet file under a folder, in sorted (deterministic) order."""
    path = Path(path)
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    if not path.exists():
        raise SourceError(f"{path}: no such file or folder")
    return [path]


def _jsonl(path: Path) -> Iterator[tuple[str, object | None, str]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
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
        data = parse_json(path.read_bytes().decode("utf-8"), str(path))
    except (UnicodeDecodeError, InputError):
        # Many ".json" files on the hub are JSON Lines; read them as such (per-line errors then count).
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
    try:
        return Doc(path.read_bytes().decode("utf-8"))
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
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    chat = [p for p in files if p.suffix in SUFFIXES]
    if chat:
        src = Source(str(path), "chat", weight)
        docs = read_chat(chat, src)
    else:
        src = Source(str(path), "text", weight)
        texts = [p for p in files if p.suffix in TEXT_SUFFIXES or not path.is_dir()]
        docs = [d for d in (read_text_file(p, src) for p in texts) if d is not None]
    src.documents_read = len(docs)
    if not docs:
        raise SourceError(f"{path}: source has no usable documents (skipped: {src.skipped_by_reason or 'none'})")
    return src, docs
