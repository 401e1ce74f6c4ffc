"""The fp8 weights' cast of one optimizer step at ANDREA-120M's shape (one H200), as the step runs it and as it ran
before, with AdamW beside it for scale. Each way is captured in one CUDA graph (dev/timing.py), after the warm-up
window has tuned every launch:

    per weight     one amax launch and one cast launch per site weight and the head's (98 launches, 49 memsets)
    stacked        kernels/fp8.Matmul.cast_weights: one launch pair per site over every layer, and the head's
    stacked, cast  the stacked cast launches alone, without their amax launches (what the weights' cast would cost if
                   AdamW left each weight's amax in its slot)
    adamw          kernels/adamw.adamw_step over all the parameters

    python3 dev/weight_cast_bench.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench import SHAPE  # noqa: E402
from dev.timing import captured  # noqa: E402
from microgpt import params  # noqa: E402
from microgpt.backend import triton_backend  # noqa: E402
from microgpt.config import TrainConfig  # noqa: E402
from microgpt.kernels import fp8  # noqa: E402
from microgpt.state import make_state  # noqa: E402


def main() -> None:
    t = TrainConfig(micro_batch=1, n_micro=1, precision="fp8", backend="triton", seed=0)
    S = make_state(SHAPE, t, triton_backend("fp8"))
    mm, weights = S.prec.mm, [*S.prec.sites, S.prec.head]
    stacks = fp8.stack(weights)

    def per_weight() -> None:
        for w in weights:
            mm.cast_weights([w])

    def stacked() -> None:
        mm.cast_weights(weights)

    def cast_only() -> None:
        for master, w8, w8t, scale in stacks:
            fp8.cast(mm.tuner, master, scale, w8, w8t, prime=False, hist=0)

    A = S.arena
    A["hyper"].copy_(torch.tensor([1e-4, 0.1, 0.001, 1.0]))
    A["decay_mask"].copy_(torch.from_numpy(params.decay_mask(SHAPE)))

    def adamw() -> None:
        S.K.adamw_step(S.p, S.g, S.adam_m, S.adam_v, A["decay_mask"], S.p_compute, A["hyper"], A["report"][1:2],
                       0.9, 0.95, 1e-8, 0.1, 1.0)  # fmt: skip

    with mm.tuner.window():
        per_weight()
        stacked()
        cast_only()
    n_master = sum(w.master.numel() for w in weights)
    print(f"{len(weights)} weights, {n_master:,} fp32 masters; {len(stacks)} stacked launch pairs")
    for name, fn in (("per weight", per_weight), ("stacked", stacked), ("stacked, cast", cast_only),
                     ("adamw", adamw)):  # fmt: skip
        _, us = captured(fn, reps=5)
        print(f"{name:16s} {us:8.1f} us")


if __name__ == "__main__":
    main()
