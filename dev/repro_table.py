"""The reproduction table of docs/ANDREA.md section 5, measured: for a model, its data command and its train command
run exactly as the table gives them, then the table's row with the time and the validation loss filled in.

    python3 dev/repro_table.py 12m     # ANDREA-12M, the whole recipe (20,000 steps): minutes on one H200
    python3 dev/repro_table.py 120m    # ANDREA-120M for 500 steps (its lr warmup shortened to 50 steps)
    python3 dev/repro_table.py 12m-modern 120m-modern   # the modern recipes: 12M whole, 120M for 500 steps

From the repository root, on the GPU machine (no network needed: the data are the built-in corpus). The data command
runs only when its folder is missing; the train command runs in a fresh folder (`--out runs/repro-<model>-<UTC>`, the
one flag added). Printed: the table's row (time = the train command's wall clock, start and warm-up included, with
the training time the run's log counts; the validation loss of the last evaluation), then what the row rests on for
bench/RESULTS.md: the device, Python (whose standard library the corpus is), the corpus's tokens, the tokens/s median,
the commit and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from microgpt import config, runlog  # noqa: E402

# model key -> (name, the data command, the train command): docs/ANDREA.md's table gives the same commands
RUNS = {
    "12m": ("ANDREA-12M", "microgpt prep --experiment experiments/ANDREA-12M-TRAIN.json",
            "microgpt train experiments/ANDREA-12M-TRAIN.json"),
    "120m": ("ANDREA-120M", "microgpt prep --experiment experiments/ANDREA-120M-TRAIN.json",
             "microgpt train experiments/ANDREA-120M-TRAIN.json --steps 500 --set train.warmup_steps=50"),
    "12m-modern": ("ANDREA-12M-MODERN", "microgpt prep --experiment experiments/ANDREA-12M-MODERN-TRAIN.json",
                   "microgpt train experiments/ANDREA-12M-MODERN-TRAIN.json"),
    "120m-modern": ("ANDREA-120M-MODERN", "microgpt prep --experiment experiments/ANDREA-120M-MODERN-TRAIN.json",
                    "microgpt train experiments/ANDREA-120M-MODERN-TRAIN.json --steps 500"),
}  # fmt: skip


def run(command: str, extra: list[str], timeout: float) -> float:
    """`python3 -m microgpt ...` from the repository root; its wall-clock seconds. A failure ends the script."""
    argv = [sys.executable, "-m", *shlex.split(command), *extra]
    print(f"$ {shlex.join(argv)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    res = subprocess.run(
        argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}, timeout=timeout
    )
    if res.returncode != 0:
        sys.exit(f"{command}: exit {res.returncode}")
    return time.monotonic() - t0


def hms(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m}m {s:02d}s"


def measure(key: str, timeout: float) -> None:
    """One model's row: its data command where its folder is missing, its train command in a fresh folder; the row
    and the facts it rests on printed."""
    name, data_cmd, train_cmd = RUNS[key]
    exp = config.load(REPO / shlex.split(train_cmd)[2])
    data = REPO / exp.data.path
    if not (data / "manifest.json").is_file():
        run(data_cmd, [], 1800)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    out = REPO / "runs" / f"repro-{key}-{stamp}"
    wall = run(train_cmd, ["--out", str(out)], timeout)
    log = runlog.read_log(out / runlog.LOG_NAME)
    steps = [e for e in log if e["event"] == "step"]
    last_eval = [e for e in log if e["event"] == "eval" and "val_loss" in e][-1]
    start = log[0]
    manifest = json.loads((data / "manifest.json").read_text())
    took = f"{hms(wall)} ({hms(steps[-1]['elapsed_s'])} of training)"
    row = (
        f"| {name} | `{data_cmd}` | `{train_cmd}` | {steps[-1]['step']:,} | {took} | "
        f"{last_eval['val_loss']:.4f} at step {last_eval['step']:,} |"
    )
    print(row, flush=True)
    facts = {
        "model": name,
        "device": start["device"],
        "python": manifest["build"]["python"],
        "train_tokens": manifest["splits"]["train"]["tokens"],
        "val_tokens": manifest["splits"]["val"]["tokens"],
        "tokens_per_s_median": round(statistics.median(s["tokens_per_s"] for s in steps[1:] or steps)),
        "git": start["git"],
        "date": stamp,
        "run": str(out.relative_to(REPO)),
    }
    print(json.dumps(facts), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", choices=RUNS, metavar="MODEL", help=f"one or more of {', '.join(RUNS)}")
    ap.add_argument("--timeout", type=float, default=560, help="seconds each train command may take")
    args = ap.parse_args()
    for key in args.models:
        measure(key, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
