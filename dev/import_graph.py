"""The package's shape, read from the source (issue 45's "what must be shown"): its modules, how many sit at the top
level, the longest chain of imports, and the modules that name fp8 outside its homes.

    python dev/import_graph.py                  this tree's microgpt/
    python dev/import_graph.py --commit 8b79859 microgpt/ as that commit holds it (git archive into a temporary folder)

The graph is tests/test_imports.py's (`import_graph`: module- and function-level imports), the fp8 criterion
tests/test_fp8_homes.py's (`naming_fp8`: identifiers and string constants of the code, not comments or docstrings).
The longest chain is the longest path of the import graph (it has no cycle: test_imports checks), counted in
modules; of equally long chains the first in sorted order is printed.
"""

from __future__ import annotations

import argparse
import functools
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.test_fp8_homes import ALLOWED, naming_fp8  # noqa: E402
from tests.test_imports import PKG, import_graph  # noqa: E402


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest path a -> b -> ... of imports (a imports b), the first in sorted order among the longest."""

    @functools.cache
    def from_(name: str) -> tuple[str, ...]:
        tails = sorted((from_(dep) for dep in graph[name]), key=lambda c: (-len(c), c))
        return (name, *(tails[0] if tails else ()))

    return list(min((from_(name) for name in graph), key=lambda c: (-len(c), c)))


def describe(pkg: Path) -> dict[str, object]:
    graph = import_graph(pkg)
    top = sorted(name for name in graph if name.count(".") <= 1 and not (pkg / name.split(".")[-1]).is_dir())
    return {
        "modules": len(graph),
        "top_level": top,
        "longest_chain": longest_chain(graph),
        "naming_fp8": naming_fp8(pkg),
    }


def at_commit(commit: str, into: Path) -> Path:
    """microgpt/ as `commit` holds it, unpacked under `into`."""
    data = subprocess.run(["git", "archive", commit, "microgpt"], cwd=PKG.parent, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(data.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into / "microgpt"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commit", help="read microgpt/ at this commit instead of the working tree")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pkg = at_commit(args.commit, Path(tmp)) if args.commit else PKG
        d = describe(pkg)
    chain, fp8 = d["longest_chain"], d["naming_fp8"]
    print(f"modules: {d['modules']}")
    print(f"top level: {len(d['top_level'])}: {', '.join(n.split('.')[-1] for n in d['top_level'])}")
    print(f"longest import chain: {len(chain)} modules: {' -> '.join(chain)}")
    print(f"modules naming fp8 outside its homes: {len(fp8)} ({sum(n in ALLOWED for n in fp8)} of them allowed now)")
    for name, words in fp8.items():
        print(f"  {name}{' (allowed)' if name in ALLOWED else ''}: {', '.join(map(repr, words))}")


if __name__ == "__main__":
    main()
