"""Choices made once per GPU and shape, cached on disk: never per call, so a step never pays for a choice.

The cache is one JSON file per device name under $MICROGPT_CACHE (default ~/.cache/microgpt):
{"gemm": {"<key>": "cublas" | "triton" | "lt<i>", ...}, "attention_fwd": {"<key>": "<config index>"}, ...}.

A choice not in the cache is timed only inside `window()`, which the runtime opens around the warm-up run of the
optimizer step (kernels/runtime.py): the candidates run on the warm-up's own buffers, whose values the step throws
away, and are timed with CUDA events, so timing allocates no device memory (triton's do_bench would take a 256 MB
cache-flush buffer, and its autotuner copies of the outputs, beyond the memory plan). Outside the window an
unrecorded key gets the first candidate, untimed and unrecorded. The one device buffer the choices use, the GEMM
probe, is planned (memory.py "kernel" role) and handed over with `set_probe`.
Interpreted runs (TRITON_INTERPRET=1, CI) never time anything and always use the Triton kernels, so CI exercises
the real kernels.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
REPS = 10  # runs per timed batch of a candidate, after one untimed
SPIN_CYCLES = 4_000_000  # ~2 ms at an H200's clock: longer than the host takes to queue REPS launches
_cache: dict[str, dict[str, str]] | None = None
_open = False
_probe: torch.Tensor | None = None


# Raised when a table gains candidates, so that choices made without them are timed again rather than kept
# (2: cuBLASLt's algorithms for every GEMM).
CACHE_VERSION = 2


def cache_path() -> Path:
    root = Path(os.environ.get("MICROGPT_CACHE", Path.home() / ".cache" / "microgpt"))
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return root / f"tuning-v{CACHE_VERSION}-{name.replace(' ', '_').replace('/', '_')}.json"


def _load() -> dict[str, dict[str, str]]:
    global _cache
    if _cache is None:
        try:
            _cache = json.loads(cache_path().read_text())
        except (OSError, ValueError):
            _cache = {}
    return _cache


@contextmanager
def window() -> Iterator[None]:
    """While open, choices not yet made are timed (on buffers whose values the caller discards)."""
    global _open
    _open = True
    try:
        yield
    finally:
        _open = False


def is_open() -> bool:
    return _open


def set_probe(probe: torch.Tensor) -> None:
    """The planned fp32 buffer the GEMM choice compares candidates' results in."""
    global _probe
    _probe = probe


def probe() -> torch.Tensor:
    if _probe is None:
        raise RuntimeError("no GEMM probe buffer: the backend is not bound to a memory plan")
    return _probe


def choices(table: str) -> dict[str, str]:
    """The recorded choices of one table (for the bench printout)."""
    return dict(_load().get(table, {}))


def _time(fn: Callable[[], None]) -> float:
    """Milliseconds a run of fn takes on the GPU: REPS runs between two events on the current stream, queued
    behind a spin of the GPU (torch.cuda._sleep) so that the events time the kernels, not the host launching them
    (a 10-30 us kernel launched alone from Python times as its launch; the step replays them from a CUDA graph,
    back to back). The median of three such batches; allocates nothing."""
    fn()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        for _ in range(REPS):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPS)
    return statistics.median(times)


def choose(table: str, key: str, candidates: dict[str, Callable[[], None]]) -> str:
    """The recorded choice for key; or, inside the window, time every candidate and record the fastest; or else
    the first candidate. MICROGPT_<TABLE>=name forces a choice without timing (MICROGPT_GEMM=cublas|triton|lt0);
    MICROGPT_TUNING_LOG=1 prints every candidate's time to stderr as it is chosen."""
    forced = os.environ.get("MICROGPT_" + table.upper())
    if forced in candidates:
        return forced
    cache = _load().setdefault(table, {})
    if key in cache and cache[key] in candidates:
        return cache[key]
    if not _open:
        return next(iter(candidates))
    times, failed = {}, {}
    for name, fn in candidates.items():
        try:
            times[name] = _time(fn)
        except Exception as e:  # one this GPU or compiler cannot run (shared memory, an unsupported feature) is out
            lines = str(e).strip().splitlines() or [""]
            failed[name] = f"{type(e).__name__}: {lines[-1][:200]}"
    if not times:
        raise RuntimeError(f"no candidate of {table} {key} runs: {failed}")
    best = cache[key] = min(times, key=times.__getitem__)
    if os.environ.get("MICROGPT_TUNING_LOG"):
        print(f"tuning {table} {key}: " + " ".join(f"{n}={t:.4f}ms" for n, t in times.items()) + f" -> {best}"
              + "".join(f"\ntuning {table} {key}: {n} failed: {why}" for n, why in failed.items()),
              file=sys.stderr, flush=True)  # fmt: skip
    try:
        path = cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(_load(), indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache costs a re-time next run, nothing else
    return best


_launches: dict[tuple[str, str], str] = {}


def launch(table: str, key: str, configs: dict[str, tuple[Any, ...]],
           make: Callable[..., Callable[[], None]]) -> None:  # fmt: skip
    """Run make(*configs[name]) with the configuration `choose` gives for key, for kernels whose launch
    configurations agree up to rounding (the fp8 casts give the same bytes under every one; the LayerNorm
    backward's weight-gradient sums differ in their last bits, the MLP's GELU in the GEMM's epilogue in a's last bit)
    and which may run several times on the warm-up's buffers. The interpreter takes the first. A choice is remembered
    for the process: a launch costs a lookup."""
    if INTERPRET:
        make(*next(iter(configs.values())))()
        return
    choice = _launches.get((table, key))
    if choice is None:
        choice = choose(table, key, {name: make(*cfg) for name, cfg in configs.items()})
        if _open or key in choices(table):  # outside the warm-up an unrecorded key gets the first, not kept
            _launches[(table, key)] = choice
    make(*configs[choice])()
