"""The GPU architectures the kernels are built for, and every launch of kernels/ compiled ahead of time for each.

    TARGETS            compute capability -> the limits one block of a kernel must fit there
    rows_of(...)       every distinct kernel binary the launches of catalogue.py bind to, per target
    compile_rows(...)  each compiled for its targets: shared memory, registers and spills, and any write-after-read
                       race inside a program that check/hazards.py finds in its TTGIR (`Usage`)

Triton compiles ahead of time for any target on any machine: `triton.compile(src, target=GPUTarget("cuda", cc,
32))` runs the whole pipeline through ptxas (which ships with triton) with no GPU and no driver. A launch's
arguments are bound for a target as JITFunction.run binds them (the same specialization: integers equal to 1,
16-byte divisibility), so a compile here is the one a launch there makes. Registers and spills (the stack frame
ptxas spills registers to) come from the cubin (cuobjdump's resource usage): Triton reports them only once a kernel
is loaded on a device.

On a GPU the runtime reads nothing of this: Triton compares a compiled kernel's shared memory with the device's own
limit before it launches anything and raises OutOfResources, which the tuner takes as the candidate not fitting that
device (tuning.py). This is what CI checks (tests/kernels/test_targets.py) and bench/RESULTS.md shows:
`python -m microgpt.kernels.check.targets` prints the whole sweep at the ANDREA-12M and ANDREA-120M shapes and the
modern block's at ANDREA-120M's size (`--ci`: the part CI compiles, `select`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from microgpt.kernels.check.catalogue import ANDREA, MODERN, Launch, Shape, jit_kernels, launches
from microgpt.kernels.check.hazards import hazards


@dataclass(frozen=True)
class Target:
    """What one block of a kernel may use on an architecture (the CUDA programming guide's table of compute
    capabilities): shared memory per block (the opt-in maximum, static and dynamic together), registers per
    thread and per block."""

    cc: int  # compute capability as Triton writes it: 86 for 8.6
    cards: str  # what has it
    shared: int  # bytes
    regs_thread: int = 255
    regs_block: int = 65536

    @property
    def fp8(self) -> bool:
        """FP8 tensor cores (E4M3): the fp8 precision's kernels compile here."""
        return self.cc >= 89

    @property
    def tma(self) -> bool:
        """TMA (Hopper's tensor memory accelerator): the GEMM tiles of gemm_tma.py compile here."""
        return self.cc >= 90


TARGETS = {80: Target(80, "A100, A30", 163 * 1024), 86: Target(86, "RTX 30x0, A10, A40, RTX A6000", 99 * 1024),
           89: Target(89, "RTX 40x0, L4, L40S", 99 * 1024), 90: Target(90, "H100, H200", 227 * 1024)}  # fmt: skip


@dataclass(frozen=True)
class Usage:
    shared: int  # bytes a block: Triton's dynamic shared memory plus the cubin's static
    regs: int  # per thread
    stack: int  # bytes of stack frame per thread: what ptxas spilled of the registers
    threads: int  # per block
    hazards: tuple[str, ...] = ()  # write-after-read races inside a program (check/hazards.py): none is the rule


def bind(launch: Launch, target: Target) -> tuple[str, dict[str, Any]]:
    """The launch's compile job for target, bound as JITFunction.run binds it (its specialization and options), and
    the key that identifies it (equal keys: the same kernel binary)."""
    kernel, kwargs = launch.kernel, {**launch.kwargs, "debug": False, "instrumentation_mode": ""}
    backend = make_backend(GPUTarget("cuda", target.cc, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    job = {
        "name": launch.name,
        "signature": signature,
        "constexprs": constexprs,
        "attrs": attrs,
        "options": options.__dict__,
        "cc": target.cc,
    }
    return repr(sorted((k, repr(v)) for k, v in job.items())), job


def compile_job(job: dict[str, Any]) -> Usage:
    """One bound launch compiled for its target; its resource usage read back from the cubin."""
    kernel = jit_kernels()[job["name"]]
    src = ASTSource(kernel, job["signature"], job["constexprs"], job["attrs"])
    compiled = triton.compile(src, target=GPUTarget("cuda", job["cc"], 32), options=job["options"])
    res = cubin_usage(compiled.asm["cubin"])
    return Usage(
        compiled.metadata.shared + res["SHARED"],
        res["REG"],
        res["STACK"],
        compiled.metadata.num_warps * 32,
        tuple(hazards(compiled.asm["ttgir"])),
    )


def cubin_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED (static), LOCAL of the one kernel in a cubin, by cuobjdump (the one triton ships)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        )
    line = next(line for line in out.stdout.splitlines() if "REG:" in line)
    return {k: int(v) for k, v in re.findall(r"\b([A-Z]+):(\d+)", line)}


@dataclass
class Row:
    """One distinct kernel binary: a kernel under one configuration, the launches that bind to it, and its usage on
    each target it was compiled for."""

    kernel: str
    label: str  # its first launch's
    config: str  # the keywords its first launch passes (constexprs and launch options)
    shapes: list[str]
    launches: list[Launch]
    jobs: dict[int, tuple[str, dict[str, Any]]]  # target cc -> (key, job): where it can be compiled
    usage: dict[int, Usage]

    @property
    def fixed(self) -> bool:
        return any(launch.group < 0 for launch in self.launches)

    @property
    def tma(self) -> bool:
        """A TMA tile (sm_90 and newer)."""
        return any(launch.tma for launch in self.launches)

    @property
    def default(self) -> bool:
        """A default of its choice (the candidate taken outside the warm-up and in the interpreter)."""
        return any(launch.index == 0 and launch.group >= 0 for launch in self.launches)

    def fits(self, target: Target) -> bool:
        u = self.usage[target.cc]
        return u.shared <= target.shared and u.regs <= target.regs_thread and u.regs * u.threads <= target.regs_block


def rows_of(shapes: list[Shape], dtypes: list[torch.dtype], targets: list[Target]) -> list[Row]:
    """Every distinct kernel binary of `launches` over shapes x dtypes on the targets (fp8's only where the target
    has FP8, the TMA tiles' only where it has TMA), not yet compiled: launches that bind alike on every target are
    one row."""
    found: dict[tuple[str, ...], Row] = {}
    for s in shapes:
        for dtype in dtypes:
            for launch in launches(s, dtype):
                jobs = {
                    t.cc: bind(launch, t) for t in targets if (t.fp8 or not launch.fp8) and (t.tma or not launch.tma)
                }
                key = (launch.name, *(k for k, _ in jobs.values()))
                row = found.setdefault(key, Row(launch.name, launch.label, _config(launch), [], [], jobs, {}))
                row.launches.append(launch)
                if s.name not in row.shapes:
                    row.shapes.append(s.name)
    return sorted(found.values(), key=lambda r: (r.kernel, r.label, r.config))


def select(rows: list[Row], full: bool = False) -> dict[int, set[int]]:
    """Row index -> the targets to compile it for. The whole sweep (full) compiles every row for each of its
    targets; CI compiles what has no alternative on a device: each fixed launch and each choice's default (the
    candidate taken outside the warm-up and in the interpreter), on every target; and the TMA tiles on sm_90, few
    binaries sized to its shared memory (up to 208 KiB of its 227), so that a change that no longer fits or spills
    is seen before a Hopper GPU drops the candidate. The other candidates are left to the full sweep: where one does
    not fit, the tuner drops it on that device."""
    return {i: set(r.jobs) if full or r.fixed or r.default or r.tma else set() for i, r in enumerate(rows)}


def _config(launch: Launch) -> str:
    """The constexprs and options a launch passes by keyword, as one short string (the kernel's configuration)."""
    return " ".join(f"{k}={v}" for k, v in sorted(launch.kwargs.items()) if not isinstance(v, torch.Tensor))


def compile_rows(rows: list[Row], chosen: dict[int, set[int]], jobs: int = 0) -> list[Row]:
    """Compile each row for the targets `chosen` gives it (`select`), `jobs` compiles at a time (0: one per CPU);
    fills in each row's usage."""
    todo = {}
    for i, r in enumerate(rows):
        for cc in sorted(chosen[i]):
            key, job = r.jobs[cc]
            todo[key] = job
    with ProcessPoolExecutor(jobs or os.cpu_count()) as pool:
        done = dict(zip(todo, pool.map(compile_job, todo.values())))
    for r in rows:
        r.usage = {cc: done[key] for cc, (key, _) in r.jobs.items() if key in done}
    return rows


def format_table(rows: list[Row], targets: list[Target]) -> str:
    """The sweep as a markdown table: per target shared KiB, registers a thread and spilled (stack) bytes a thread,
    "over" where it does not fit; "-" where it was not compiled, "no fp8" below sm_89, "no TMA" below sm_90."""
    head = "| kernel | candidate | configuration | shapes | " + " | ".join(f"sm_{t.cc}" for t in targets) + " |"
    lines = [head, "|" + "---|" * (4 + len(targets))]
    for r in rows:
        cells = []
        for t in targets:
            u = r.usage.get(t.cc)
            if u is None:
                cells.append("-" if t.cc in r.jobs else "no TMA" if r.tma else "no fp8")
            else:
                cells.append(f"{u.shared / 1024:.1f} KiB, {u.regs} r, {u.stack} B" + ("" if r.fits(t) else " **over**"))
        lines.append(f"| {r.kernel} | {r.label} | {r.config} | {', '.join(r.shapes)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


DTYPES = (torch.bfloat16, torch.float32)  # fp16 compiles to bf16's tiles and shared memory (same element size)


def to_json(rows: list[Row]) -> list[dict[str, Any]]:
    """The rows as plain data (the test reads them from the sweep's process)."""
    return [
        {
            "kernel": r.kernel,
            "label": r.label,
            "config": r.config,
            "shapes": r.shapes,
            "fixed": r.fixed,
            "default": r.default,
            "targets": sorted(r.jobs),
            "usage": {cc: asdict(u) for cc, u in r.usage.items()},
        }
        for r in rows
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m microgpt.kernels.check.targets", description=__doc__.splitlines()[0])
    p.add_argument("--cc", type=int, nargs="+", default=list(TARGETS), help="compute capabilities (86 for 8.6)")
    p.add_argument("--ci", action="store_true", help="only what the CI test compiles (fixed launches, defaults)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--jobs", type=int, default=0, help="compiles at a time (0: one per CPU)")
    args = p.parse_args(argv)
    targets = [TARGETS[cc] for cc in args.cc]
    rows = rows_of([*ANDREA, *MODERN], list(DTYPES), targets)
    compile_rows(rows, select(rows, full=not args.ci), args.jobs)
    print(format_table(rows, targets))
    for r in rows:
        for cc, u in r.usage.items():
            for h in u.hazards:
                print(f"race: {r.kernel} ({r.label}) on sm_{cc}: {h}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernels": sorted(jit_kernels()), "rows": to_json(rows)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
