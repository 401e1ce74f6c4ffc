"""microgpt: small GPT training with hand-written forward/backward op pairs."""

import os

__version__ = "0.1.0"  # the one place (pyproject.toml reads it)

# Read by NumPy's OpenBLAS when it loads, so set here, before anything imports NumPy (a value the user set stays):
# an idle OpenBLAS thread spins 2^18 cycles, not its default 2^28, then sleeps, and leaves the cores to the NumPy
# backend's own threads in the passes between the GEMMs (microgpt/ops/rows.py; bench/RESULTS.md measured it).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "18")
