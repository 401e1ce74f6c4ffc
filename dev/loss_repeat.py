"""Do two identical GPU runs report the same losses? (issue 35: the printed loss must repeat to the bit.)

    python3 dev/loss_repeat.py [--steps 80] [--precision bf16] [--mb 16] [--n-micro 4] [--env K=V ...]
                               [--experiment experiments/ANDREA-12M-MODERN-TRAIN.json]

Runs ANDREA-12M's shape (or --experiment's model and optimizer) on fixed random batches (no data files) twice, each
in a fresh process with one tuning cache
(the second reuses the first's recorded choices, as a rerun on one machine does), and prints one JSON line: the
steps whose reported loss, micro-batch losses or gradient norm differ, and whether the final weights are the same
bits. --env sets variables for both runs (e.g. MICROGPT_GEMM=triton forces a GEMM way; LOSS_REPEAT_FP8_TILE=1 runs fp8's
GEMMs on the Triton scaled tile instead of torch._scaled_mm), to bisect a difference.
--runs N runs N children (the first tunes, the others reuse its choices) and compares each with the first, and the
second with the third: a difference only against the first points at what tuning leaves behind. For each differing
step it names the micro-batches whose loss differs and the buffers (lnf, ce_lse, losses, dln, report, fp8's slots;
the last micro-batch's values after the step) whose bytes differ.
A run is `--child`: it prints its per-step report, buffer digests and the weights' sha256.

    python3 dev/loss_repeat.py --replays 20 [--precision fp8]

replays one step's CUDA graph on the same batch with nothing updated (gscale = inf, as the warm-up; fp8's
histories first filled by 8 replays), and says for
each buffer on the way to the reported loss (lnf, the logits chunk, lse, losses, report) in how many replays and
elements it differed from the first: where a difference starts is where the order varies.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def fp8_gemms_on_the_tile() -> None:
    """Replace fp8's library GEMMs (torch._scaled_mm, cuBLASLt) by the Triton scaled tile (gemm.k_mm_scaled, as the
    interpreter runs it): to see whether a difference comes from the library's FP8 GEMM."""
    from microgpt.kernels import gemm

    def mm_scaled(self, out, a, ia, b, ib, accumulate=False, wgrad=None):  # noqa: ANN001, ANN202
        gemm.triton_mm_scaled(out, a, ia, b, ib, accumulate)

    gemm.Gemm.mm_scaled = mm_scaled


def child(a: argparse.Namespace) -> None:
    import numpy as np

    if os.environ.get("LOSS_REPEAT_FP8_TILE") == "1":
        fp8_gemms_on_the_tile()

    from microgpt.engine.backend import triton_backend
    from microgpt.engine.state import make_state
    from microgpt.engine.step import Step

    m, t = shape(a)
    S = make_state(m, t, triton_backend(a.precision))
    step = Step(S)
    rng = np.random.default_rng(0)
    data = [
        [
            tuple(rng.integers(0, m.vocab_size, (a.mb, m.seq_len)).astype(np.int32) for _ in range(2))
            for _ in range(a.n_micro)
        ]
        for _ in range(8)
    ]
    rows, digests = [], []
    for i in range(a.steps):
        r = step(data[i % len(data)], 1e-3)
        rows.append([r.loss, r.grad_norm, *r.micro_losses])
        digests.append({n: digest(S.arena[n]) for n in DIGESTS if n in S.arena})
    sha = hashlib.sha256(S.K.to_numpy(S.p).tobytes()).hexdigest()
    print(json.dumps({"rows": rows, "sha": sha, "digests": digests}))


def shape(a: argparse.Namespace):  # noqa: ANN201
    """(model, train) of the runs: ANDREA-12M's shape (GPT-2 block, AdamW), or --experiment's model and optimizer
    (the modern block and Muon, say) at --mb, --n-micro and --precision."""
    from dataclasses import replace

    from microgpt import config
    from microgpt.config import ModelConfig, TrainConfig

    over = dict(micro_batch=a.mb, n_micro=a.n_micro, precision=a.precision, backend="triton", seed=1337)
    if a.experiment:
        exp = config.load(a.experiment)
        return exp.model, replace(exp.train, **over)
    return ModelConfig(vocab_size=4096, d_model=384, n_layer=6, n_head=6, seq_len=512), TrainConfig(**over)


DIGESTS = ("lnf", "ce_lse", "losses", "dln", "report", "fp8_slots", "fp8_head_slots", "fp8_wscales")


def digest(x) -> str:  # noqa: ANN001
    """The sha1 of a device buffer's bytes (its last micro-batch's values after a step)."""
    import torch

    return hashlib.sha1(x.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:12]


def replays(a: argparse.Namespace) -> None:
    import math

    import numpy as np

    from microgpt.engine.backend import triton_backend
    from microgpt.engine.state import make_state
    from microgpt.engine.step import Step

    m, t = shape(a)
    S = make_state(m, t, triton_backend(a.precision))
    step = Step(S)
    rng = np.random.default_rng(0)
    batch = [
        tuple(rng.integers(0, m.vocab_size, (a.mb, m.seq_len)).astype(np.int32) for _ in range(2))
        for _ in range(a.n_micro)
    ]
    for _ in range(3):  # past fp8's priming step, onto the graph
        step(batch, 1e-3)
    step._hyper(1e-3, math.inf)  # nothing updated from here on: every replay sees the same weights and inputs
    for _ in range(8):  # and fp8's amax histories (16 micro-batches) hold only these replays' amaxes
        step.runs[a.n_micro]()
    names = ("lnf", "logits", "ce_lse", "losses", "report")
    seen: dict[str, list] = {n: [] for n in names}
    for _ in range(a.replays):
        step.runs[a.n_micro]()
        for n in names:
            seen[n].append(S.K.to_numpy(S.arena[n]).copy())
    out = {}
    for n in names:
        diffs = [int((x != seen[n][0]).sum()) for x in seen[n][1:]]
        out[n] = {"replays_differing": sum(d > 0 for d in diffs), "max_elements": max(diffs, default=0)}
    print(json.dumps({"precision": a.precision, "replays": a.replays, "env": a.env, **out}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--experiment", help="an experiment file whose model and optimizer the runs take (ANDREA-12M's)")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--mb", type=int, default=16)
    p.add_argument("--n-micro", type=int, default=4)
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--child", action="store_true")
    p.add_argument("--replays", type=int, default=0)
    p.add_argument("--runs", type=int, default=2, help="children (the first tunes, the others reuse its choices)")
    a = p.parse_args()
    if a.child:
        child(a)
        return
    if a.replays:
        os.environ.update(dict(kv.split("=", 1) for kv in a.env))
        replays(a)
        return
    env = {**os.environ, **dict(kv.split("=", 1) for kv in a.env)}
    env.setdefault("MICROGPT_CACHE", tempfile.mkdtemp(prefix="loss-repeat-"))
    args = [
        sys.executable,
        __file__,
        "--child",
        "--steps",
        str(a.steps),
        "--precision",
        a.precision,
        "--mb",
        str(a.mb),
        "--n-micro",
        str(a.n_micro),
        *(["--experiment", a.experiment] if a.experiment else []),
    ]
    runs = []
    for _ in range(a.runs):
        out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    for j in range(1, len(runs)):
        compare(a, runs[0], runs[j], f"1-{j + 1}")
    if len(runs) > 2:
        compare(a, runs[1], runs[2], "2-3")


def compare(a: argparse.Namespace, r1: dict, r2: dict, pair: str) -> None:
    """One JSON line: the steps whose report differs between two runs, and at each which buffers (their last
    micro-batch's values) differ."""
    (x, y) = (r1["rows"], r2["rows"])
    diff = [i + 1 for i, (u, v) in enumerate(zip(x, y)) if u != v]
    buffers = {i: sorted(n for n, d in r1["digests"][i - 1].items() if r2["digests"][i - 1][n] != d) for i in diff}
    micro = {i: [j for j, (u, v) in enumerate(zip(x[i - 1][2:], y[i - 1][2:])) if u != v] for i in diff}
    first = diff[0] - 1 if diff else None
    print(
        json.dumps(
            {
                "pair": pair,
                "precision": a.precision,
                "env": a.env,
                "steps": a.steps,
                "differ_at": diff,
                "micro_batches": micro,
                "buffers": buffers,
                "weights_equal": r1["sha"] == r2["sha"],
                "first": None if first is None else {"a": x[first], "b": y[first]},
            }
        )
    )


if __name__ == "__main__":
    main()
