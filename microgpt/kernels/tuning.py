"""Choices made once per GPU and shape, cached on disk (DESIGN.md §3: never per call).

The cache is one JSON file per device name under $MICROGPT_CACHE (default ~/.cache/microgpt):
{"gemm": {"<key>": "cublas" | "triton", ...}}. Interpreted runs (TRITON_INTERPRET=1, CI) never time
anything and always use the Triton kernels, so CI exercises the real kernels.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_cache: dict[str, dict[str, str]] | None = None


def cache_path() -> Path:
    root = Path(os.environ.get("MICROGPT_CACHE", Path.home() / ".cache" / "microgpt"))
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return root / f"tuning-{name.replace(' ', '_').replace('/', '_')}.json"


def _load() -> dict[str, dict[str, str]]:
    global _cache
    if _cache is None:
        try:
            _cache = json.loads(cache_path().read_text())
        except (OSError, ValueError):
            _cache = {}
    return _cache


def choices(table: str) -> dict[str, str]:
    """The recorded choices of one table (for the memory plan / bench printout)."""
    return dict(_load().get(table, {}))


def choose(table: str, key: str, candidates: dict[str, Callable[[], None]]) -> str:
    """Return the recorded choice for key, or time every candidate once (median of a short run) and record it.

    MICROGPT_GEMM=cublas|triton forces a choice without timing (useful when the device time is short).
    """
    forced = os.environ.get("MICROGPT_" + table.upper())
    if forced in candidates:
        return forced
    cache = _load().setdefault(table, {})
    if key in cache and cache[key] in candidates:
        return cache[key]
    from triton.testing import do_bench

    times = {name: do_bench(fn, warmup=5, rep=20, return_mode="median") for name, fn in candidates.items()}
    best = min(times, key=times.get)
    cache[key] = best
    try:
        path = cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(_load(), indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache costs a re-time next run, nothing else
    return best
