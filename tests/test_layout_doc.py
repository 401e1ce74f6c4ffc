"""docs/LAYOUT.md is a file tree, one line per file, that cannot go stale: every module of microgpt/ is listed, every
file the repository tracks is listed or lies in a folder listed on one line, and nothing listed is missing."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

LINE = re.compile(r"^((?:│   |    )*)(?:├── |└── )(\S+)(?:\s+.*)?$")


def layout() -> list[str]:
    """docs/LAYOUT.md's tree (its first code block) as paths relative to the repository; folders end with "/"."""
    text = (REPO / "docs" / "LAYOUT.md").read_text(encoding="utf-8")
    block = text.split("```\n", 2)[1]
    lines = block.splitlines()
    assert lines[0] == ".", "the tree starts at the repository's root, '.'"
    paths, stack = [], []
    for n, line in enumerate(lines[1:], 2):
        m = LINE.match(line)
        assert m, f"docs/LAYOUT.md, line {n} of the tree is not a tree line: {line!r}"
        depth = len(m.group(1)) // 4
        assert depth <= len(stack), f"docs/LAYOUT.md, line {n}: deeper than its folder: {line!r}"
        stack = stack[:depth] + [m.group(2)]
        paths.append("".join(stack))
    return paths


def suggestion(path: str) -> str:
    """A line to add for a module the tree lacks: its path and its docstring's first line."""
    doc = ast.get_docstring(ast.parse((REPO / path).read_text())) or ""
    return f"  {path}  {doc.splitlines()[0] if doc else ''}"


def test_every_module_is_listed() -> None:
    listed = set(layout())
    modules = sorted(
        str(p.relative_to(REPO)) for p in (REPO / "microgpt").rglob("*.py") if "__pycache__" not in p.parts
    )
    missing = [m for m in modules if m not in listed]
    assert not missing, "docs/LAYOUT.md lacks these modules (one line each, in their folder):\n" + "\n".join(
        suggestion(m) for m in missing
    )


def test_nothing_listed_is_missing() -> None:
    for path in layout():
        p = REPO / path.rstrip("/")
        assert p.exists() or p.is_symlink(), f"docs/LAYOUT.md lists {path}, which does not exist"
        if path.endswith("/"):
            assert p.is_dir(), f"docs/LAYOUT.md lists {path} as a folder; it is a file"
        else:
            assert p.is_symlink() or not p.is_dir(), f"docs/LAYOUT.md lists {path} as a file; it is a folder (add '/')"


def test_every_tracked_file_is_listed_or_in_a_folder_of_one_line() -> None:
    try:
        tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    paths = layout()
    folded = [p for p in paths if p.endswith("/") and not any(q != p and q.startswith(p) for q in paths)]
    files = set(paths)
    left = [f for f in tracked.splitlines() if f not in files and not any(f.startswith(d) for d in folded)]
    assert not left, "docs/LAYOUT.md covers neither these files nor a folder of them:\n" + "\n".join(left)


def test_the_tree_parses_nested_folders() -> None:
    """The parser reads depth from the tree's prefixes: a file two folders down keeps both folders in its path."""
    assert "microgpt/kernels/check/targets.py" in layout() and "microgpt/proxy/vendor/" in layout()
    assert Path(REPO / "microgpt" / "kernels" / "check" / "targets.py").is_file()


def readme_modules() -> dict[str, set[str]]:
    """README's "Files" block: folder -> the module file names its lines give (a line without a folder continues the
    one above)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = text.split("## Files\n", 1)[1].split("```\n", 2)[1]
    found: dict[str, set[str]] = {}
    folder = None
    for line in block.splitlines():
        words = line.split()
        if not line.startswith(" "):
            folder, words = words[0], words[1:]
        assert folder is not None, f"README's Files block starts without a folder: {line!r}"
        found.setdefault(folder, set()).update(words)
    return found


def test_the_readme_names_every_module_in_its_folder() -> None:
    """README.md's Files block names each module of microgpt/ (bar __init__, __main__ and the vendored page files) in
    its own folder's lines, and nothing that does not exist."""
    want: dict[str, set[str]] = {}
    for f in sorted((REPO / "microgpt").rglob("*.py")):
        if "vendor" in f.parts or f.name in ("__init__.py", "__main__.py"):
            continue
        want.setdefault(f.parent.relative_to(REPO).as_posix() + "/", set()).add(f.name)
    assert readme_modules() == want
