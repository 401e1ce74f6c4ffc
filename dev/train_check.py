"""GPU checks of the engine on the triton backend (run on the GPU machine, results as JSON lines).

    python3 dev/train_check.py EXPERIMENT.json OUTDIR [--steps 200] [--numpy-steps K] [--precision fp16]

1. a --steps run: loss line, peak device memory at step 10 and at the end, against the planned bytes;
2. determinism: a second run of 30 steps with the same seed must give bitwise-equal losses;
3. resume: from the first run's checkpoint at steps/2, 30 more steps must repeat the first run's losses exactly;
4. with --numpy-steps K: K steps of the same experiment (same data) on the numpy backend in fp32, in this process,
   and the first K losses of both side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from microgpt import config  # noqa: E402
from microgpt.engine import memory  # noqa: E402
from microgpt.run.trainer import Trainer  # noqa: E402


def trainer(exp_path: str, steps: int, out: Path, precision: str | None = None, backend: str | None = None) -> Trainer:
    exp = config.override(config.load(exp_path), f"train.steps={steps}")
    if precision:
        exp = config.override(exp, f"train.precision={precision}")
    if backend:
        exp = config.override(exp, f"train.backend={backend}")
    if exp.data.source == "shards" and not Path(exp.data.path).is_dir():  # the GPU machine carries only builtin
        exp = config.override(config.override(exp, 'data.path=""'), "data.source=builtin")
    return Trainer(exp, out)


def live_blocks(arena_bytes: int) -> None:
    """One JSON line per live device block other than the arena, with the project frames that allocated it."""
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated" and blk["size"] != arena_bytes:
                frames = [
                    f"{Path(f['filename']).name}:{f['line']}:{f['name']}"
                    for f in blk.get("frames", [])
                    if "microgpt" in f["filename"] or "/dev/" in f["filename"]
                ][:6]
                print(json.dumps({"event": "block", "size": blk["size"], "frames": frames}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("experiment")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--numpy-steps", type=int, default=0)
    p.add_argument("--precision", help="override train.precision (fp32, bf16, fp16, fp8)")
    a = p.parse_args()
    out = Path(a.out)
    trace = os.environ.get("MICROGPT_MEMTRACE") == "1"  # list the live device blocks beside the arena at steps 1, 10
    if trace:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    torch.cuda.reset_peak_memory_stats()
    tr = trainer(a.experiment, a.steps, out / "run", a.precision)
    planned = sum(memory.role_bytes(tr.S.plan, tr.K.precision).values())  # the arena and cuBLAS's workspace

    losses, mem, ckpt, t0 = [], {}, None, time.time()
    for _ in range(a.steps):
        rec = tr.train_step()
        losses.append(rec["loss"])
        if tr.step in (1, 10, a.steps):
            mem[tr.step] = torch.cuda.max_memory_allocated()
            if tr.step == 1:  # after compile, GEMM and attention choices and capture: the steady state starts here
                torch.cuda.reset_peak_memory_stats()
            print(json.dumps({**rec, "peak": mem[tr.step], "planned": planned}))
            if trace and tr.step in (1, 10):
                live_blocks(tr.S.arena.nbytes)
        if tr.step == a.steps // 2:
            ckpt = tr.save("periodic")
    val = tr.evaluate()
    print(
        json.dumps(
            {
                "event": "run",
                "steps": a.steps,
                "wall_s": time.time() - t0,
                "first": losses[:5],
                "last": losses[-5:],
                "val_loss": val,
                "planned": planned,
                "peak": mem,
                "precision": tr.K.precision.name,
                "loss_scale": tr.S.scaler.scale,
            }
        )
    )
    del tr
    tr2 = trainer(a.experiment, a.steps, out / "run2", a.precision)
    again = [tr2.train_step()["loss"] for _ in range(30)]
    print(
        json.dumps(
            {
                "event": "determinism",
                "equal": again == losses[:30],
                "first_diff": next((i for i, (x, y) in enumerate(zip(again, losses)) if x != y), None),
            }
        )
    )
    del tr2
    tr3 = trainer(a.experiment, a.steps, out / "run3", a.precision)
    tr3.load(ckpt)
    n = min(30, a.steps - a.steps // 2)  # the resumed steps the first run also made
    resumed = [tr3.train_step()["loss"] for _ in range(n)]
    k = a.steps // 2
    print(
        json.dumps(
            {
                "event": "resume",
                "equal": resumed == losses[k : k + n],
                "resumed": resumed[:3],
                "original": losses[k : k + 3],
            }
        )
    )
    if a.numpy_steps:
        ref = trainer(a.experiment, a.steps, out / "numpy", "fp32", "numpy")
        ref_losses = [ref.train_step()["loss"] for _ in range(a.numpy_steps)]
        rel = [abs(x - y) / abs(y) for x, y in zip(losses, ref_losses)]
        print(
            json.dumps(
                {"event": "vs_numpy", "triton": losses[: a.numpy_steps], "numpy": ref_losses, "max_rel": max(rel)}
            )
        )


if __name__ == "__main__":
    main()
