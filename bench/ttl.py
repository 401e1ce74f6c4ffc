"""Time to loss (issue 46): validation loss against training seconds, side by side on one GPU, the same data.

    python3 bench/ttl.py --shape 120m                 # prep if needed, sides a, b, c; the table, ttl.json, ttl.png
    python3 bench/ttl.py --shape 120m --prep-only     # only gather the sources and prepare the shards (prep.json)
    python3 bench/ttl.py --shape 120m --sides a       # one side (each side in its own invocation if need be) ...
    python3 bench/ttl.py --shape 120m --merge         # ... then the table and plot of every side recorded so far
    python3 bench/ttl.py --shape tiny                 # the CPU smoke path: numpy engine, PyTorch eager, seconds
    python3 bench/ttl.py --shape 120m --sides b,d --set d:model.value_embeds=2   # (b) against (b) with a lever
    python3 bench/ttl.py --shape 120m --sides b,d,e --set d:model.value_embeds=2 --set e:train.precision=fp8
    python3 bench/ttl.py --shape 120m --sides b,d --set d:model.skips=6          # ... U-net skips (L/2 of them)

Sides: (a) `microgpt train` of the GPT-2 recipe (ANDREA's experiment), (b) `microgpt train` of the modern recipe (an
experiment of model.block "modern", train.optimizer "muon"; the shape's ANDREA-*-MODERN-TRAIN.json, or --modern), (c)
bench/torch_modern.py, the PyTorch + torch.compile twin of (b)'s recipe reading (b)'s experiment; and, only when --sides
names them, (d) .. (h): (b) with a lever each, the --set overrides that name the side (d:model.value_embeds=2), which
its label lists, so that (b) and each lever side on one chart say whether the lever lowers time to loss. Each runs in
its own process, on the shape's model (--set on every side: shard data from the prepared folder, the shape's vocab,
micro-batch and n_micro, eval_batches, no periodic checkpoint; then --set [SIDES:]SECTION.FIELD=VALUE, on every side or
on those named, as in a:train.lr=1.8e-3). An engine side is stopped (SIGKILL) once its last evaluation is out: its final
checkpoint and report card (GBs and tens of seconds at 120M) are not needed here. The tiny shape is the CPU smoke path:
the engine sides on the NumPy backend (fp32), the twin eager in fp32.

Data (bench/ttl_data.py): the Python sources of this machine's standard library and site-packages (every machine has
them; the GPU machine has no network), prepared once per shape by `microgpt prep`. Every side reads these shards
through microgpt.data: the same batch for (step, micro) and the same validation windows at every evaluation.

Training seconds (bench/ttl_results.py), counted the same way for every side: a step's time is the host clock from
before its batches are read to after its loss is read back; evaluations and checkpoints lie outside it, and the first
--warm steps (default 5: compile, tune, capture) are counted at the median of the side's later steps.

Budget: each side trains for about --budget-s training seconds. The engine's lr schedule needs its step count up front,
so a side first calibrates: (a) and (b) by a short `microgpt train` of warm + calib steps (its own process, which also
warms the kernel and tuning caches for the run), (c) in its own process before training (torch_modern.py --budget-s).
steps = budget / the median calibrated step time; evaluations every round(eval_s / step time) steps and at the last. The
experiment's warmup is scaled by steps / train.steps (its schedule compressed into the budget); warmdown_frac stays a
fraction, and Muon's momentum warmup stays in steps, as a batch warmup does (train.batch_warmup_steps: its first steps
read fewer micro-batches) and an attention window's schedule does (train.attn_window_start: its first steps attend over
fewer keys). A side with a batch warmup calibrates on whole steps (the engine's calibration runs without it, the twin's
reads the steps after it) and takes the steps whose micro-batches are those of the budget's whole steps
(bench/ttl_results.py plan); one with a window schedule calibrates at the model's own window, so its cheaper early steps
shorten its training seconds rather than add steps. --steps a=N,c=M skips a side's calibration (evaluations then every
steps x eval_s / budget_s; the warmup scaled to N as above, the twin's too).

Time to a loss (bench/ttl_results.py): the training seconds at which a side's validation loss first reaches it,
interpolated between evaluations. The table gives, for each side, the seconds it needs to reach every side's final
loss; the issue's goals are read off it.

Outputs, under --out/<shape>/: data/ (the shards), prep.json (the corpus and prep's seconds), side-<x>.json (one
side's records and summary), side-<x>/ (its run folder: train.jsonl, stderr.log; checkpoints removed), ttl.json (the
merged results) and ttl.png (validation loss against training seconds, every side on one chart).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.ttl_data import prepare, say  # noqa: E402
from bench.ttl_results import plan, report, scaled_warmup, step_times, summarize, write_results  # noqa: E402
from microgpt import config  # noqa: E402
from microgpt.config import INT_MAX, TrainConfig  # noqa: E402
from microgpt.data import MicroSchedule  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    gpt2: str  # side (a)'s experiment
    modern: str  # sides (b) and (c)'s
    vocab_size: int  # the BPE prep trains, and every side's model.vocab_size
    micro_batch: int
    n_micro: int
    eval_batches: int
    budget_s: float
    eval_s: float
    corpus_bytes: int
    val_fraction: float
    backend: str  # the engine sides' train.backend and train.precision
    precision: str
    sets: tuple[str, ...] = ()  # more overrides of every side's experiment
    min_tokens: int = 0  # fewer train tokens than this: prep says so (issue 46 asks for 100M at 120M and 12M)
    stdlib_only: bool = False  # the corpus from the standard library alone (bench/ttl_data.py says why)


SHAPES = {
    "120m": Shape("experiments/ANDREA-120M-TRAIN.json", "experiments/ANDREA-120M-MODERN-TRAIN.json", 50304, 32, 4, 16,
                  200.0, 10.0, 450_000_000, 0.01, "triton", "bf16", min_tokens=100_000_000),
    "12m": Shape("experiments/ANDREA-12M-TRAIN.json", "experiments/ANDREA-12M-MODERN-TRAIN.json", 4096, 16, 4, 32,
                 60.0, 3.0, 450_000_000, 0.01, "triton", "bf16", min_tokens=100_000_000),
    "tiny": Shape("experiments/ANDREA-tiny-TRAIN.json", "experiments/ANDREA-tiny-MODERN-TRAIN.json", 512, 8, 1, 2,
                  3.0, 0.75, 1_500_000, 0.05, "numpy", "fp32",
                  ("model.d_model=64", "model.n_layer=2", "model.n_head=4", "model.seq_len=64"), stdlib_only=True),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Side:
    label: str
    recipe: str  # "gpt2" or "modern": which of the shape's experiments
    engine: bool  # `microgpt train` (True) or the PyTorch twin


# (d) .. (h) are (b) with a lever each: the overrides --set names it in (d:model.value_embeds=2, e:train.x=1); only
# when --sides names them, so one invocation measures several levers against one (b)
LEVERS = tuple("defgh")
SIDES = {"a": Side("microgpt gpt-2", "gpt2", True), "b": Side("microgpt modern", "modern", True),
         "c": Side("pytorch twin modern", "modern", False),
         **{x: Side("microgpt modern", "modern", True) for x in LEVERS}}  # fmt: skip
DEFAULT_SIDES = ["a", "b", "c"]


# --- the sides -----------------------------------------------------------------------------------------------------


def overrides(shape: Shape, data: Path) -> list[str]:
    """The --set assignments every side's experiment gets: the shape, the data, the evaluation, no checkpoints."""
    return [
        *shape.sets,
        f"model.vocab_size={shape.vocab_size}",
        "data.source=shards",
        f"data.path={data}",
        "data.loss_mask=false",
        'data.tokenizer=""',
        f"train.micro_batch={shape.micro_batch}",
        f"train.n_micro={shape.n_micro}",
        f"train.eval_batches={shape.eval_batches}",
        f"train.backend={shape.backend}",
        f"train.precision={shape.precision}",
        f"train.ckpt_every={INT_MAX}",
        "train.log_every=1",
        'train.hellaswag=""',
        "train.schedule_start=0",
        "train.schedule_steps=0",
    ]


def schedule(experiment: str, sets: list[str], steps: int, eval_every: int) -> list[str]:
    """The assignments of a run of `steps`: its evaluations and the experiment's warmup scaled to it. The experiment is
    read as JSON (train.steps, train.warmup_steps): the engine checks the rest when it runs."""
    raw = config.read_raw(experiment)
    train = raw.get("train", {}) if isinstance(raw, dict) else {}
    t = TrainConfig(
        steps=train.get("steps", TrainConfig.steps), warmup_steps=train.get("warmup_steps", TrainConfig.warmup_steps)
    )
    return [
        *sets,
        f"train.steps={steps}",
        f"train.eval_every={eval_every}",
        f"train.warmup_steps={scaled_warmup(t, steps)}",
    ]


def stream(cmd: list[str], log: Path, timeout: float, last: Callable[[dict[str, Any]], bool]) -> tuple[int, list]:
    """Run cmd (stderr to log) and collect the JSON records (objects with an "event") of its stdout, up to the one
    `last` accepts: the process is then killed (SIGKILL: the engine's final checkpoint and report card, tens of seconds
    and GBs at 120M, are not needed here) and counts as done (exit code 0). Otherwise its exit code (killed after
    timeout seconds: -9)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO, env=env)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(rec, dict) or "event" not in rec:
                    continue
                records.append(rec)
                if rec["event"] == "eval":
                    say(f"  step {rec['step']}: val_loss {rec['val_loss']:.4f}")
                if last(rec):
                    proc.kill()
                    proc.wait()
                    return 0, records
            return proc.wait(), records
        finally:
            timer.cancel()


class LastEval:
    """Accepts the evaluation after a run's last step: of `steps`, or of the steps the twin's "calibrated" record
    announces (it picks them itself)."""

    def __init__(self, steps: int | None) -> None:
        self.steps = steps

    def __call__(self, rec: dict[str, Any]) -> bool:
        if rec["event"] == "calibrated":
            self.steps = rec["steps"]
        return rec["event"] == "eval" and self.steps is not None and rec["step"] >= self.steps


def is_step(rec: dict[str, Any], n: int) -> bool:
    return rec["event"] == "step" and rec["step"] >= n


def engine_cmd(experiment: str, out: Path, sets: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "microgpt.cli",
        "train",
        experiment,
        "--json",
        "--out",
        str(out),
        *[a for s in sets for a in ("--set", s)],
    ]


def run_side(x: str, shape: Shape, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Side x: calibrate (unless --steps names it), train, and summarize; side-<x>.json's record."""
    side, experiment = SIDES[x], experiment_of(x, shape, args)
    run_dir = folder / f"side-{x}"
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = overrides(shape, (folder / "data").resolve()) + side_sets(args.set, x)
    t0, calibration, steps = time.monotonic(), {}, args.steps.get(x)
    every = None if steps is None else max(1, round(steps * args.eval_s / args.budget_s))
    if side.engine:
        if steps is None:
            calibration = calibrate(experiment, sets, folder / f"side-{x}-calibrate", run_dir / "calibrate.log", args)
            if "error" in calibration:
                return failed(x, experiment, calibration["error"], run_dir / "calibrate.log")
            micro = MicroSchedule.of(config.load(experiment, sets).train)
            steps, every = plan(args.budget_s, calibration["step_s"], args.eval_s, args.warm, micro)
        cmd = engine_cmd(experiment, run_dir, schedule(experiment, sets, steps, every))
        say(f"side {x}: {side.label}, {steps} steps, an evaluation every {every}")
    else:
        cmd = twin_cmd(experiment, sets, shape, steps, every, args)
        say(f"side {x}: {side.label}, " + ("calibrating itself" if steps is None else f"{steps} steps"))
    rc, records = stream(cmd, run_dir / "stderr.log", args.timeout, LastEval(steps))
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)  # whatever checkpoint the engine began: not needed here
    if rc or not any(r["event"] == "eval" for r in records) or len(step_times(records)) <= args.warm:
        return failed(x, experiment, f"exit {rc}", run_dir / "stderr.log")
    cal = next((r for r in records if r["event"] == "calibrated"), None)
    calibration = calibration if cal is None else {"step_s": cal["step_s"]}
    return {
        "side": x,
        "label": ", ".join([side.label, *own_sets(args.set, x)]) if x in LEVERS else side.label,
        "experiment": experiment,
        "command": cmd,
        "budget_s": args.budget_s,
        "warm": args.warm,
        "calibration": calibration,
        "wall_s": round(time.monotonic() - t0, 2),
        **summarize(records, args.warm),
    }


def side_sets(assignments: list[str], x: str) -> list[str]:
    """The --set assignments for side x: those with no side prefix, and those whose "SIDES:" prefix names x."""
    out = []
    for a in assignments:
        named = _named(a)
        if named is None:
            out.append(a)
        elif x in named[0]:
            out.append(named[1])
    return out


def own_sets(assignments: list[str], x: str, base: str = "b") -> list[str]:
    """The --set assignments whose "SIDES:" prefix names x but not base: what a lever side adds to (b), its label."""
    return [
        named[1] for a in assignments if (named := _named(a)) is not None and x in named[0] and base not in named[0]
    ]


def _named(a: str) -> tuple[list[str], str] | None:
    """An assignment's (sides, assignment) where a "SIDES:" prefix names sides, else None."""
    head, colon, rest = a.partition(":")
    return (head.split(","), rest) if colon and "=" not in head and set(head.split(",")) <= set(SIDES) else None


def experiment_of(x: str, shape: Shape, args: argparse.Namespace) -> str:
    """Side x's experiment file: --gpt2 / --modern (from the working folder), else the shape's (from the repo)."""
    given = args.gpt2 if SIDES[x].recipe == "gpt2" else args.modern
    return str(Path(given).resolve() if given else REPO / (shape.gpt2 if SIDES[x].recipe == "gpt2" else shape.modern))


def twin_cmd(
    experiment: str, sets: list[str], shape: Shape, steps: int | None, every: int | None, args: argparse.Namespace
) -> list[str]:
    """bench/torch_modern.py on the side's experiment: `steps` steps on the engine sides' schedule of them (schedule:
    train.steps, the evaluations and the scaled warmup as --set), or --budget-s (it calibrates itself and scales the
    warmup alike); on the CPU for the smoke shape (whose engine sides run NumPy)."""
    sets = sets if steps is None else schedule(experiment, sets, steps, every)
    cmd = [
        sys.executable,
        str(REPO / "bench" / "torch_modern.py"),
        experiment,
        *[a for s in sets for a in ("--set", s)],
    ]
    cmd += ["--device", "cpu"] if shape.backend == "numpy" else []
    if steps is None:
        return cmd + [
            "--budget-s",
            str(args.budget_s),
            "--eval-s",
            str(args.eval_s),
            "--warm",
            str(args.warm),
            "--calib",
            str(args.calib),
        ]
    return cmd


def calibrate(experiment: str, sets: list[str], out: Path, log: Path, args: argparse.Namespace) -> dict[str, Any]:
    """An engine side's whole step time: `microgpt train` of warm + calib whole steps (calibration_cmd), in its own
    run folder (removed after); {"step_s", "wall_s"}, or {"error"}."""
    t0, n = time.monotonic(), args.warm + args.calib
    shutil.rmtree(out, ignore_errors=True)
    say(f"calibrating: {n} steps of {experiment}")
    cmd = calibration_cmd(experiment, out, sets, n)
    rc, records = stream(cmd, log, args.timeout, lambda r: is_step(r, n))
    shutil.rmtree(out, ignore_errors=True)
    if rc or len(step_times(records)) < n:
        return {"error": f"calibration exit {rc}"}
    return {"step_s": statistics.median(step_times(records)[args.warm :]), "wall_s": round(time.monotonic() - t0, 2)}


# what the calibration leaves out: a batch warmup's steps of fewer micro-batches, an attention window schedule's
# narrower windows (its steps cost less: timed, they would plan more steps than the budget holds)
WHOLE_STEPS = ("train.batch_warmup_steps=0", "train.attn_window_start=0", "train.attn_window_every=0")


def calibration_cmd(experiment: str, out: Path, sets: list[str], n: int) -> list[str]:
    """The engine's calibration run: n whole steps (WHOLE_STEPS: at the model's own window, every micro-batch), no
    evaluation."""
    return engine_cmd(experiment, out, schedule(experiment, [*sets, *WHOLE_STEPS], n, INT_MAX))


def failed(x: str, experiment: str, why: str, log: Path) -> dict[str, Any]:
    tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.is_file() else []
    say(f"side {x} failed ({why}); {log}: " + " | ".join(tail))
    return {"side": x, "label": SIDES[x].label, "experiment": experiment, "error": f"{why}: {' | '.join(tail)}"}


def parse_steps(text: str) -> dict[str, int]:
    try:
        out = {x: int(n) for x, _, n in (item.partition("=") for item in text.split(",") if item)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SIDE=STEPS[,SIDE=STEPS], got {text!r}") from None
    if not set(out) <= set(SIDES) or min(out.values(), default=1) < 1:
        raise argparse.ArgumentTypeError(f"expected sides of {', '.join(SIDES)} and steps >= 1, got {text!r}")
    return out


def parse_sides(text: str) -> list[str]:
    sides = [x for x in text.split(",") if x]
    if not sides or not set(sides) <= set(SIDES):
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(SIDES)}, got {text!r}")
    return sides


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/ttl.py", description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="120m")
    p.add_argument("--sides", type=parse_sides, default=DEFAULT_SIDES, help="a comma list of a .. h (default a, b, c)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "ttl", help="results and data go in OUT/<shape>")
    p.add_argument("--prep-only", action="store_true", help="prepare the data, train nothing")
    p.add_argument("--merge", action="store_true", help="train nothing: the tables and plot of the recorded sides")
    p.add_argument("--budget-s", type=float, help="training seconds a side (default: the shape's)")
    p.add_argument("--eval-s", type=float, help="training seconds between evaluations (default: the shape's)")
    p.add_argument("--corpus-bytes", type=int, help="Python source bytes to prepare (default: the shape's)")
    p.add_argument("--steps", type=parse_steps, default={}, help="SIDE=N,...: N steps, no calibration, for SIDE")
    p.add_argument("--warm", type=int, default=5, help="first steps counted at the median step time")
    p.add_argument("--calib", type=int, default=10, help="steps timed to calibrate a side")
    p.add_argument("--gpt2", help="side (a)'s experiment (default: the shape's)")
    p.add_argument("--modern", help="sides (b) and (c)'s experiment (default: the shape's)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="[SIDES:]SECTION.FIELD=VALUE",
        help="an override on every side, or on the sides named (a:train.lr=1e-3, b,c:train.muon_lr=0.03)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a side's process may run")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    shape = SHAPES[args.shape]
    args.budget_s, args.eval_s = args.budget_s or shape.budget_s, args.eval_s or shape.eval_s
    if args.corpus_bytes:
        shape = dataclasses.replace(shape, corpus_bytes=args.corpus_bytes)
    folder = args.out.resolve() / args.shape
    missing = [
        (x, experiment_of(x, shape, args)) for x in args.sides if not Path(experiment_of(x, shape, args)).is_file()
    ]
    if missing and not args.merge and not args.prep_only:  # before any device time goes to prep
        x, path = missing[0]
        flag = "--gpt2" if SIDES[x].recipe == "gpt2" else "--modern"
        print(f"error: side {x}: no experiment file {path} (give one with {flag})", file=sys.stderr)
        return 2
    if not args.merge:
        prepare(shape, folder)
        if args.prep_only:
            return 0
        for x in args.sides:
            rec = run_side(x, shape, folder, args)
            (folder / f"side-{x}.json").write_text(json.dumps(rec, indent=1) + "\n")
    device = "one gpu" if shape.backend == "triton" else "cpu"
    res = write_results(folder, args.shape, shape.vocab_size, SIDES, device)
    print(report(res))
    say(f"wrote {folder / 'ttl.json'} and {folder / 'ttl.png'}")
    return 0 if all("evals" in s for s in res["sides"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
