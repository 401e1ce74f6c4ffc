"""Does the tied LM head keep the loss in FP8? The NumPy reference in precision "fp8" trains on the same data and seed
once per head variant:

    fp32      the head's three GEMMs exact (fp32), the block linears in E4M3
    fp8-fwd   the engine's own fp8 head (microgpt/fp8.py Fp8Head): the logits GEMM on E4M3 x and wte, x cast whole
              at its own amax, both gradient GEMMs exact
    fp8       every head GEMM on E4M3 operands: logits = x8 @ wte8^T, dx += g8 @ wte8, dwte += g8^T @ x8, each
              operand cast per chunk by its own amax (current scaling, the rule of microgpt/fp8.py), fp32 sums
    fp8-g32   as fp8 with the logits' gradient left in fp32
    fp8-e5m2  as fp8 with the logits' gradient in E5M2 at its own amax (more range, one mantissa bit less)

Evaluation runs the same head as training.

    python3 dev/fp8_head_check.py [EXPERIMENT] [--steps N] [--out DIR] [--heads fp32 fp8-fwd fp8 fp8-g32 fp8-e5m2]
                                  [--set K=V]       # default ANDREA-tiny, 300 steps, fp32 fp8

Prints one JSON line per run (validation loss at every eval, train losses) and the relative differences: a
measurement on the CPU reference (the variants other than fp8-fwd exist only here).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from microgpt import config, fp8  # noqa: E402
from microgpt.fp8 import Fp8Head  # noqa: E402
from microgpt.ops import crossentropy as ce  # noqa: E402
from microgpt.ops.fp8 import cast  # noqa: E402
from microgpt.trainer import Trainer  # noqa: E402

HEADS = ("fp32", "fp8-fwd", "fp8", "fp8-g32", "fp8-e5m2")
EXACT = {name: getattr(ce, name) for name in ("crossentropy_forward", "crossentropy_forward_backward")}


def _e4m3(x: np.ndarray) -> np.ndarray:
    """x through E4M3 at its own amax (a fresh slot: current scaling), back in fp32: E4M3 values times the power of
    two 2^-k, exact, so a product of two of them is mm8's up to the order of the fp32 sums."""
    q, inv = cast(x, np.zeros(fp8.OSLOT, np.float32), current=True)
    return q.astype(np.float32) * inv


def _e5m2(x: np.ndarray) -> np.ndarray:
    """x through E5M2 at its own amax, back in fp32: the scale is the power of two 2^k with k the largest integer such
    that amax * 2^k <= 57,344 (E5M2's largest finite value), as microgpt/fp8.py's rule for E4M3's 448."""
    import ml_dtypes

    amax = float(np.abs(x).max())
    k = 0 if amax == 0.0 else int(np.floor(np.log2(57344.0 / amax)))
    while amax * 2.0**k > 57344.0:
        k -= 1
    q = np.clip(x * np.float32(2.0**k), -57344.0, 57344.0).astype(ml_dtypes.float8_e5m2)
    return q.astype(np.float32) * np.float32(2.0**-k)


def _chunk_fp8(x: np.ndarray, wte8: np.ndarray, tgt: np.ndarray, losses: np.ndarray, lse: np.ndarray, z: np.ndarray):
    """ce._chunk_exp on E4M3 operands; returns (row sums, x's E4M3 copy)."""
    x8 = _e4m3(x)
    np.matmul(x8, wte8.T, out=z)
    return ce._chunk_exp(z, tgt, losses, lse), x8


def _exact(wte):
    """The head's fp32 weight: the engine hands fp8 runs an Fp8Head, whose compute copy is the masters here."""
    return wte.w if isinstance(wte, Fp8Head) else wte


def exact(fn, *args) -> None:
    """An engine crossentropy entry point with the head's GEMMs all exact."""
    fn(*(_exact(a) for a in args))


def forward_fp8(losses, lse, x, wte, targets, logits) -> None:
    N, R = x.shape[0], logits.shape[0]
    wte = _exact(wte)
    wte8 = _e4m3(wte)
    for i in range(0, N, R):
        j = min(i + R, N)
        _chunk_fp8(x[i:j], wte8, targets[i:j], losses[i:j], lse[i:j], logits[: j - i])


def forward_backward_fp8(losses, lse, dx, dwte, dlosses, x, wte, targets, logits, grads: str = "fp8") -> None:
    """grads: "fp8" every operand in E4M3; "fp8-g32" x and wte in E4M3, the logits' gradient left in fp32;
    "fp8-e5m2" x and wte in E4M3 and the logits' gradient in E5M2."""
    N, R = x.shape[0], logits.shape[0]
    wte = _exact(wte)
    wte8 = _e4m3(wte)
    for i in range(0, N, R):
        j = min(i + R, N)
        z, tgt = logits[: j - i], targets[i:j]
        sums, x8 = _chunk_fp8(x[i:j], wte8, tgt, losses[i:j], lse[i:j], z)
        valid = tgt >= 0
        dl = np.where(valid, dlosses[i:j], 0.0)
        z *= (dl / sums)[:, None]
        rows = np.flatnonzero(valid)
        z[rows, tgt[rows]] -= dl[rows]  # z = dlogits
        g8 = z if grads == "fp8-g32" else _e5m2(z) if grads == "fp8-e5m2" else _e4m3(z)
        dx[i:j] += g8 @ wte8
        dwte += g8.T @ x8


def run(exp_path: str, steps: int, out: Path, head: str, sets: list[str] = ()) -> dict:
    for name, fn in EXACT.items():  # fp8-fwd: the engine's own
        setattr(ce, name, functools.partial(exact, fn) if head == "fp32" else fn)
    if head in ("fp8", "fp8-g32", "fp8-e5m2"):
        ce.crossentropy_forward = forward_fp8
        ce.crossentropy_forward_backward = functools.partial(forward_backward_fp8, grads=head)
    exp = config.load(exp_path)
    for field in (*sets, f"train.steps={steps}", "train.precision=fp8", "train.backend=numpy"):
        exp = config.override(exp, field)
    t0 = time.time()
    tr = Trainer(exp, out / head)
    val, train = {}, []
    while tr.step < steps:
        train.append(tr.train_step()["loss"])
        if tr.step % exp.train.eval_every == 0 or tr.step == steps:
            val[tr.step] = round(tr.evaluate()["val_loss"], 5)
    return {"head": head, "seconds": round(time.time() - t0), "val": val,
            "train_last20": round(float(np.mean(train[-20:])), 5)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("experiment", nargs="?", default="experiments/ANDREA-tiny-TRAIN.json")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="/tmp/fp8_head")
    p.add_argument("--heads", nargs="+", default=["fp32", "fp8"], choices=list(HEADS), help="the head variants "
                   "(the module docstring)")  # fmt: skip
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE for the experiment, as train's --set "
                   "(e.g. model.vocab_size=50304: the built-in corpus gets a BPE of that size)")  # fmt: skip
    a = p.parse_args()
    res = []
    for head in a.heads:
        res.append(run(a.experiment, a.steps, Path(a.out), head, a.set))
        print(json.dumps(res[-1]), flush=True)
    base = res[0]["val"]
    for r in res[1:]:
        print(json.dumps({f"val {r['head']} head / {res[0]['head']} head - 1": {
            s: f"{r['val'][s] / base[s] - 1:+.2%}" for s in base if s in r["val"]},
            "train mean of last 20 steps": [res[0]["train_last20"], r["train_last20"]]}))  # fmt: skip


if __name__ == "__main__":
    main()
