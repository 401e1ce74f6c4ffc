"""How long the GPU waits for the host between two steps, and what a leaner host path would give back.

    python3 dev/host_gap.py [MB ...]            # ANDREA-120M shape, bf16, one H200; default micro-batches 8 32

For each micro-batch, after the warm-up and capture, per step (median of --steps steps, each way run twice in turn):
- step:       Step.__call__ as the trainer and bench/bench.py call it (inputs copied from pageable host arrays, the
              graph replayed, the report read back), then torch.cuda.synchronize() as bench.py does;
- lean:       the same inputs from pinned host buffers by asynchronous copies, the replay, the report copied into a
              pinned buffer and waited for by an event: one synchronization a step;
- pipelined:  lean with step k+1 queued before step k's report is read (double-buffered pinned buffers): the GPU
              never waits for the host; what a trainer acting one step late would get;
- replays:    the captured graph replayed back to back with no inputs or report: the GPU's own time a step.
step - replays is the host's share of a step; lean and pipelined say how much of it a host path can take back.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench import SHAPE, batches  # noqa: E402
from microgpt.backend import triton_backend  # noqa: E402
from microgpt.config import TrainConfig  # noqa: E402
from microgpt.state import make_state  # noqa: E402
from microgpt.step import Step  # noqa: E402

LR = 6e-4


def main() -> None:
    mbs = [int(a) for a in sys.argv[1:]] or [8, 32]
    for mb in mbs:
        measure(mb, n=40)


def measure(mb: int, n: int) -> None:
    t = TrainConfig(micro_batch=mb, n_micro=1, precision="bf16", backend="triton", grad_clip=1.0, seed=0)
    S = make_state(SHAPE, t, triton_backend("bf16"))
    A, step, data = S.arena, Step(S), batches(mb, SHAPE)
    for i in range(3):
        step([data[i % 4]], LR)  # warm-up, capture, two replays
    names = ("tokens", "targets", "hyper", "loss_scale")
    pinned = [{k: torch.empty_like(A[k], device="cpu").pin_memory() for k in names} for _ in range(2)]
    reports = [torch.empty_like(A["report"], device="cpu").pin_memory() for _ in range(2)]
    events = [torch.cuda.Event() for _ in range(2)]

    def fill(j: int, i: int) -> None:
        x, y = data[i % 4]
        p = pinned[j]
        p["tokens"].numpy()[0] = x
        p["targets"].numpy()[0] = y
        h = np.zeros(p["hyper"].shape)
        h[:4] = [LR, 1 - t.beta1 ** (S.step + 1), 1 - t.beta2 ** (S.step + 1), 1.0]
        p["hyper"].numpy()[:] = h
        p["loss_scale"].numpy()[:] = 1.0

    def enqueue(j: int) -> None:
        for k in names:
            A[k].copy_(pinned[j][k], non_blocking=True)
        step.run()
        reports[j].copy_(A["report"], non_blocking=True)
        events[j].record()

    def way_step() -> list[float]:
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            step([data[i % 4]], LR)
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out

    def way_lean() -> list[float]:
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            fill(0, i)
            enqueue(0)
            events[0].synchronize()
            reports[0].numpy().tolist()
            S.step += 1
            out.append(time.perf_counter() - t0)
        return out

    def way_pipelined() -> list[float]:
        out = []
        fill(0, 0)
        enqueue(0)
        t0 = time.perf_counter()
        for i in range(1, n + 1):
            fill(i % 2, i)
            enqueue(i % 2)
            events[(i - 1) % 2].synchronize()
            reports[(i - 1) % 2].numpy().tolist()
            S.step += 1
            t1 = time.perf_counter()
            out.append(t1 - t0)
            t0 = t1
        events[n % 2].synchronize()
        return out

    def way_replays() -> list[float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step.run()
        torch.cuda.synchronize()
        return [(time.perf_counter() - t0) / n] * n

    ways = {"step": way_step, "lean": way_lean, "pipelined": way_pipelined, "replays": way_replays}
    rows: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(2):
        for k, f in ways.items():
            f()  # settle the clock on this way's rhythm first
            rows[k].append(statistics.median(f()) * 1e3)
    floor = statistics.fmean(rows["replays"])
    for k, ms in rows.items():
        mean = statistics.fmean(ms)
        print(
            f"mb {mb:3d} {k:10s} " + " ".join(f"{v:7.3f}" for v in ms) + f"  ms/step; mean {mean:.3f}, "
            f"{mb * SHAPE.seq_len / mean * 1e3:,.0f} tokens/s, host share {mean - floor:+.3f} ms"
        )


if __name__ == "__main__":
    main()
