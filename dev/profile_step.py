"""Where a microgpt step's time goes: per-kernel CUDA time of three steps, eager (same kernels as the graph)
or, with --graph, three replays of the captured step, with the wall time per step beside the kernel time.

python3 dev/profile_step.py MB [PRECISION] [--graph] [--modern] [--json PATH]   # ANDREA-120M shape; top kernels
python3 dev/profile_step.py --parts PATH...                          # those files' kernels by part, a column each

--modern profiles the shape's modern twin (bench.bench.MODERN: the modern block, Muon and AdamW) instead of GPT-2's.
--json PATH also writes every kernel's name, calls and CUDA ms a step (a list of objects); --parts groups them by
part of the step (PARTS: the first pattern a kernel's name holds) into the markdown table bench/RESULTS.md shows.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench import MODERN, SHAPE, batches  # noqa: E402
from microgpt.config import TrainConfig  # noqa: E402
from microgpt.engine.backend import triton_backend  # noqa: E402
from microgpt.engine.state import make_state  # noqa: E402
from microgpt.engine.step import Step  # noqa: E402

# (part, the patterns of its kernels' names), first match wins; cuBLASLt's kernels are nvjet_*, FP8 ones nvjet_*_qq*
PARTS = (
    ("FP8 GEMMs (cuBLASLt)", ("_qq",)),
    ("bf16 GEMMs (cuBLAS, cuBLASLt)", ("nvjet", "gemm", "cutlass")),
    ("attention (forward, backward, delta)", ("k_attention",)),
    ("fp8 casts", ("k_cast", "k_roll")),
    ("LayerNorm (forward, backward, dw/db)", ("k_layernorm",)),
    ("cross-entropy row kernel", ("k_crossentropy",)),
    ("GELU's backward pass", ("k_gelu",)),
    ("RMSNorm (modern)", ("k_rmsnorm", "k_residual_rmsnorm")),
    ("QK-norm + rotary (modern)", ("k_qkrope",)),
    ("ReLU^2 passes (modern)", ("k_relu2",)),
    ("Muon: momentum, normalise, update", ("k_muon",)),
    ("AdamW + gradient norm", ("k_adamw", "k_grad_norm")),
    ("memsets, fills, copies", ("Memcpy", "Memset", "FillFunctor")),
    ("embedding, loss sums, other", ("",)),
)


def parts(paths: list[str]) -> str:
    """The kernels of --json files as a markdown table: ms a step per part, a column per file."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    sums = [{name: 0.0 for name, _ in PARTS} for _ in runs]
    for run, acc in zip(runs, sums):
        for k in run["kernels"]:
            acc[next(name for name, pats in PARTS if any(p in k["name"] for p in pats))] += k["ms"]
    head = [f"{r.get('block', 'gpt2')} {r['precision']} mb {r['mb']}" for r in runs]
    lines = ["| part | " + " | ".join(head) + " |", "|---|" + "---|" * len(runs)]
    lines += [f"| {name} | " + " | ".join(f"{acc[name]:.2f}" for acc in sums) + " |" for name, _ in PARTS]
    lines.append("| all kernels | " + " | ".join(f"{r['kernel_ms']:.2f}" for r in runs) + " |")
    lines.append("| step, wall (the same run, unprofiled) | " + " | ".join(f"{r['wall_ms']:.2f}" for r in runs) + " |")
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    if argv and argv[0] == "--parts":
        print(parts(argv[1:]))
        return
    out = None
    if "--json" in argv:
        i = argv.index("--json")
        out = argv[i + 1]
        del argv[i : i + 2]
    args = [a for a in argv if a not in ("--graph", "--modern")]
    graph, modern = "--graph" in argv, "--modern" in argv
    mb = int(args[0]) if args else 8
    precision = args[1] if len(args) > 1 else "bf16"
    m = MODERN["120m"] if modern else SHAPE
    optimizer = "muon" if modern else "adamw"
    t = TrainConfig(micro_batch=mb, n_micro=1, precision=precision, backend="triton", seed=0, optimizer=optimizer)
    S = make_state(m, t, triton_backend(precision))
    step = Step(S, graph=graph)
    data = batches(mb, m)
    for i in range(3):
        step([data[i % 4]], 6e-4)
    t0 = time.perf_counter()
    for i in range(3):  # the wall time, without the profiler's own start and stop
        step([data[i % 4]], 6e-4)
    wall = (time.perf_counter() - t0) / 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            step([data[i % 4]], 6e-4)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
    kernel = sum(e.self_device_time_total for e in prof.key_averages()) / 3 / 1e3
    print(f"{'graph' if graph else 'eager'} mb {mb}: {wall * 1e3:.1f} ms wall per step, {kernel:.1f} ms kernel time")
    if out is not None:
        rows = [
            {"name": e.key, "calls": e.count / 3, "ms": e.self_device_time_total / 3 / 1e3}
            for e in prof.key_averages()
            if e.self_device_time_total > 0
        ]
        Path(out).write_text(
            json.dumps(
                {
                    "mb": mb,
                    "block": m.block,
                    "precision": precision,
                    "graph": graph,
                    "wall_ms": wall * 1e3,
                    "kernel_ms": kernel,
                    "kernels": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
