"""`python -m microgpt ...`: the same as the `microgpt` command."""

import sys

from microgpt.cli import main

sys.exit(main())
