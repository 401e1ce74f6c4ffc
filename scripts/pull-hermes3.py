#!/usr/bin/env python3
"""Pull NousResearch's Hermes-3 chat dataset (or read a local copy), validate, write normalized JSONL.

The same as `microgpt pull-hermes3`; see microgpt/hermes.py for the flags (--help).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout without installing

from microgpt.hermes import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
