#!/usr/bin/env python3
"""Pull NousResearch's Hermes-3 chat dataset (or read a local copy), validate, write normalized JSONL.

The same as `microgpt pull-hermes3`; see microgpt/data/pull.py for the flags (--help).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout without installing

from microgpt.data.pull import main  # noqa: E402
from microgpt.errors import exit_on_input_error  # noqa: E402

if __name__ == "__main__":
    sys.exit(exit_on_input_error(main, sys.argv[1:]))
