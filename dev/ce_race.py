"""Does the cross-entropy row kernel with the gradient (training's fused call) report the losses of the kernel
without it, every launch? (issue 35: a loss that did not repeat.)

    python3 dev/ce_race.py [--reps 200] [--rows 4096] [--vocab 4096 50304] [--configs NAME ...]

For each launch configuration of crossentropy.ROW_CONFIGS and each vocabulary: a bf16 logits chunk of random values
(the scale of a fresh model's logits), the losses of k_crossentropy_fwd without GRAD once, then `reps` launches
with GRAD, the chunk restored before each; one JSON line per (config, vocab) with the launches whose losses differ
in any bit and the rows that differed. Run it with PYTHONPATH at an older package to count before a change.
"""

import argparse
import json

import torch

from microgpt.kernels import crossentropy as kc


def count(name: str, rows: int, V: int, reps: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(rows + V)
    saved = (torch.randn(rows, V, device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
    targets = torch.randint(0, V, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    dlosses = torch.full((rows,), 1.0 / rows, device="cuda")
    f32 = dict(device="cuda", dtype=torch.float32)
    want, lse, losses = torch.empty(rows, **f32), torch.empty(rows, **f32), torch.empty(rows, **f32)
    logits = saved.clone()
    kc.row_launch(want, lse, logits, targets, None, V, *kc.ROW_CONFIGS[name])()
    bad, bad_rows = 0, 0
    for _ in range(reps):
        logits.copy_(saved)
        kc.row_launch(losses, lse, logits, targets, dlosses, V, *kc.ROW_CONFIGS[name])()
        n = int((losses.view(torch.int32) != want.view(torch.int32)).sum())
        bad, bad_rows = bad + (n > 0), bad_rows + n
    return {
        "config": name,
        "vocab": V,
        "rows": rows,
        "reps": reps,
        "launches_differing": bad,
        "rows_differing": bad_rows,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--vocab", type=int, nargs="+", default=[4096, 50304])
    p.add_argument("--configs", nargs="+", default=list(kc.ROW_CONFIGS), help="ROW_CONFIGS names (default: all)")
    a = p.parse_args()
    for V in a.vocab:
        for name in a.configs:
            print(json.dumps(count(name, a.rows, V, a.reps)), flush=True)


if __name__ == "__main__":
    main()
