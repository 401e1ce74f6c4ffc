"""The fp8 weights' cast of one optimizer step at ANDREA-120M's shape (one H200), as the step runs it and as it ran
before, with AdamW beside it. Each way is captured in one CUDA graph (dev/timing.py), after the warm-up window has
tuned every launch:

    per weight       a memset, an amax launch and a cast launch per site weight and the head's (147 launches)
    stacked          one memset, amax launch and cast launch per site over every layer, and the head's (15)
    stacked, taken   the step's: the stacked casts taking the amaxes AdamW recorded, then their clearing (6)
    adamw            kernels/adamw.adamw_step over all the parameters, without fp8's amax table
    adamw, amaxes    the step's: with the table, each E4M3 weight's amax recorded on the way

The step's weights are "adamw, amaxes" + "stacked, taken"; before this change they were "adamw" + "per weight".

    python3 dev/weight_cast_bench.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench import SHAPE  # noqa: E402
from dev.timing import captured  # noqa: E402
from microgpt.config import TrainConfig  # noqa: E402
from microgpt.engine import params  # noqa: E402
from microgpt.engine.backend import triton_backend  # noqa: E402
from microgpt.engine.state import make_state  # noqa: E402
from microgpt.kernels import adamw as kadamw  # noqa: E402
from microgpt.kernels import fp8_cast  # noqa: E402


def main() -> None:
    t = TrainConfig(micro_batch=1, n_micro=1, precision="fp8", backend="triton", seed=0)
    S = make_state(SHAPE, t, triton_backend("fp8"))
    mm, weights, amaxes = S.prec.mm, [*S.prec.sites, S.prec.head], S.prec.amaxes
    assert amaxes is not None, "this plan has no amax table"

    def per_weight() -> None:
        for w in weights:
            mm.cast_weights([w])

    def stacked() -> None:
        mm.cast_weights(weights)

    def taken() -> None:
        mm.cast_weights(weights, amaxes)

    A = S.arena
    A["hyper"][:4].copy_(torch.tensor([1e-4, 0.1, 0.001, 1.0]))
    A["decay_mask"].copy_(torch.from_numpy(params.decay_mask(SHAPE)))
    args = (
        S.p,
        S.g,
        S.adam_m,
        S.adam_v,
        A["decay_mask"],
        S.p_compute,
        A["hyper"],
        A["report"][1:2],
        0.9,
        0.95,
        1e-8,
        0.1,
        1.0,
    )

    def adamw() -> None:
        kadamw.adamw_step(*args)

    def adamw_amaxes() -> None:
        S.K.adamw_step(*args)  # bound to the plan's table and amaxes

    with mm.tuner.window():
        per_weight()
        stacked()
        taken()
    n_master = sum(w.master.numel() for w in weights)
    print(f"{len(weights)} weights, {n_master:,} fp32 masters; {len(fp8_cast.stack(weights))} launches of each kind")
    ways = {
        "per weight": per_weight,
        "stacked": stacked,
        "stacked, taken": taken,
        "adamw": adamw,
        "adamw, amaxes": adamw_amaxes,
    }
    for name, fn in ways.items():
        _, us = captured(fn, reps=5)
        print(f"{name:16s} {us:8.1f} us")


if __name__ == "__main__":
    main()
