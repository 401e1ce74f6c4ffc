"""Measure FIREHOSE online mixing against fixed uniform weights on the built-in corpus split into its sources.

    .venv/bin/python scripts/firehose-measure.py            # stdlib + synthetic-chat, seeds 1337, 7, 3
    .venv/bin/python scripts/firehose-measure.py --noise    # + a source of uniform random tokens

Builds the per-source built-in corpus once (`microgpt prep --builtin --per-source`, vocab 2048) and, with --noise,
a third source of uniform random token ids; trains every variant through the real CLI (`microgpt train`) at the
same seed, model and step budget, one BLAS thread each (the machine is shared), one after the other; then prints
the target validation loss against steps and how many steps each variant needs to reach the final target loss of
the fixed-uniform run. The target is the mean of the real sources' own val losses (the noise source is junk we
would rather not learn). Each run's JSON lines stay in --out/<variant>-seed<S>.jsonl, and a finished run of the
same experiment is read back instead of trained again. docs/FIREHOSE-BANDIT.md has the results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from microgpt.data import shards  # noqa: E402

MODEL = {"vocab_size": 2048, "d_model": 64, "n_layer": 2, "n_head": 4, "seq_len": 64}
TRAIN = {"micro_batch": 4, "n_micro": 4, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 20, "eval_every": 25,
         "eval_batches": 8, "ckpt_every": 100000, "seed": 1337}  # fmt: skip
VARIANTS = {
    "fixed-uniform": {"policy": "fixed", "prior": "uniform"},
    "firehose": {"policy": "firehose", "prior": "uniform"},
}
NOISE = "noise"


def build_sources(out: Path, noise: bool) -> Path:
    split = out / "builtin-split"
    if not (split / "manifest.json").exists():
        cmd = [
            sys.executable,
            "-m",
            "microgpt.cli",
            "prep",
            "--builtin",
            "--per-source",
            "--vocab-size",
            "2048",
            "--out",
            str(split),
            "--quiet",
        ]
        subprocess.run(cmd, check=True, cwd=REPO)
    if not noise:
        return split
    mixed = out / "builtin-split-noise"
    (mixed / NOISE).mkdir(parents=True, exist_ok=True)
    for d in split.iterdir():
        link = mixed / d.name
        if d.is_dir() and not link.exists():
            link.symlink_to(d.resolve())
        elif d.name == "tokenizer.json" and not link.exists():
            link.write_bytes(d.read_bytes())
    rng = np.random.default_rng(0)
    for name, n in (("train_000000.bin", 300_000), ("val_000000.bin", 15_000)):
        if not (mixed / NOISE / name).exists():
            shards.write_shard(mixed / NOISE / name, rng.integers(0, MODEL["vocab_size"], n).astype(np.uint16))
    return mixed


def train(out: Path, name: str, data: Path, mixing: dict, steps: int, seed: int) -> list[dict]:
    """One run through the CLI; a finished run of the very same experiment in out is read back, not redone."""
    exp = {
        "name": f"firehose-{name}",
        "model": MODEL,
        "train": {**TRAIN, "steps": steps, "seed": seed},
        "data": {"source": "shards", "path": str(data)},
        "mixing": mixing,
    }
    path, log = out / f"{name}.json", out / f"{name}.jsonl"
    text = json.dumps(exp, indent=1)
    if path.exists() and path.read_text() == text and log.exists() and '"event":"done"' in log.read_text():
        return [json.loads(line) for line in log.read_text().splitlines()]
    path.write_text(text)
    shutil.rmtree(out / name, ignore_errors=True)  # the run folder: a fresh start
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "microgpt.cli", "train", str(path), "--out", str(out / name)]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=f, stderr=subprocess.DEVNULL)
    print(f"{name}: {steps} steps in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return [json.loads(line) for line in log.read_text().splitlines()]


def target(rec: dict) -> float:
    real = [v for k, v in rec["source_val_loss"].items() if k != NOISE]
    return sum(real) / len(real)


def steps_to_reach(evals: list[dict], goal: float) -> int | None:
    return next((r["step"] for r in evals if target(r) <= goal), None)


def report(runs: dict[tuple[str, int], list[dict]], variants: list[str], seeds: list[int]) -> None:
    """Markdown: the target val loss by step (mean over seeds), then per variant the final numbers and the steps
    it needs to reach the fixed-uniform run's final target loss of the same seed."""
    evals = {key: [r for r in recs if r["event"] == "eval"] for key, recs in runs.items()}
    print("| step | " + " | ".join(variants) + " |\n|---:|" + "---:|" * len(variants))
    for i, rec in enumerate(evals[(variants[0], seeds[0])]):
        means = [np.mean([target(evals[(v, s)][i]) for s in seeds]) for v in variants]
        print(f"| {rec['step']} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    print(
        "\n| variant | final target (per seed) | mean | steps to reach fixed-uniform's final (per seed) "
        "| final val per source (mean) | mean weights over the run |\n|---|---|---:|---|---|---|"
    )
    for v in variants:
        finals = [target(evals[(v, s)][-1]) for s in seeds]
        reach = [steps_to_reach(evals[(v, s)], target(evals[("fixed-uniform", s)][-1])) for s in seeds]
        names = list(evals[(v, seeds[0])][-1]["source_val_loss"])
        per = {n: np.mean([evals[(v, s)][-1]["source_val_loss"][n] for s in seeds]) for n in names}
        mix = [r["mixture"] for s in seeds for r in runs[(v, s)] if r["event"] == "step"]
        weights = {n: np.mean([m[n] for m in mix]) for n in names}
        print(
            f"| {v} | "
            + ", ".join(f"{f:.3f}" for f in finals)
            + f" | {np.mean(finals):.3f} | "
            + ", ".join("never" if r is None else str(r) for r in reach)
            + " | "
            + ", ".join(f"{n} {x:.3f}" for n, x in per.items())
            + " | "
            + ", ".join(f"{n} {x:.2f}" for n, x in weights.items())
            + " |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "firehose-measure")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", default="1337,7,3", help="training seeds (init, shuffles, draws), comma-separated")
    ap.add_argument("--noise", action="store_true", help="add a source of uniform random tokens")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON", help="another mixing section")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = build_sources(args.out, args.noise)
    variants = dict(VARIANTS)
    for spec in args.variant:
        name, _, raw = spec.partition("=")
        variants[name] = json.loads(raw)
    seeds = [int(x) for x in args.seeds.split(",")]
    runs = {}
    for seed in seeds:
        for name, mixing in variants.items():
            tag = f"{name}{'-noise' if args.noise else ''}-seed{seed}"
            runs[(name, seed)] = train(args.out, tag, data, mixing, args.steps, seed)
    report(runs, list(variants), seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
