"""Where the inference step's device memory beyond its plan comes from: an ANDREA-120M inference state of B rows
(bf16) prefills and decodes as bench/decode.py and tests/kernels/test_gpu_decode.py do, with torch's allocator
recording every allocation and the Python frames that made it.

    python3 dev/decode_memory.py [--rows 32] [--prompt 512] [--precision bf16]

Prints, after each phase, the allocator's peak and what is allocated now against the plan; then the allocations
that were live at the peak besides the arena, and every allocation of 1 MiB or more besides it, each with the
innermost frames of this repository (or of torch where none is). Nothing here is the engine's: a run of it only
says what to fix.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from microgpt.config import ModelConfig  # noqa: E402
from microgpt.engine import memory, params  # noqa: E402
from microgpt.engine.backend import triton_backend  # noqa: E402
from microgpt.engine.infer import make_infer_state  # noqa: E402

M = ModelConfig(vocab_size=50304, d_model=768, n_layer=12, n_head=12, seq_len=1024)
MIB = 1 << 20


def frames(event: dict, depth: int = 4) -> str:
    """The innermost frames of this repository that led to an allocation (else the innermost of any file)."""
    fs = event.get("frames") or []
    ours = [f for f in fs if str(ROOT) in f.get("filename", "")]
    pick = (ours or fs)[:depth]
    return " <- ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in pick) or "(no frames)"


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """(the peak of live bytes, the allocations live then) over the allocator's trace."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif ev["action"] in ("free_requested", "free_completed") and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    return peak, at_peak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=32, help="the inference plan's rows (B) and the largest decode batch")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens a row in the prefill")
    p.add_argument("--precision", default="bf16")
    args = p.parse_args()
    K = triton_backend(args.precision)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()  # the cuBLAS workspace: the plan's runtime row
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    w = params.init_weights(M, 0)
    S = make_infer_state(M, K, args.rows, w)
    plan = sum(memory.role_bytes(S.plan, K.precision).values())

    def report(phase: str) -> None:
        torch.cuda.synchronize()
        peak, now = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        print(
            f"{phase:<28} peak {peak:>15,} ({(peak - plan) / MIB:+9.1f} MiB vs plan)  now {now:>15,} "
            f"({(now - plan) / MIB:+9.1f} MiB)",
            flush=True,
        )

    print(f"plan {plan:,} bytes; cuBLAS workspace before the state {base:,}", flush=True)
    report("state made")
    rng = np.random.default_rng(0)
    b, t = args.rows, args.prompt
    tokens, _ = S.inputs(b, t)
    K.copy_in(tokens, rng.integers(0, M.vocab_size, (b, t)).astype(np.int32))
    run = K.prepare(lambda: S.run(tokens, 0), False)  # the warm-up: tunes the prefill's shapes
    report(f"prefill warm-up {b}x{t}")
    run()
    report("prefill")
    for rows in (1, args.rows):
        for step in range(3):
            S.decode(
                rng.integers(0, M.vocab_size, rows), rng.integers(0, M.seq_len, rows), rng.permutation(args.rows)[:rows]
            )
            report(f"decode b={rows} step {step}")
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][0]
    arena = max((ev for ev in trace if ev["action"] == "alloc"), key=lambda ev: ev["size"])
    peak, at_peak = live_at_peak(trace)
    print(f"\ntrace peak {peak:,} bytes (the arena {arena['size']:,}); live at the peak besides the arena:")
    for ev in sorted(at_peak, key=lambda ev: -ev["size"]):
        if ev["addr"] != arena["addr"]:
            print(f"  {ev['size']:>13,}  stream {ev.get('stream')}  {frames(ev)}")
    print("\nevery allocation of 1 MiB or more besides the arena:")
    for ev in trace:
        if ev["action"] == "alloc" and ev["size"] >= MIB and ev["addr"] != arena["addr"]:
            print(f"  {ev['size']:>13,}  stream {ev.get('stream')}  {frames(ev)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
