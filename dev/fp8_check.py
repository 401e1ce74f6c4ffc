"""precision "fp8" against bf16 on the GPU machine: loss parity and bit-exact resume (JSON lines on stdout).

    python3 dev/fp8_check.py parity12     # ANDREA-12M, 2,000 steps, bf16 then fp8: val loss at every eval
    python3 dev/fp8_check.py parity12 --experiment experiments/ANDREA-12M-MODERN-TRAIN.json --steps 300 \
        --eval-every 100                  # its modern twin, the same (dev/gpu_check.sh modern-parity)
    python3 dev/fp8_check.py parity120    # ANDREA-120M, 500 steps, the same
    python3 dev/fp8_check.py resume       # ANDREA-12M fp8: SIGTERM mid-run, resume, final checkpoint bytes (sha256)

The GPU machine has the built-in corpus only (data.source=builtin; it builds it for its Python). ANDREA-120M keeps
its shape (vocab 50,304) and reads the built-in corpus through ANDREA-12M's 4,096-entry BPE (data.tokenizer:
the rows past 4,096 are never a target), at 8 x 4 x 1,024 tokens a step (the recipe's 8 x 16 would go over the
small corpus ~50 times in 500 steps). --data DIR trains on a prepared shard folder instead: dev/fp8_gpu.sh's
prep-big stage makes one the models cannot memorize from the Python sources of torch and triton on the GPU machine
(about 50 MB; 4,096 BPE). Same seed, same data order in both precisions. Reported per run: every
eval's val loss, the train loss every 50 steps, and `spike`: the largest rise of the train loss over its mean of
the 20 steps before. --set passes overrides to every run (try it on the CPU with --set train.backend=numpy and a
small model). --jsonl FILE appends every result line to FILE too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from microgpt import checkpoint  # noqa: E402

DATA = ["--set", "data.source=builtin", "--set", 'data.path=""']  # --data DIR: shards instead
EXTRA: list[str] = []
JSONL: list[Path] = []  # --jsonl: every result line also appended there


def emit(rec: dict) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    for path in JSONL:
        with open(path, "a") as f:
            f.write(line + "\n")


def command(exp: str, out: Path, *args: str) -> list[str]:
    """The argv of `microgpt train` on exp into out, its records as JSON lines on stdout."""
    return [
        sys.executable,
        "-m",
        "microgpt.cli",
        "train",
        "--json",
        str(REPO / exp),
        "--out",
        str(out),
        *DATA,
        *EXTRA,
        *args,
    ]


def train(exp: str, out: Path, *args: str, timeout: int = 400) -> list[dict]:
    """`microgpt train` in a subprocess; its JSON lines."""
    argv = command(exp, out, *args)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {res.returncode}\n{res.stderr[-4000:]}")
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def summary(recs: list[dict]) -> dict:
    steps = [r for r in recs if r["event"] == "step"]
    losses = [r["loss"] for r in steps]
    spikes = [losses[i] - sum(losses[i - 20 : i]) / 20 for i in range(20, len(losses))]
    return {
        "evals": {r["step"]: round(r["val_loss"], 5) for r in recs if r["event"] == "eval"},
        "train": {r["step"]: round(r["loss"], 4) for r in steps if r["step"] % 50 == 0},
        "spike": round(max(spikes, default=0.0), 4),
        "tokens_per_s": steps[-1].get("tokens_per_s"),
    }


def parity(exp: str, steps: int, eval_every: int, precisions: list[str], *args: str) -> None:
    runs = {}
    for p in precisions:
        t0 = time.monotonic()
        out = Path(f"/tmp/fp8_parity_{p}")
        shutil.rmtree(out, ignore_errors=True)
        recs = train(
            exp,
            out,
            "--precision",
            p,
            "--steps",
            str(steps),
            "--set",
            f"train.eval_every={eval_every}",
            "--set",
            "train.ckpt_every=100000",
            *args,
        )
        runs[p] = summary(recs)
        emit({"check": "parity", "exp": exp, "precision": p, "wall_s": round(time.monotonic() - t0, 1), **runs[p]})
    a, b = (runs[p]["evals"] for p in precisions[:2])
    last = max(a)
    emit(
        {
            "check": "parity",
            "exp": exp,
            "steps": steps,
            "final_val": {p: runs[p]["evals"][last] for p in precisions[:2]},
            "rel_diff_final": round(b[last] / a[last] - 1, 5),
            "max_rel_diff_any_eval": round(max(abs(b[s] / a[s] - 1) for s in a), 5),
            "spike": {p: runs[p]["spike"] for p in precisions},
        }
    )


def resume(precision: str, steps: int) -> None:
    exp = "experiments/ANDREA-12M-TRAIN.json"
    quiet = [
        "--precision",
        precision,
        "--steps",
        str(steps),
        "--set",
        "train.eval_every=100000",
        "--set",
        "train.ckpt_every=100000",
    ]
    whole, cut = Path("/tmp/fp8_whole"), Path("/tmp/fp8_cut")
    for d in (whole, cut):
        shutil.rmtree(d, ignore_errors=True)
    train(exp, whole, *quiet)
    argv = command(exp, cut, *quiet)
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        rec = json.loads(line) if line.startswith("{") else {}
        if rec.get("event") == "step" and rec["step"] >= steps // 2:
            proc.send_signal(signal.SIGTERM)
            break
    rest, err = proc.communicate(timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"SIGTERM run: exit {proc.returncode}\n{err[-3000:]}")
    stopped = [json.loads(x) for x in rest.splitlines() if x.startswith("{")]
    recs = train(exp, cut, *quiet, "--resume", "latest")
    name = checkpoint.ckpt_name(steps)
    a, b = (whole / "ckpt" / name).read_bytes(), (cut / "ckpt" / name).read_bytes()
    first = next(r for r in recs if r["event"] == "step")
    emit(
        {
            "check": "resume",
            "precision": precision,
            "stopped": stopped[-1] if stopped else None,
            "resumed_at_step": first["step"],
            "bytes": len(a),
            "sha256_whole": hashlib.sha256(a).hexdigest(),
            "sha256_resumed": hashlib.sha256(b).hexdigest(),
            "identical_final_checkpoint": a == b,
        }
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["parity12", "parity120", "resume"])
    p.add_argument("--steps", type=int, help="default: 2000 (parity12), 500 (parity120), 200 (resume)")
    p.add_argument("--eval-every", type=int, help="parity: steps between evaluations (default 250; parity120 100)")
    p.add_argument("--experiment", default="experiments/ANDREA-12M-TRAIN.json", help="parity12's experiment")
    p.add_argument("--precisions", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--set", action="append", default=[], help="an override for every run, as train's --set")
    p.add_argument("--jsonl", type=Path, help="also append every result line to this file")
    p.add_argument("--data", help="a prepared shard folder (microgpt prep) to train on instead of the built-in corpus")
    a = p.parse_args()
    if a.data:
        DATA[:] = ["--set", "data.source=shards", "--set", f"data.path={Path(a.data).resolve()}"]
    JSONL.extend([a.jsonl] if a.jsonl else [])
    EXTRA.extend(x for kv in a.set for x in ("--set", kv))
    if a.what == "parity12":
        parity(a.experiment, a.steps or 2000, a.eval_every or 250, a.precisions)
    elif a.what == "parity120":
        sets = ["--set", "train.n_micro=4", "--set", "train.warmup_steps=100"]
        if not a.data:  # the built-in corpus, read through ANDREA-12M's tokenizer
            tok = sorted((REPO / "data" / "builtin").glob("v4096-*/tokenizer.json"), key=lambda f: f.stat().st_mtime)
            if not tok:
                raise SystemExit("no 4,096-entry built-in tokenizer under data/builtin: run parity12 first")
            sets += ["--set", f"data.tokenizer={tok[-1]}"]
        parity("experiments/ANDREA-120M-TRAIN.json", a.steps or 500, a.eval_every or 100, a.precisions, *sets)
    else:
        resume(a.precisions[-1], a.steps or 200)


if __name__ == "__main__":
    main()
