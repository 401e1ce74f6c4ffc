"""bench/ttl.py's data: the corpus every machine has, gathered and prepared once per shape.

The Python sources of this machine's standard library and site-packages (every machine has them; the GPU machine has
no network; the CPU shape takes the standard library alone, which is the same on every machine of one Python version
whatever is installed, where site-packages change the corpus with every package a venv gains): .py files up to
--corpus-bytes, valid UTF-8 and of at most 1 MB, distinct by content, taken in an order fixed by a hash of their
paths (a spread over all packages, not the first ones alphabetically), linked into one folder and prepared by
`microgpt prep --source FOLDER` (its byte-level BPE of the shape's vocab; the shape's share of the files, 1% at 120M
and 12M, is the val split). Every side reads these shards through microgpt.data: the same batch for (step, micro)
and the same validation windows (the first eval_batches x micro_batch, at every evaluation).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.ttl import Shape

REPO = Path(__file__).resolve().parent.parent
MAX_FILE_BYTES = 1 << 20  # a larger .py is mostly generated data (tables), not code


def say(text: str) -> None:
    """One progress line of bench/ttl.py on stderr."""
    print(f"ttl: {text}", file=sys.stderr, flush=True)


def source_roots(stdlib_only: bool = False) -> list[Path]:
    """This interpreter's standard library and site-packages folders (those that exist, each once), or its standard
    library alone."""
    paths = sysconfig.get_paths()
    packages = () if stdlib_only else (paths["purelib"], paths["platlib"], *site.getsitepackages())
    found = [Path(p).resolve() for p in (paths["stdlib"], *packages)]
    return [p for i, p in enumerate(found) if p.is_dir() and p not in found[:i]]


def python_files(roots: list[Path]) -> list[tuple[int, Path]]:
    """(root index, file) of every regular .py file under the roots; a site-packages inside a root is its own root."""
    out = []
    for k, root in enumerate(roots):
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "site-packages", "dist-packages"))
            out += [(k, Path(folder) / f) for f in sorted(files) if f.endswith(".py")]
    return [(k, f) for k, f in out if f.is_file() and not f.is_symlink()]


def gather(staging: Path, max_bytes: int, stdlib_only: bool = False) -> dict[str, Any]:
    """Link up to max_bytes of distinct UTF-8 .py sources into staging/<root index>/<path>, in the order of a hash of
    their paths; what was taken."""
    roots = source_roots(stdlib_only)
    files = python_files(roots)
    files.sort(key=lambda kf: hashlib.sha1(f"{kf[0]}/{kf[1].relative_to(roots[kf[0]])}".encode()).digest())
    shutil.rmtree(staging, ignore_errors=True)
    seen: set[bytes] = set()
    taken = total = 0
    for k, f in files:
        try:
            body = f.read_bytes()
            body.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        digest = hashlib.sha1(body).digest()
        if len(body) > MAX_FILE_BYTES or not body.strip() or digest in seen:
            continue
        seen.add(digest)
        dest = staging / str(k) / f.relative_to(roots[k])
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(f, dest)
        taken, total = taken + 1, total + len(body)
        if total >= max_bytes:
            break
    return {"roots": [str(r) for r in roots], "files_found": len(files), "files": taken, "bytes": total}


def prepare(shape: Shape, folder: Path) -> dict[str, Any]:
    """The shape's shards in folder/data (gathered and prepared unless there already); prep.json's record."""
    data, record = folder / "data", folder / "prep.json"
    if (data / "manifest.json").is_file() and record.is_file():
        return json.loads(record.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    staging = folder / "sources"
    found = gather(staging, shape.corpus_bytes, shape.stdlib_only)
    t1 = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "microgpt.cli",
        "prep",
        "--source",
        str(staging),
        "--out",
        str(data),
        "--vocab-size",
        str(shape.vocab_size),
        "--val-fraction",
        str(shape.val_fraction),
        "--quiet",
    ]
    say(f"prep: {found['files']:,} files, {found['bytes'] / 1e6:,.0f} MB of Python source; {' '.join(cmd[1:])}")
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    shutil.rmtree(staging, ignore_errors=True)
    if res.returncode:
        raise SystemExit(f"error: microgpt prep failed (exit {res.returncode}): {res.stderr.strip()[-2000:]}")
    manifest = json.loads((data / "manifest.json").read_text())
    info = {
        **found,
        "gather_s": round(t1 - t0, 2),
        "prep_s": round(time.monotonic() - t1, 2),
        "cores": os.cpu_count(),
        "command": cmd,
        "vocab_size": manifest["vocab_size"],
        "train_tokens": manifest["splits"]["train"]["tokens"],
        "val_tokens": manifest["splits"]["val"]["tokens"],
        "val_bytes_per_token": manifest["val_bytes_per_token"],
    }
    record.write_text(json.dumps(info, indent=1) + "\n")
    if info["train_tokens"] < shape.min_tokens:
        say(
            f"prep: only {info['train_tokens']:,} train tokens, fewer than {shape.min_tokens:,}: this machine's "
            f"Python sources hold {found['bytes'] / 1e6:,.0f} MB (the sides may see some tokens twice)"
        )
    say(
        f"prep: train {info['train_tokens']:,} tokens, val {info['val_tokens']:,}; gather {info['gather_s']} s, "
        f"prep {info['prep_s']} s on {info['cores']} cores"
    )
    return info
