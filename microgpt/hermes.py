"""pull-hermes3: fetch NousResearch's Hermes-3 chat dataset (or read a local copy), validate every
record, and write normalized JSONL.

    microgpt pull-hermes3 --from PATH --out data/hermes3.jsonl     # local JSONL / JSON / Parquet, file or folder
    microgpt pull-hermes3 --out data/hermes3.jsonl                 # download through huggingface_hub

A malformed record is skipped, counted and reported by reason and location (file:line for JSONL,
file#row for JSON and Parquet); it never stops the run. A file that cannot be read at all (a
truncated Parquet file, a missing path) is reported on one line and the run goes on with the other
files, but the exit status is then 1 so a pipeline notices. Reasons are those of chat.parse_record,
plus "invalid utf-8" and "invalid json".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from microgpt.chat import parse_record, to_sharegpt
from microgpt.checkpoint import atomic_write_bytes

REPO_ID = "NousResearch/Hermes-3-Dataset"
SUFFIXES = (".jsonl", ".json", ".parquet")
MAX_WHERE = 1000  # locations kept per reason in the report (counts stay exact)


class InputError(Exception):
    """A whole input file is unreadable. str(err) is the one-line message, naming the file."""


@dataclass
class Report:
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


def input_files(path: str | Path) -> list[Path]:
    """A file, or every .jsonl/.json/.parquet file under a folder, in sorted (deterministic) order."""
    path = Path(path)
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder")
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
                yield loc, json.loads(text), ""
            except json.JSONDecodeError:
                yield loc, None, "invalid json"


def _json(path: Path) -> Iterator[tuple[str, object | None, str]]:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        # Many ".json" files on the hub are JSON Lines; read them as such (per-line errors then count).
        yield from _jsonl(path)
        return
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise InputError(f"{path}: expected a JSON list of records (or JSON Lines), got {type(data).__name__}")
    for i, record in enumerate(data):
        yield f"{path}#{i}", record, ""


def _parquet(path: Path) -> Iterator[tuple[str, object | None, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path}: reading Parquet needs pyarrow (pip install 'microgpt[data]')") from None
    row = 0
    try:
        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield f"{path}#{row}", record, ""
                row += 1
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError; truncated footers land here
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{path}: unreadable Parquet after {row} rows ({msg})") from None


def iter_records(path: Path) -> Iterator[tuple[str, object | None, str]]:
    """(location, record or None, reason) for every record of one file; raises InputError for the file."""
    readers = {".jsonl": _jsonl, ".json": _json, ".parquet": _parquet}
    reader = readers.get(path.suffix)
    if reader is None:
        raise InputError(f"{path}: unknown format '{path.suffix}' (expected one of {', '.join(SUFFIXES)})")
    try:
        yield from reader(path)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None


def iter_conversations(paths: list[Path], report: Report) -> Iterator[list[dict[str, str]]]:
    """Valid conversations (chat.Message lists) of all files; skips are counted into report.
    An unreadable file is added to report.bad_files and reported on stderr; the others go on."""
    for path in paths:
        try:
            for loc, record, reason in iter_records(path):
                messages = parse_record(record) if not reason else reason
                if isinstance(messages, str):
                    report.skip(messages, loc)
                    continue
                report.kept += 1
                yield messages
        except InputError as e:
            report.bad_files.append(str(e))
            print(f"error: {e}", file=sys.stderr)


def download(repo_id: str, cache_dir: str | None) -> Path:
    """Fetch the dataset files through huggingface_hub (resumable, cached). One clear line on failure.
    Not testable here (no network); the --from path is what the tests exercise."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise SystemExit(
            "error: downloading needs huggingface_hub (pip install 'microgpt[data]'); or pass --from PATH"
        ) from None
    try:
        folder = snapshot_download(
            repo_id=repo_id, repo_type="dataset", allow_patterns=[f"*{s}" for s in SUFFIXES], cache_dir=cache_dir
        )
    except Exception as e:  # network, auth, or a missing repo: all end the same way, with the cause
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SystemExit(f"error: cannot download {repo_id} from the Hugging Face hub ({msg}); pass --from PATH")
    return Path(folder)


def pull(paths: list[Path], out: Path) -> Report:
    """Validate and normalize; write out (atomically) and out.report.json next to it."""
    report = Report()
    lines = (json.dumps(to_sharegpt(m), ensure_ascii=False).encode() + b"\n" for m in iter_conversations(paths, report))
    atomic_write_bytes(out, lines, sync_dir=False)
    out.with_name(out.name + ".report.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    return report


def print_report(report: Report, out: Path) -> None:
    skipped = sum(report.skipped.values())
    print(f"kept {report.kept} conversations, skipped {skipped} -> {out}", file=sys.stderr)
    for reason, n in sorted(report.skipped.items()):
        locs = report.where[reason]
        more = f" (+{n - 5} more, see {out.name}.report.json)" if n > 5 else ""
        print(f"  skipped {n} '{reason}': {', '.join(locs[:5])}{more}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="microgpt pull-hermes3", description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", help="local copy: a .jsonl/.json/.parquet file or a folder of them")
    ap.add_argument("--out", default="data/hermes3.jsonl", help="normalized JSONL to write")
    ap.add_argument("--repo", default=REPO_ID, help="Hugging Face dataset repo (download only)")
    ap.add_argument("--cache-dir", default=None, help="huggingface_hub cache folder (download only)")
    args = ap.parse_args(argv)
    src = Path(args.src) if args.src else download(args.repo, args.cache_dir)
    try:
        paths = input_files(src)
    except InputError as e:
        raise SystemExit(f"error: {e}") from None
    if not paths:
        raise SystemExit(f"error: {src}: no {'/'.join(SUFFIXES)} files found")
    out = Path(args.out)
    report = pull(paths, out)
    print_report(report, out)
    if report.bad_files:
        raise SystemExit(f"error: {len(report.bad_files)} input file(s) unreadable (listed above); the rest was kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
