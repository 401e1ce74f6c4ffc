"""bench/ttl.py's arithmetic and results: a side's budget, its training seconds, the time to a loss, and the merged
tables and plot.

Training seconds, counted the same way for every side: a step's time is the host clock from before its batches are
read to after its loss is read back to the host (which waits for the GPU): the engine's step records carry it as
dt_ms (run/trainer.py; they also carry elapsed_s, seconds since the first step with evaluations and checkpoints in,
and time, a Unix stamp: neither is used here), the twin's the same. Evaluations and checkpoints lie outside every
step's time. The first --warm steps (default 5) compile, tune and capture; each is counted at the median time of the
side's later steps that read as many tokens as it did (all of them, without a batch warmup) instead of its own. A
side's training seconds at step s are the sum of its first s steps' times so counted.

A batch warmup (train.batch_warmup_steps: data.MicroSchedule) makes a side's first steps read fewer micro-batches, and
cost less: each step record's `tokens` are the tokens it read. A side's step time and tokens/s are those of its
whole steps (the last step's tokens); its budget counts a step of fewer micro-batches at its share of a whole step's
time (plan).

Time to a loss: the training seconds at which a side's validation loss first reaches it, interpolated linearly in
seconds between the two evaluations around the crossing (before the first evaluation: from ln(vocab) at 0 s, the loss
of a uniform prediction, which the modern block's zero head starts at). The table gives, for each side, the seconds it
needs to reach every side's final loss; the issue's goals are read off it.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.plot import line_chart
from microgpt.config import TrainConfig
from microgpt.data import MicroSchedule


def plan(
    budget_s: float, step_s: float, eval_s: float, warm: int, micro: MicroSchedule | None = None
) -> tuple[int, int]:
    """(steps, eval_every) for about budget_s training seconds at step_s a whole step, an evaluation every ~eval_s
    steps. With a batch warmup (micro) the steps are the fewest whose micro-batches reach those of
    round(budget_s / step_s) whole steps: a step of fewer micro-batches counted at its share of step_s."""
    whole = round(budget_s / step_s)
    steps = whole
    if micro is not None:  # before(s) grows with s, and before(whole + W) >= whole x n_micro
        lo, hi = 0, whole + micro.warmup_steps
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if micro.before(mid) < whole * micro.n_micro else (lo, mid)
        steps = lo
    return max(2 * warm + 1, steps), max(1, round(eval_s / step_s))


def scaled_warmup(t: TrainConfig, steps: int) -> int:
    """The experiment's warmup steps as the same share of `steps` as of its own train.steps."""
    return round(t.warmup_steps * steps / t.steps)


def step_times(records: list[dict[str, Any]]) -> list[float]:
    return [r["dt_ms"] / 1000 for r in records if r["event"] == "step"]


def summarize(records: list[dict[str, Any]], warm: int) -> dict[str, Any]:
    """A run's step times counted (each of the first `warm` at the median of the later steps of its tokens), its
    evaluations at those seconds; its step time and tokens/s those of its whole steps (the last step's tokens)."""
    dts = step_times(records)
    steps = [r for r in records if r["event"] == "step"]
    whole = steps[-1]["tokens"]
    median = statistics.median([dt for r, dt in zip(steps[warm:], dts[warm:]) if r["tokens"] == whole])

    def at_median(r: dict[str, Any]) -> float:
        """A warm step's counted seconds: the median of the later steps that read its tokens, else its share of a
        whole step's."""
        same = [dt for x, dt in zip(steps[warm:], dts[warm:]) if x["tokens"] == r["tokens"]]
        return statistics.median(same) if same else median * r["tokens"] / whole

    counted, clock = [at_median(r) for r in steps[:warm]] + dts[warm:], [0.0]
    for dt in counted:
        clock.append(clock[-1] + dt)
    start = next((r for r in records if r["event"] == "start"), {})
    evals = [
        {"step": r["step"], "train_s": round(clock[r["step"]], 3), "val_loss": r["val_loss"]}
        for r in records
        if r["event"] == "eval"
    ]
    return {
        "steps": len(dts),
        "eval_every": evals[0]["step"],
        "tokens_per_step": whole,
        "tokens": sum(r["tokens"] for r in steps),
        "step_s": median,
        "tokens_per_s": whole / median,
        "train_s": round(clock[-1], 3),
        "final_val_loss": evals[-1]["val_loss"],
        "final_train_loss": steps[-1]["loss"],
        "evals": evals,
        "n_params": start.get("n_params"),
        "device": start.get("device"),
        "step_dt_ms": [r["dt_ms"] for r in steps],
        "first_steps_s": [round(d, 3) for d in dts[:warm]],
    }


def seconds_to(evals: list[dict[str, Any]], target: float, start_loss: float) -> float | None:
    """The training seconds at which the evaluations first reach target (interpolated linearly between the two around
    the crossing; before the first, from start_loss at 0 s); None if they never do."""
    t0, l0 = 0.0, start_loss
    for e in evals:
        t1, l1 = e["train_s"], e["val_loss"]
        if l1 <= target:
            return t0 if l0 <= target else t0 + (l0 - target) / (l0 - l1) * (t1 - t0)
        t0, l0 = t1, l1
    return None


def merge(folder: Path, shape_name: str, vocab_size: int, names: Iterable[str]) -> dict[str, Any]:
    """Every side of `names` recorded in folder: finals, the seconds each side needs to reach each final loss (from
    ln(vocab_size) at 0 s), the goals."""
    sides = {
        x: json.loads((folder / f"side-{x}.json").read_text()) for x in names if (folder / f"side-{x}.json").is_file()
    }
    ok = {x: s for x, s in sides.items() if "evals" in s}
    start = math.log(vocab_size)
    reach = {x: {y: seconds_to(ok[x]["evals"], ok[y]["final_val_loss"], start) for y in ok} for x in ok}
    goals = {}
    if "a" in ok and "b" in ok and reach["b"]["a"]:
        goals["b_reaches_a_final_x_faster"] = reach["a"]["a"] / reach["b"]["a"]  # issue 46: >= 1.6
        goals["b_tokens_per_s_over_a"] = ok["b"]["tokens_per_s"] / ok["a"]["tokens_per_s"]  # >= 0.9
    if "b" in ok and "c" in ok and reach["b"]["c"]:
        goals["b_reaches_c_final_x_sooner"] = reach["c"]["c"] / reach["b"]["c"]  # >= 1.25
    prep = folder / "prep.json"
    return {
        "shape": shape_name,
        "folder": str(folder),
        "definition": TIME_DEFINITION,
        "prep": json.loads(prep.read_text()) if prep.is_file() else None,
        "sides": {x: {k: v for k, v in s.items() if k != "step_dt_ms"} for x, s in sides.items()},
        "seconds_to": reach,
        "goals": goals,
    }


TIME_DEFINITION = (
    "training seconds: each step's host-clock time from reading its batches to reading its loss back, "
    "the first `warm` steps counted at the median of the rest; evaluations excluded. Time to a loss: "
    "interpolated linearly in seconds between the evaluations around the crossing"
)


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else f"{v:{spec}}"


def report(res: dict[str, Any]) -> str:
    """The markdown tables (sides, seconds to each final loss, loss against seconds) and the goals."""
    ok = {x: s for x, s in res["sides"].items() if "evals" in s}
    lines = [
        f"time to loss, shape {res['shape']}; {res['definition']}",
        "",
        "| side | recipe | steps | tokens/step | tokens/s | train s | final val loss | "
        + " | ".join(f"s to {y}'s {ok[y]['final_val_loss']:.4f}" for y in ok)
        + " |",
        "|" + "---|" * (7 + len(ok)),
    ]
    for x, s in res["sides"].items():
        if x not in ok:
            lines.append(f"| {x} | {s['label']} | failed: {s.get('error', '?')[:80]} |")
            continue
        reach = [fmt(res["seconds_to"][x][y]) for y in ok]
        cells = [
            x,
            s["label"],
            str(s["steps"]),
            f"{s['tokens_per_step']:,}",
            f"{s['tokens_per_s']:,.0f}",
            fmt(s["train_s"]),
            f"{s['final_val_loss']:.4f}",
            *reach,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    goal_text = {
        "b_reaches_a_final_x_faster": "(b) reaches (a)'s final loss {:.2f}x faster than (a) (goal >= 1.6)",
        "b_reaches_c_final_x_sooner": "(b) reaches (c)'s final loss {:.2f}x sooner than (c) (goal >= 1.25)",
        "b_tokens_per_s_over_a": "(b)'s tokens/s over (a)'s: {:.2f}x (goal >= 0.9)",
    }
    lines += [""] + [goal_text[k].format(v) for k, v in res["goals"].items()]
    budgets = {x: s["budget_s"] for x, s in ok.items()}
    if len(set(budgets.values())) > 1:
        lines.append("the sides ran with different budgets: " + ", ".join(f"{x} {b:g} s" for x, b in budgets.items()))
    for x, s in ok.items():
        points = ", ".join(f"{e['train_s']:.0f} s {e['val_loss']:.3f}" for e in s["evals"])
        lines.append(f"({x}) val loss at training seconds: {points}")
    return "\n".join(lines)


def write_results(
    folder: Path, shape_name: str, vocab_size: int, names: Iterable[str], device: str = "one gpu"
) -> dict[str, Any]:
    """merge's results into folder/ttl.json, and their plot into folder/ttl.png (its title names the device)."""
    res = merge(folder, shape_name, vocab_size, names)
    (folder / "ttl.json").write_text(json.dumps(res, indent=1) + "\n")
    ok = {x: s for x, s in res["sides"].items() if "evals" in s}
    if ok:
        series = {f"({x}) {s['label']}": [(e["train_s"], e["val_loss"]) for e in s["evals"]] for x, s in ok.items()}
        hline = (ok["a"]["final_val_loss"], f"(a)'s final {ok['a']['final_val_loss']:.3f}") if "a" in ok else None
        line_chart(
            folder / "ttl.png",
            series,
            f"validation loss against training seconds, {shape_name}, {device}",
            "training seconds",
            "validation loss",
            hline,
        )
    return res
