"""Choices made once per GPU and shape, cached on disk: never per call, so a step never pays for a choice.

A `Tuner` holds them for one device. The runtime makes it (kernels/runtime.py) and the backend hands it to every
launcher that makes a choice, as it hands out planned scratch (engine/backend.py): nothing here is module state,
so two devices, or two runtimes of one device, never share a choice they did not both time.

The cache is one JSON file per device, keyed by the GPU's name and compute capability, under $MICROGPT_CACHE
(default ~/.cache/microgpt): {"gemm": {"<key>": "cublas" | "triton" | "lt<i>", ...}, "attention_fwd": {...}, ...}.

A choice not in the cache is timed only inside `window()`, which the runtime opens around the warm-up run of the
optimizer step: the candidates run on the warm-up's own buffers, whose values the step throws away, and are timed
with CUDA events, so timing allocates no device memory (triton's do_bench would take a 256 MB cache-flush buffer,
and its autotuner copies of the outputs, beyond the memory plan). Outside the window an unrecorded key gets the
first candidate, untimed and unrecorded. The one device buffer the choices use, the GEMM probe, is planned
(memory.py "kernel" role) and handed over with `set_probe`.
Interpreted runs (TRITON_INTERPRET=1, CI) never time anything and always run the first candidate, so CI exercises
the real kernels.

Candidates differ by device. Triton compares a compiled kernel's shared memory (and, once loaded, its threads'
registers) with the device's own limits before it launches anything, and raises OutOfResources: a candidate that
raises it does not fit this device, and is neither timed nor run here (a note on stderr says so once); `launch` then
runs the next that fits. So a device is offered exactly the candidates that fit it, whatever its architecture
(the H200's 227 KB of shared memory a block fits every one; sm_86 and sm_89's 99 KB not all: kernels/targets.py
compiles them all for each architecture on the CPU, and bench/RESULTS.md has the table).
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
from triton.runtime.errors import OutOfResources

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
REPS = 10  # runs per timed batch of a candidate, after one untimed
SPIN_MS = 2.0  # the GPU spins this long before a timed batch: longer than the host takes to queue REPS launches
# Raised when a table gains candidates, so that choices made without them are timed again rather than kept
# (2: cuBLASLt's algorithms for every GEMM; 3: the Hopper TMA tiles in gemm, mlp_act and mlp_dact).
CACHE_VERSION = 3


def device_key() -> str:
    """The cache's name for this process's GPU: its name and compute capability ("cpu" without one)."""
    if not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name().replace(' ', '_').replace('/', '_')}-sm{major}{minor}"


def cache_path(key: str) -> Path:
    root = Path(os.environ.get("MICROGPT_CACHE", Path.home() / ".cache" / "microgpt"))
    return root / f"tuning-v{CACHE_VERSION}-{key}.json"


class Tuner:
    """One device's recorded choices (loaded from its cache file on first use), the tuning window, the GEMM probe,
    and the launch choices this process has settled."""

    def __init__(self, key: str | None = None) -> None:
        self.key = device_key() if key is None else key
        self.path = cache_path(self.key)
        self._cache: dict[str, dict[str, str]] | None = None
        self._open = False
        self._probe: torch.Tensor | None = None
        self._launches: dict[tuple[str, str], str] = {}
        self._spin_cycles = 0
        self._said: set[str] = set()

    def note(self, key: str, message: str) -> None:
        """Say message on stderr once for this device (key: what it is about)."""
        if key not in self._said:
            self._said.add(key)
            print(f"note: {message}", file=sys.stderr, flush=True)

    def unfit(self, table: str, name: str, e: OutOfResources) -> None:
        """Candidate `name` of `table` does not fit this device (Triton's OutOfResources, raised before launching)."""
        self.note(
            f"unfit {table} {name}",
            f"{table} candidate {name} does not fit {self.key} ({e.name}: needs "
            f"{e.required}, the device has {e.limit}); it is not offered on this device",
        )

    def _load(self) -> dict[str, dict[str, str]]:
        if self._cache is None:
            try:
                self._cache = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self._cache = {}
        return self._cache

    @contextmanager
    def window(self) -> Iterator[None]:
        """While open, choices not yet made are timed (on buffers whose values the caller discards)."""
        self._open = True
        try:
            yield
        finally:
            self._open = False

    @property
    def is_open(self) -> bool:
        return self._open

    def set_probe(self, probe: torch.Tensor) -> None:
        """The planned fp32 buffer the GEMM choice compares candidates' results in."""
        self._probe = probe

    def probe(self) -> torch.Tensor:
        if self._probe is None:
            raise RuntimeError("no GEMM probe buffer: the backend is not bound to a memory plan")
        return self._probe

    def choices(self, table: str) -> dict[str, str]:
        """The recorded choices of one table (for the bench printout)."""
        return dict(self._load().get(table, {}))

    def recorded(self) -> dict[str, dict[str, str]]:
        """Every table's recorded choices."""
        return {table: dict(keys) for table, keys in self._load().items()}

    def _spin(self) -> int:
        """GPU cycles in SPIN_MS on this device, measured once (its clock: nothing assumed of the card)."""
        if not self._spin_cycles:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(1_000_000)
            end.record()
            end.synchronize()
            self._spin_cycles = max(1, int(1_000_000 * SPIN_MS / max(start.elapsed_time(end), 1e-3)))
        return self._spin_cycles

    def _time(self, fn: Callable[[], None]) -> float:
        """Milliseconds a run of fn takes on the GPU: REPS runs between two events on the current stream, queued
        behind a spin of the GPU (torch.cuda._sleep) so that the events time the kernels, not the host launching
        them (a short kernel launched alone from Python times as its launch, not as itself; the step replays them
        from a CUDA graph, back to back). The median of three such batches; allocates nothing."""
        fn()
        times = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(self._spin())
            start.record()
            for _ in range(REPS):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / REPS)
        return statistics.median(times)

    def choose(self, table: str, key: str, candidates: dict[str, Callable[[], None]]) -> str:
        """The recorded choice for key; or, inside the window, time every candidate and record the fastest; or else
        the first candidate. MICROGPT_<TABLE>=name forces a choice without timing (MICROGPT_GEMM=cublas|triton|lt0);
        MICROGPT_TUNING_LOG=1 prints every candidate's time to stderr as it is chosen."""
        forced = os.environ.get("MICROGPT_" + table.upper())
        if forced in candidates:
            return forced
        cache = self._load().setdefault(table, {})
        if key in cache and cache[key] in candidates:
            return cache[key]
        if not self._open:
            return next(iter(candidates))
        times, failed = {}, {}
        for name, fn in candidates.items():
            try:
                times[name] = self._time(fn)
            except OutOfResources as e:
                self.unfit(table, name, e)
                failed[name] = str(e)
            except Exception as e:  # one this GPU or compiler cannot run (shared memory, an unsupported feature) is out
                lines = str(e).strip().splitlines() or [""]
                failed[name] = f"{type(e).__name__}: {lines[-1][:200]}"
        if not times:
            raise RuntimeError(f"no candidate of {table} {key} runs: {failed}")
        best = cache[key] = min(times, key=times.__getitem__)
        if os.environ.get("MICROGPT_TUNING_LOG"):
            print(
                f"tuning {table} {key}: "
                + " ".join(f"{n}={t:.4f}ms" for n, t in times.items())
                + f" -> {best}"
                + "".join(f"\ntuning {table} {key}: {n} failed: {why}" for n, why in failed.items()),
                file=sys.stderr,
                flush=True,
            )
        self._save()
        return best

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._load(), indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError:
            pass  # an unwritable cache costs a re-time next run, nothing else

    def launch(
        self, table: str, key: str, configs: dict[str, tuple[Any, ...]], make: Callable[..., Callable[[], None]]
    ) -> None:
        """Run make(*configs[name]) with the configuration `choose` gives for key, for kernels whose launch
        configurations agree up to rounding (the fp8 casts give the same bytes under every one; the LayerNorm
        backward's weight-gradient sums differ in their last bits, the MLP's GELU in the GEMM's epilogue in a's
        last bit, the attention's sums in their order) and which may run several times on the warm-up's buffers.
        The interpreter takes the first. A choice that does not fit this device (outside the warm-up: the untimed
        first) gives way to the next configuration that does. A choice is remembered for the process: a launch costs
        a lookup. MICROGPT_<TABLE>=name forces one at every launch."""
        if INTERPRET:
            make(*next(iter(configs.values())))()
            return
        forced = os.environ.get("MICROGPT_" + table.upper())  # wins at every launch (choose: no time, no record)
        choice = forced if forced in configs else self._launches.get((table, key))
        if choice is None:
            choice = self.choose(table, key, {name: make(*cfg) for name, cfg in configs.items()})
            if self._open or key in self.choices(table):  # outside the warm-up an unrecorded key: not kept
                self._launches[(table, key)] = choice
        for name in [choice, *(n for n in configs if n != choice)]:
            try:
                make(*configs[name])()
            except OutOfResources as e:  # raised before anything ran
                self.unfit(table, name, e)
                continue
            if name != choice and (table, key) in self._launches:  # the settled choice: the one that runs here
                self._launches[(table, key)] = name
            return
        raise RuntimeError(f"no launch configuration of {table} {key} fits {self.key}")
