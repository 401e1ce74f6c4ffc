"""Row chunks: how the NumPy reference runs a pass that is independent row by row, written once for every op.

GELU, LayerNorm, the loss head's softmax, AdamW (the flat arrays as rows) and attention (batch elements as rows) each
write their reference once, as a function of a range of rows, `fn(i, j)` over rows i .. j - 1, and hand it to
`Rows.run(fn, n, width)` (or `Rows.map(fn, *arrays)`, which hands fn the arrays' rows i .. j - 1):

    the rows 0 .. n - 1 are cut into consecutive ranges of about CHUNK elements (width elements a row, at least
    one row a range), so that the several passes an op makes over its arrays find them in the core's cache;
    with more than one thread each takes an equal span of the rows (the caller runs one of them) and cuts it into
    such ranges; the spans run at once: NumPy's loops and BLAS calls release the GIL.

    per_thread=True cuts one range a thread instead, for passes whose NumPy calls cost more in their fixed part
    (the setup of a short-row reduction, during which NumPy holds the GIL) than cache misses do: LayerNorm's.

Each range writes only its own rows and computes every row exactly as it would alone, so the results are bit for
bit the same for any thread count and any cut (tests/ops/test_rows.py checks it). What is not row by row stays
outside, over the whole array: LayerNorm's dw and db, sums over the rows, keep their one order.

The thread count (`cpu_threads`) follows NumPy's BLAS: OPENBLAS_NUM_THREADS, else OMP_NUM_THREADS, else the CPUs
this process may run on, so that one setting governs the GEMMs and the passes between them. The GEMMs and these
passes take turns on the same cores, so OpenBLAS's idle threads must not hold them: by default they spin for 2^28
cycles after each GEMM, which takes the core from the pool's thread in every pass; microgpt/__init__.py sets
OPENBLAS_THREAD_TIMEOUT (2^18 cycles, then they sleep) before NumPy loads. And while the spans run, NumPy's OpenBLAS
runs on one thread (`openblas_threads`: its own get/set functions), so that a BLAS call inside a span (attention's
per-head GEMMs) runs on the thread that made it: two spans each calling OpenBLAS on two threads wait for each other's
BLAS threads, which made a 2-thread step's attention several times slower than one thread's (bench/RESULTS.md).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from numpy.typing import NDArray

CHUNK = 1 << 17  # elements a range: 512 KiB an fp32 array, two or three of which fit a core's L2 cache
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")  # the order OpenBLAS reads them in


def cpu_threads(env: Mapping[str, str] = os.environ) -> int:
    """The threads the NumPy backend runs on: the first of THREAD_VARS that holds a positive integer, else the CPUs
    this process may run on."""
    for var in THREAD_VARS:
        value = env.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return len(os.sched_getaffinity(0)) if sys.platform == "linux" else os.cpu_count() or 1


def openblas_threads() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """NumPy's OpenBLAS's (get_num_threads, set_num_threads), under scipy-openblas's names or OpenBLAS's own, from
    the library this process loaded with NumPy; None where NumPy's BLAS is another or the platform has no
    /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "openblas" in line), None)
    except OSError:
        return None
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    fns = []
    for fn in ("get_num_threads", "set_num_threads"):
        names = (f"scipy_openblas_{fn}64_", f"scipy_openblas_{fn}", f"openblas_{fn}64_", f"openblas_{fn}")
        f = next((getattr(lib, name) for name in names if hasattr(lib, name)), None)
        if f is None:
            return None
        fns.append(f)
    fns[0].restype, fns[1].argtypes = ctypes.c_int, [ctypes.c_int]
    return fns[0], fns[1]


@dataclass(frozen=True)
class Rows:
    """Runs row-range functions over consecutive ranges of about `chunk` elements, on `threads` threads (the caller
    and a pool of the rest)."""

    threads: int = 1
    pool: ThreadPoolExecutor | None = None
    chunk: int = CHUNK
    blas: tuple[Callable[[], int], Callable[[int], None]] | None = None  # openblas_threads()

    @classmethod
    def make(cls, threads: int, chunk: int = CHUNK) -> Rows:
        if threads <= 1:
            return cls(threads, None, chunk)
        return cls(threads, ThreadPoolExecutor(threads - 1, "microgpt-rows"), chunk, openblas_threads())

    def run(self, fn: Callable[[int, int], None], n: int, width: int = 1, per_thread: bool = False) -> None:
        """fn(i, j) for consecutive ranges i .. j covering rows 0 .. n - 1: each thread takes an equal span of the
        rows, cut into ranges of about chunk // width rows (width: the elements a row), or with per_thread its
        whole span as one range. fn must not call run itself (the pool's threads would wait on each other)."""
        if n <= 0:
            return
        workers = min(self.threads, n) if self.pool is not None else 1
        step = n if per_thread else max(1, self.chunk // max(1, width))
        spans = [(k * n // workers, (k + 1) * n // workers) for k in range(workers)]
        blocks = [[(i, min(i + step, hi)) for i in range(lo, hi, step)] for lo, hi in spans]
        blas = self.blas if len(blocks) > 1 else None
        if blas is not None:  # each thread's BLAS calls run on that thread alone (the module docstring says why)
            blas_threads = blas[0]()
            blas[1](1)
        futures = [self.pool.submit(_run_block, fn, block) for block in blocks[1:]] if self.pool is not None else []
        try:
            _run_block(fn, blocks[0])
        finally:
            for f in futures:  # every block is done (or failed) before the caller reads the arrays
                f.result()
            if blas is not None:
                blas[1](blas_threads)

    def map(self, fn: Callable[..., object], *arrays: NDArray, per_thread: bool = False) -> None:
        """fn(*(a[i:j] for a in arrays)) over ranges of rows of arrays that have the same rows (the first one's row
        size sets the ranges; per_thread: one range a thread)."""
        first = arrays[0]
        width = first.size // max(1, len(first))
        self.run(lambda i, j: fn(*(a[i:j] for a in arrays)), len(first), width, per_thread)


def _run_block(fn: Callable[[int, int], None], ranges: list[tuple[int, int]]) -> None:
    for i, j in ranges:
        fn(i, j)


SERIAL = Rows()  # the default of every op that takes `rows`: one thread (tests call the ops without a backend)
