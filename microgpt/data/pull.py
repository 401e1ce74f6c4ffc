"""pull-hermes3: fetch NousResearch's Hermes-3 chat dataset (or read a local copy), validate every
record, and write normalized JSONL. An existing output is replaced only by a pull that read every input file and
kept at least one conversation.

    microgpt pull-hermes3 --from PATH --out data/hermes3.jsonl     # local JSONL / JSON / Parquet, file or folder
    microgpt pull-hermes3 --out data/hermes3.jsonl                 # download through huggingface_hub

A malformed record is skipped, counted and reported by reason and location (file:line for JSONL,
file#row for JSON and Parquet); it never stops the run. A file that cannot be read at all (a
truncated Parquet file, a missing path) is passed over and the run goes on with the other files, but the run then
ends with one `error:` line and exit status 2 so a pipeline notices: naming the file (its reason) when the pull
wrote nothing, else "N input file(s) unreadable (listed above)" after the report's `  unreadable: ...` lines.
Reasons are those of chat.parse_record, plus "invalid utf-8" and "invalid json". Bad input (a missing path, no
record files, no way to download) is one `error:` line and exit 2 (microgpt/errors.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

from microgpt.data.chatml import parse_record, to_sharegpt
from microgpt.data.sources import SUFFIXES, Report, SourceError, input_files, iter_records
from microgpt.errors import ArgParser, exit_on_input_error, output_error
from microgpt.fileio import atomic_write_bytes, check_parents

REPO_ID = "NousResearch/Hermes-3-Dataset"


def iter_conversations(paths: list[Path], report: Report) -> Iterator[list[dict[str, str]]]:
    """Valid conversations (chat.Message lists) of all files; skips are counted into report.
    An unreadable file is added to report.bad_files (said once, by pull's error or print_report); the others go on."""
    for path in paths:
        try:
            for loc, record, reason in iter_records(path):
                messages = parse_record(record) if not reason else reason
                if isinstance(messages, str):
                    report.skip(messages, loc)
                    continue
                report.kept += 1
                yield messages
        except SourceError as e:
            report.bad_files.append(str(e))


def download(repo_id: str, cache_dir: str | None) -> Path:
    """Fetch the dataset files through huggingface_hub (resumable, cached). One clear line on failure.
    Not testable here (no network); the --from path is what the tests exercise."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise SourceError(
            "downloading needs huggingface_hub (pip install 'microgpt[data]'); or pass --from PATH"
        ) from None
    try:
        folder = snapshot_download(
            repo_id=repo_id, repo_type="dataset", allow_patterns=[f"*{s}" for s in SUFFIXES], cache_dir=cache_dir
        )
    except Exception as e:  # network, auth, or a missing repo: all end the same way, with the cause
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SourceError(f"cannot download {repo_id} from the Hugging Face hub ({msg}); pass --from PATH") from None
    return Path(folder)


def check_out(out: Path) -> None:
    """--out must name a file (new, or one to replace), not a folder or a path through a file."""
    if out.is_dir():
        raise SourceError(f"--out {out}: is a folder; pull-hermes3 writes one JSONL file")
    check_parents(out, "--out", SourceError)


def pull(paths: list[Path], out: Path) -> Report:
    """Validate and normalize; write out (atomically) and out.report.json next to it.

    An existing out is replaced only by a pull that read every file and kept at least one conversation: a failed
    pull (an unreadable file, nothing valid) raises SourceError and leaves it, and its report, as they were."""
    report = Report()
    keep_old = out.exists()

    def lines() -> Iterator[bytes]:
        for m in iter_conversations(paths, report):
            yield json.dumps(to_sharegpt(m), ensure_ascii=False).encode() + b"\n"
        if report.kept == 0 and not report.bad_files:
            raise SourceError(f"{len(paths)} input file(s) hold no valid conversation; nothing written to {out}")
        if report.kept == 0 or (keep_old and report.bad_files):  # the first unreadable file's line is the error
            bad = report.bad_files
            more = f" (and {len(bad) - 1} more unreadable input files)" if len(bad) > 1 else ""
            raise SourceError(
                f"{bad[0]}{more}; " + (f"{out} was left as it was" if keep_old else f"nothing written to {out}")
            )

    target = out
    try:
        atomic_write_bytes(out, lines(), sync_dir=False)
        target = out.with_name(out.name + ".report.json")
        report_text = json.dumps(report.to_dict(), indent=1) + "\n"
        atomic_write_bytes(target, [report_text.encode()], sync_dir=False)
    except OSError as e:  # a full disk (exit 4), a parent that is a file (exit 2): the temp file is gone
        raise output_error(e, f"--out {out}: cannot write {target}") from None
    return report


def print_report(report: Report, out: Path) -> None:
    skipped = sum(report.skipped.values())
    print(f"kept {report.kept} conversations, skipped {skipped} -> {out}", file=sys.stderr)
    for reason, n in sorted(report.skipped.items()):
        locs = report.where[reason]
        more = f" (+{n - 5} more, see {out.name}.report.json)" if n > 5 else ""
        print(f"  skipped {n} '{reason}': {', '.join(locs[:5])}{more}", file=sys.stderr)
    for bad in report.bad_files:
        print(f"  unreadable: {bad}", file=sys.stderr)


def main(argv: list[str]) -> int:
    """`microgpt pull-hermes3`; bad input raises SourceError (cli.py and the script print it as one line)."""
    ap = ArgParser(prog="microgpt pull-hermes3", description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", help="local copy: a .jsonl/.json/.parquet file or a folder of them")
    ap.add_argument("--out", default="data/hermes3.jsonl", help="normalized JSONL to write")
    ap.add_argument("--repo", default=REPO_ID, help="Hugging Face dataset repo (download only)")
    ap.add_argument("--cache-dir", default=None, help="huggingface_hub cache folder (download only)")
    args = ap.parse_args(argv)
    check_out(Path(args.out))
    src = Path(args.src) if args.src else download(args.repo, args.cache_dir)
    paths = input_files(src)
    if not paths:
        raise SourceError(f"{src}: no {'/'.join(SUFFIXES)} files found")
    out = Path(args.out)
    report = pull(paths, out)
    print_report(report, out)
    if report.bad_files:
        raise SourceError(f"{len(report.bad_files)} input file(s) unreadable (listed above); the rest was kept")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_input_error(main, sys.argv[1:]))
