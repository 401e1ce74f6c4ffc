"""Data parallel on the GPU machine (2+ GPUs): throughput, loss agreement and resume, as JSON lines and a table.

    python3 dev/dp_check.py speed  [--gpus 2] [--mbs 32 8] [--steps 40] [--before DIR]
    python3 dev/dp_check.py agree  [--gpus 2] [--micro-batch 16]   # ANDREA-12M: N GPUs x b against 1 x N*b, 40 steps
    python3 dev/dp_check.py resume [--gpus 2]     # ANDREA-12M: SIGTERM to the launcher, resume, final bytes
    --set KEY=VALUE (repeatable) goes to every run: on the CPU, e.g. --set train.backend=numpy and a tiny model

speed: `microgpt train experiments/ANDREA-120M-TRAIN.json` on random-token shards (the GPU machine has no
corpus of that vocabulary; throughput does not depend on the token values), micro-batch b per GPU, n_micro 1
(one all-reduce per micro-batch: the case where data parallel costs most) and 4, on 1 GPU and on N; tokens/s
is read off the wall clock between the step records after the first 10. Variants on N GPUs: the grads not summed
(what data parallel costs besides the all-reduce), one all-reduce after backward (no overlap), NCCL limited to
8 CTAs, and with --before DIR the package in
DIR (e.g. a `git archive` of an earlier commit).
agree / resume: the built-in corpus (bpe 4096), as dev/train_check.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from microgpt import checkpoint  # noqa: E402
from microgpt.data import shards  # noqa: E402

SETS_12M = ["--set", "data.source=builtin", "--set", 'data.path=""']
QUIET = ["--set", "train.eval_every=100000", "--set", "train.ckpt_every=100000"]


EXTRA: list[str] = []  # --set overrides for every run (e.g. a small model to try this script on the CPU)


def cmd(exp: str, out: Path, gpus: int, *args: str) -> list[str]:
    """The train command line; out is emptied first, unless resuming."""
    if "--resume" not in args:
        shutil.rmtree(out, ignore_errors=True)
    procs = ["--gpus", str(gpus)] if gpus > 1 else []
    return [
        sys.executable,
        "-m",
        "microgpt.cli",
        "train",
        "--json",
        str(REPO / exp),
        "--out",
        str(out),
        *procs,
        *EXTRA,
        *args,
    ]


TIMEOUT = [200]  # seconds a run may take (--timeout)


def run(argv: list[str], pythonpath: Path = REPO, timeout: int | None = None) -> list[dict]:
    timeout = timeout or TIMEOUT[0]
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "PYTHONUNBUFFERED": "1"}
    res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=pythonpath, timeout=timeout)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {res.returncode}\n{res.stderr[-4000:]}")
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def steps_of(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r["event"] == "step"]


def random_shards(folder: Path, vocab: int) -> Path:
    if not (folder / "val_000000.bin").exists():
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        shards.write_shard(folder / "train_000000.bin", rng.integers(0, vocab, 64 << 20, dtype=np.uint16))
        shards.write_shard(folder / "val_000000.bin", rng.integers(0, vocab, 4 << 20, dtype=np.uint16))
    return folder


def timed(argv: list[str], env: dict[str, str], cwd: Path, timeout: int = 200) -> list[tuple[float, dict]]:
    """Run argv; (arrival time, record) for each JSON line of its stdout, so throughput can be read off the wall
    clock between records (a step record's own dt leaves out what happens between steps)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    assert proc.stdout is not None
    got = [(time.monotonic(), json.loads(line)) for line in proc.stdout if line.startswith("{")]
    err = proc.stderr.read() if proc.stderr else ""
    if proc.wait(timeout=timeout) != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}\n{err[-4000:]}")
    return got


def ranks(argv: list[str], n: int, env: dict[str, str], cwd: Path) -> list[tuple[float, dict]]:
    """argv as ranks 0..n-1 started here (no launcher), e.g. under a wrapper that patches the engine; rank 0's
    records, timed."""
    env = {**env, "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29000 + os.getpid() % 900)}
    others = [
        subprocess.Popen(
            argv,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            cwd=cwd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in range(1, n)
    ]
    got = timed(argv, {**env, "RANK": "0", "LOCAL_RANK": "0"}, cwd)
    for p in others:
        p.wait(timeout=60)
    return got


WRAP = """
import sys
from microgpt import cli
from microgpt.engine import collectives
PATCH
sys.exit(cli.main(sys.argv[1:]))
"""
PATCHES = {  # a variant's change to the engine, applied by WRAP in each rank
    "not summed": "collectives.GradReduce.layer_done = lambda self, layer: None\n"
    "collectives.GradReduce.finish = lambda self: None\n"
    "collectives.DataParallel.check_replicas = lambda self, step, arrays: None",
    "one bucket": "collectives.GradReduce.layer_done = lambda self, layer: None\n"
    "collectives.GradReduce.finish = lambda self: self.dp.all_reduce_async(self.g).wait()",
}


def speed(a: argparse.Namespace) -> None:
    """Each variant: label, GPUs, n_micro, extra environment, package folder, and whether the grads are summed."""
    data = random_shards(Path("/tmp/dp_rand"), 50304)
    n = a.gpus
    variants = [
        ("1 GPU", 1, 1, {}, REPO, ""),
        (f"{n} GPUs", n, 1, {}, REPO, ""),
        (f"{n} GPUs, grads not summed", n, 1, {}, REPO, "not summed"),
        (f"{n} GPUs, one bucket after backward", n, 1, {}, REPO, "one bucket"),
        (f"{n} GPUs, NCCL_MAX_CTAS=8", n, 1, {"NCCL_MAX_CTAS": "8"}, REPO, ""),
    ]
    if a.before:
        variants.append((f"{n} GPUs before", n, 1, {}, Path(a.before).resolve(), ""))
    variants += [("1 GPU, n_micro 4", 1, 4, {}, REPO, ""), (f"{n} GPUs, n_micro 4", n, 4, {}, REPO, "")]
    if a.only:
        variants = [
            v for v in variants if v[2] == 1 and v[0] in ("1 GPU", f"{n} GPUs") or any(w in v[0] for w in a.only)
        ]
    rows: list[dict] = []
    for mb in a.mbs:
        for label, gpus, n_micro, extra, path, patch in variants:
            if n_micro > 1 and mb != a.mbs[0]:
                continue
            out = Path(f"/tmp/dp_speed_{len(rows)}")
            sets = [
                "--set",
                "data.source=shards",
                "--set",
                f"data.path={data}",
                "--set",
                f"train.micro_batch={mb}",
                "--set",
                f"train.n_micro={n_micro}",
                "--steps",
                str(a.steps),
                *QUIET,
            ]
            argv = cmd("experiments/ANDREA-120M-TRAIN.json", out, gpus, *sets)
            env = {**os.environ, "PYTHONPATH": str(path), "PYTHONUNBUFFERED": "1", **extra}
            if not patch:
                got = timed(argv, env, path)
            else:  # ranks started here, each under a wrapper that changes the engine
                argv = [sys.executable, "-c", WRAP.replace("PATCH", PATCHES[patch])] + argv[argv.index("train") :]
                argv.remove("--gpus")
                argv.remove(str(gpus))
                got = ranks(argv, gpus, env, path)
            steps = [(t, r) for t, r in got if r["event"] == "step"][10:]
            (t0, _), (t1, _) = steps[0], steps[-1]
            tokens = sum(r["tokens"] for _, r in steps[1:])
            row = {
                "mb": mb,
                "n_micro": n_micro,
                "run": label,
                "gpus": gpus,
                "tokens_per_s": tokens / (t1 - t0),
                "dt_ms": statistics.median(r["dt_ms"] for _, r in steps),
                "loss": steps[-1][1]["loss"],
            }
            one = next((r for r in rows if r["mb"] == mb and r["gpus"] == 1 and r["n_micro"] == n_micro), None)
            if one is not None and gpus > 1:
                row["scaling"] = row["tokens_per_s"] / (gpus * one["tokens_per_s"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| micro-batch per GPU x n_micro | run | tokens/s (wall) | step's own ms (median) | scaling vs N x 1 GPU |")
    print("|---|---|---|---|---|")
    for r in rows:
        s = f"{100 * r['scaling']:.1f}%" if "scaling" in r else ""
        print(f"| {r['mb']} x {r['n_micro']} | {r['run']} | {r['tokens_per_s']:,.0f} | {r['dt_ms']:.1f} | {s} |")


def agree(a: argparse.Namespace) -> None:
    b = a.micro_batch
    common = [*SETS_12M, "--steps", "40", "--set", "train.eval_every=20", "--set", "train.ckpt_every=100000"]
    many = run(
        cmd(
            "experiments/ANDREA-12M-TRAIN.json",
            Path("/tmp/dp_agree_n"),
            a.gpus,
            *common,
            "--set",
            f"train.micro_batch={b}",
        )
    )
    one = run(
        cmd(
            "experiments/ANDREA-12M-TRAIN.json",
            Path("/tmp/dp_agree_1"),
            1,
            *common,
            "--set",
            f"train.micro_batch={a.gpus * b}",
        )
    )
    rel = [abs(x["loss"] - y["loss"]) / y["loss"] for x, y in zip(steps_of(many), steps_of(one))]
    ev = [
        (x["step"], x["val_loss"], y["val_loss"])
        for x, y in zip([r for r in many if r["event"] == "eval"], [r for r in one if r["event"] == "eval"])
    ]
    print(
        json.dumps(
            {
                "check": "agree",
                "gpus": a.gpus,
                "micro_batch": b,
                "steps": len(rel),
                "max_rel_loss_diff": max(rel),
                "mean_rel_loss_diff": sum(rel) / len(rel),
                "loss_40": [steps_of(many)[-1]["loss"], steps_of(one)[-1]["loss"]],
                "val": ev,
            }
        )
    )


def resume(a: argparse.Namespace) -> None:
    common = [*SETS_12M, "--steps", "60", *QUIET]
    exp = "experiments/ANDREA-12M-TRAIN.json"
    run(cmd(exp, Path("/tmp/dp_whole"), a.gpus, *common))
    out = Path("/tmp/dp_cut")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd(exp, out, a.gpus, *common), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{") and json.loads(line).get("step", 0) >= 25 and json.loads(line)["event"] == "step":
            proc.send_signal(signal.SIGTERM)
            break
    t0 = time.monotonic()
    rest, err = proc.communicate(timeout=120)
    stopped = [json.loads(x) for x in rest.splitlines() if x.startswith("{")]
    if proc.returncode != 0:
        raise SystemExit(f"SIGTERM run: exit {proc.returncode}\n{err[-3000:]}")
    recs = run(cmd(exp, out, a.gpus, *common, "--resume", "latest"))
    name = checkpoint.ckpt_name(60)
    whole, cut = (Path("/tmp/dp_whole/ckpt") / name).read_bytes(), (out / "ckpt" / name).read_bytes()
    print(
        json.dumps(
            {
                "check": "resume",
                "gpus": a.gpus,
                "stopped": stopped[-1],
                "stop_s": time.monotonic() - t0,
                "resumed_from": steps_of(recs)[0]["step"] - 1,
                "bytes": len(whole),
                "identical_final_checkpoint": whole == cut,
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["speed", "agree", "resume"])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--mbs", type=int, nargs="+", default=[32, 8])
    p.add_argument("--micro-batch", type=int, default=16, help="agree: b, the micro-batch of each of the N")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--before", help="a folder holding an earlier microgpt package (speed: run it too)")
    p.add_argument("--only", nargs="+", help="speed: run only the 1-GPU rows and the variants whose label has one")
    p.add_argument("--set", action="append", default=[], help="an override for every run, as train's --set")
    p.add_argument("--timeout", type=int, default=200, help="seconds each run may take (the CPU needs more)")
    a = p.parse_args()
    TIMEOUT[0] = a.timeout
    EXTRA.extend(x for kv in a.set for x in ("--set", kv))
    {"speed": speed, "agree": agree, "resume": resume}[a.what](a)


if __name__ == "__main__":
    main()
