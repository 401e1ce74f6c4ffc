"""docs/USAGE.md is every command's --help as the CLI prints it (scripts/usage-doc.py makes it), so the reference
of flags cannot drift from argparse; the README's commands name only flags the CLI takes."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO


def test_usage_doc_is_what_the_cli_prints() -> None:
    made = subprocess.run(
        [sys.executable, "scripts/usage-doc.py"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert made.returncode == 0, made.stderr
    assert (REPO / "docs" / "USAGE.md").read_text() == made.stdout, (
        "docs/USAGE.md is not what the CLI prints: run `python scripts/usage-doc.py > docs/USAGE.md`"
    )


def test_every_flag_in_the_readmes_commands_is_one_the_cli_takes() -> None:
    """Each `microgpt COMMAND ... --flag` of the README's code blocks names a flag of that command's --help."""
    usage = (REPO / "docs" / "USAGE.md").read_text()
    helps = dict(re.findall(r"## microgpt (\S+)\n\n```\n(.*?)```", usage, re.S))
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```\n(.*?)```", readme, re.S)
    seen = 0
    for line in (line for block in blocks for line in block.replace("\\\n", " ").splitlines()):
        found = re.search(r"microgpt (\S+)(.*)", line.split("  #")[0])
        if not found or found.group(1) not in helps:
            continue
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", found.group(2)):
            assert re.search(rf"(?<![\w-]){flag}\b", helps[found.group(1)]), (flag, line)
            seen += 1
    assert seen >= 10  # the README's commands were found and read
