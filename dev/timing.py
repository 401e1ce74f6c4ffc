"""The dev scripts' kernel timer: calls captured in one CUDA graph, timed by events over its replays."""

from __future__ import annotations

import torch

REPS = 20


def captured(fn, reps: int = REPS) -> tuple[torch.cuda.CUDAGraph, float]:
    """fn captured reps times in one CUDA graph (after one run on a side stream, as capture wants), and the median of
    five replays in us per call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return g, sorted(times)[2]
