"""Where a data-parallel step's time goes: the kernels of captured replays on every rank, side by side.

    python3 dev/dp_profile.py [--gpus 2] [--mb 32] [--precision bf16] [--replays 3] [--baseline DIR] [--out DIR]
    python3 dev/dp_profile.py --summarize DIR [--baseline DIR]   # the summary again, from the traces left in DIR

Each rank builds the ANDREA-120M state (bench/bench.py's shape, random tokens), prepares the step (warm-up and
capture, NCCL all-reduces inside the graph: microgpt/engine/step.py), times 20 steps by the host clock with Step's parts
timed apart (the inputs' copies up to the replay's launch, the launch, the wait for the report after it, and the
replay itself by CUDA events), times the per-step host exchange the trainer does (DataParallel.gather of three
scalars), then records the kernels of --replays replays (torch.profiler, CUPTI) into DIR/trace_rank{r}.json.
Rank 0 then prints, per rank and replay:
- span: first kernel's start to last kernel's end; compute: the time some non-NCCL kernel runs (their union);
- nccl: the NCCL kernels' summed time, and `exposed`, the part of it during which no compute kernel runs;
- each all-reduce's start (ms after the replay's first kernel) and duration, and what runs after the last one;
- idle: the time inside the span when no kernel, copy or memset runs, and its largest pieces, each named by the
  kernels before and after it (where a one-GPU replay's span goes beyond its kernels' time);
- with --baseline (a `--gpus 1` run's DIR): each compute kernel against the same kernel's median time there, summed
  over the kernels that ran beside an all-reduce and over the others, and the kernels that gained most.
--gpus 1 gives the one-GPU replay to compare with. CUPTI timestamps come from one host clock, so the ranks'
replays can be set against each other (`skew`: rank r's replay start minus rank 0's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def rank_main(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from bench.bench import SHAPE, batches
    from microgpt.config import TrainConfig
    from microgpt.engine.backend import triton_backend
    from microgpt.engine.collectives import DataParallel
    from microgpt.engine.state import make_state
    from microgpt.engine.step import Step

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.cuda.set_device(rank)
    dp = None
    if world > 1:
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        dp = DataParallel(rank, world, dist.new_group(backend="gloo"))
    t = TrainConfig(micro_batch=a.mb, n_micro=1, precision=a.precision, backend="triton", seed=0)
    S = make_state(SHAPE, t, triton_backend(a.precision))
    step = Step(S, dp)
    data = batches(a.mb, SHAPE)
    for i in range(6):
        step([data[i % 4]], 6e-4)
    run, marks = step.runs[1], {}  # Step.__call__'s parts, timed apart: the replay's launch marked inside the call
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def marked_run() -> None:
        marks["launch"] = time.perf_counter()
        ev0.record()
        run()
        ev1.record()
        marks["launched"] = time.perf_counter()

    step.runs[1] = marked_run
    phases = []  # (inputs' copies, launch, wait for the report, the replay by CUDA events, the whole call)
    for i in range(20):
        t0 = time.perf_counter()
        step([data[i % 4]], 6e-4)
        t1 = time.perf_counter()
        phases.append(
            (
                marks["launch"] - t0,
                marks["launched"] - marks["launch"],
                t1 - marks["launched"],
                ev0.elapsed_time(ev1) / 1e3,
                t1 - t0,
            )
        )
    step.runs[1] = run
    host = []
    if dp is not None:
        for _ in range(50):
            t0 = time.perf_counter()
            dp.gather([1.0, 0, 0])
            host.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(a.replays):
            step([data[i % 4]], 6e-4)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / f"trace_rank{rank}.json"))
    (out / f"host_rank{rank}.json").write_text(
        json.dumps(
            {
                **{
                    f"{name}_ms_median": 1e3 * statistics.median(p[j] for p in phases)
                    for j, name in enumerate(("copies", "launch", "wait", "replay_gpu", "step"))
                },
                "gather_ms_median": 1e3 * statistics.median(host) if host else None,
                "world": world,
                "mb": a.mb,
                "precision": a.precision,
            }
        )
    )
    step.release()
    if dp is not None:
        dp.barrier()
        dp.close()
    if rank == 0:
        summarize(out, Path(a.baseline) if a.baseline else None)


def replays(path: Path) -> list[list[tuple[float, float, str]]]:
    """The graph replays in a chrome trace: each a list of (start us, end us, name) by start. CUPTI gives every
    kernel of one graph launch that launch's correlation id, so a replay is a correlation id with many kernels
    (the host's copies between replays have ids of their own)."""
    events = json.loads(path.read_text())["traceEvents"]
    acts = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    groups: dict[int, list] = {}
    for e in acts:
        groups.setdefault(e.get("args", {}).get("correlation", -1), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    found = sorted(sorted(g) for g in groups.values() if len(g) > 50)
    if not found:  # no shared ids: split where the GPU idles 300 us (the host's work between replays)
        for k in sorted(k for g in groups.values() for k in g):
            if not found or k[0] - max(e for _, e, _ in found[-1]) > 300:
                found.append([])
            found[-1].append(k)
        found = [g for g in found if len(g) > 50]
    return found


def union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted(iv):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def covered(s: float, e: float, by: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(e, b) - max(s, a)) for a, b in by)


def against(rep: list[tuple[float, float, str]], base: list[list[tuple[float, float, str]]]) -> dict:
    """rep's compute kernels against the same kernels of the one-GPU replays `base` (the median of their times):
    the extra time of those that ran beside an NCCL kernel, of the others, and the kernels that gained most."""
    comp = [k for k in rep if "nccl" not in k[2].lower()]
    nccl = [(s, e) for s, e, n in rep if "nccl" in n.lower()]
    ref = [[k for k in r if "nccl" not in k[2].lower()] for r in base]
    ref = [r for r in ref if [k[2] for k in r] == [k[2] for k in comp]]
    if not ref:
        return {"against_1gpu": "the kernel sequences differ"}
    extra = {True: 0.0, False: 0.0}
    count = {True: 0, False: 0}
    by_name: dict[str, float] = {}
    for i, (s, e, name) in enumerate(comp):
        d = (e - s) - statistics.median(r[i][1] - r[i][0] for r in ref)
        beside = covered(s, e, nccl) > 0
        extra[beside] += d
        count[beside] += 1
        by_name[name[:48]] = by_name.get(name[:48], 0.0) + d
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    return {
        "extra_beside_nccl_ms": extra[True] / 1e3,
        "kernels_beside_nccl": count[True],
        "extra_elsewhere_ms": extra[False] / 1e3,
        "most_extra": [f"{n} {d / 1e3:+.3f}" for n, d in top],
    }


def idle(rep: list[tuple[float, float, str]], top: int = 8) -> dict:
    """The replay's idle time (no activity on the GPU) and its `top` largest gaps, each with what ends before it and
    what starts after it, and the idle summed by the kernel that starts after it."""
    gaps, end, before = [], rep[0][1], rep[0][2]
    for s, e, n in rep[1:]:
        if s > end:
            gaps.append((s - end, before[:36], n[:36]))
        if e > end:
            end, before = e, n
    by_next: dict[str, float] = {}
    for d, _, n in gaps:
        by_next[n] = by_next.get(n, 0.0) + d
    by_next_top = sorted(by_next.items(), key=lambda kv: -kv[1])[:top]
    return {
        "idle_ms": sum(d for d, _, _ in gaps) / 1e3,
        "gaps": len(gaps),
        "gaps_over_5us": sum(d > 5 for d, _, _ in gaps),
        "largest_gaps_us": [f"{d:.1f} {b} -> {n}" for d, b, n in sorted(gaps, reverse=True)[:top]],
        "idle_by_next_ms": [f"{d / 1e3:.3f} {n}" for n, d in by_next_top],
    }


def summarize(out: Path, baseline: Path | None = None) -> None:
    traces = sorted(out.glob("trace_rank*.json"))
    base = replays(baseline / "trace_rank0.json") if baseline else []
    starts = {}
    for path in traces:
        rank = int(path.stem.removeprefix("trace_rank"))
        host = json.loads((out / f"host_rank{rank}.json").read_text())
        for i, rep in enumerate(replays(path)):
            t0 = rep[0][0]
            starts.setdefault(i, {})[rank] = t0
            nccl = [k for k in rep if "nccl" in k[2].lower()]
            comp = union([(s, e) for s, e, n in rep if "nccl" not in n.lower()])
            busy = sum(e - s for s, e in comp)
            exposed = sum((e - s) - covered(s, e, comp) for s, e, _ in nccl)
            last = max((e for _, e, _ in nccl), default=t0)
            after = [f"{(s - t0) / 1e3:.2f}+{(e - s) / 1e3:.3f} {n[:40]}" for s, e, n in rep if s >= last][:6]
            row = {
                "rank": rank,
                "replay": i,
                "span_ms": (max(e for _, e, _ in rep) - t0) / 1e3,
                "compute_ms": busy / 1e3,
                "nccl_ms": sum(e - s for s, e, _ in nccl) / 1e3,
                "exposed_ms": exposed / 1e3,
                "n_kernels": len(rep),
                "skew_ms": (t0 - starts[i].get(0, t0)) / 1e3,
                "allreduce_start+dur_ms": [f"{(s - t0) / 1e3:.2f}+{(e - s) / 1e3:.3f}" for s, e, _ in nccl],
                "after_last_allreduce": after,
                **{k: v for k, v in host.items() if k.endswith("_ms_median")},
            }
            row.update(idle(rep))
            if base:
                row.update(against(rep, base))
            print(json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--mb", type=int, default=32)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--replays", type=int, default=3, help="replays recorded by the profiler")
    p.add_argument("--baseline", metavar="DIR", help="a one-GPU run's traces: each kernel's time against it")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp") + "/dp_profile")
    p.add_argument("--summarize", metavar="DIR", help="print the summary of the traces in DIR and stop")
    a = p.parse_args()
    if a.summarize:
        summarize(Path(a.summarize), Path(a.baseline) if a.baseline else None)
    elif "RANK" in os.environ or a.gpus == 1:
        rank_main(a)
    else:
        from microgpt.run import job

        sys.exit(job.launch([sys.executable, __file__, *sys.argv[1:]], a.gpus))


if __name__ == "__main__":
    main()
