#!/usr/bin/env python3
"""Prepare the megachat corpus: mix sources, train the BPE tokenizer, write token shards.

The same as `microgpt prep`; see microgpt/data/prep.py for the flags (--help).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout without installing

from microgpt.data.prep import main  # noqa: E402
from microgpt.errors import exit_on_input_error  # noqa: E402

if __name__ == "__main__":
    sys.exit(exit_on_input_error(main, sys.argv[1:]))
