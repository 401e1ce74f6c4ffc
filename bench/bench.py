"""Throughput and memory: microgpt's triton backend against a PyTorch baseline of the same model.

    python3 bench/bench.py                      # every config, one subprocess each; prints one markdown table
    python3 bench/bench.py --impl eager --mb 8  # one config in this process; prints one JSON line
    python3 bench/bench.py --impls compile torchao microgpt microgpt-fp8 --mbs 32 8   # the fp8 table

Impls: eager and compile (the PyTorch baseline, bench/torch_gpt.py, bf16 autocast), torchao and torchao-rowwise
(compile plus torchao's float8 training on every block linear, tensorwise or rowwise scaling; the tied head stays
bf16: it is F.linear on wte, not an nn.Linear, so convert_to_float8_training never sees it), microgpt (--precision,
default bf16) and microgpt-fp8 (microgpt with precision fp8).

Shape: ANDREA-120M (d 768, 12 layers, 12 heads, T 1024, vocab 50304), bf16, AdamW (fused), clip 1.0, one
micro-batch per optimizer step. Each step: copy a batch in, forward, backward, clip, AdamW, zero; tokens/s is
the median over the timed steps (host clock around each step, synchronized). MFU uses FLOPs/token =
6*N + 12*L*T*d against 989 TFLOP/s dense bf16. SM MHz and W: the GPU's mean SM clock and power draw over the
timed steps (NVML; the H200 keeps its power limit by lowering the clock). Peak = torch.cuda.max_memory_allocated
over the whole run. For microgpt also: the planned bytes (memory.role_bytes of the state's plan: the arena plus
cuBLAS's workspace), the peak over the first step (warm-up, graph capture, first replay; from just before
make_state) and the steady peak over the timed steps, each as a percentage over (+) or under (-) the plan.
Inputs rotate over 4 random batches, never zeros: a GPU's power draw, and so its clock under the power limit,
depends on the values it multiplies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from microgpt import memory, params  # noqa: E402
from microgpt.config import ModelConfig, TrainConfig  # noqa: E402

PEAK_FLOPS = 989e12  # dense bf16; fp8 runs are counted against it too, so their MFU compares with bf16's
IMPLS = ["eager", "compile", "torchao", "torchao-rowwise", "microgpt", "microgpt-fp8"]
SHAPE = ModelConfig(vocab_size=50304, d_model=768, n_layer=12, n_head=12, seq_len=1024)


def flops_per_token(m: ModelConfig) -> int:
    return 6 * params.n_params(m) + 12 * m.n_layer * m.seq_len * m.d_model


def batches(mb: int, m: ModelConfig, n: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [tuple(rng.integers(0, m.vocab_size, (mb, m.seq_len)).astype(np.int32) for _ in range(2)) for _ in range(n)]


def timed(step, n_warmup: int, n_steps: int) -> dict:
    """{"times": each timed step's seconds, "sm_mhz" and "watts": the GPU's mean SM clock and power draw over the
    timed steps}. A GPU holds its board power limit by lowering the SM clock (the H200 does at micro-batch 32:
    bench/RESULTS.md, "Where it stands"), so the clock says how much of a difference between two rows is the power
    limit's."""
    times: list[float] = []
    with Clocks() as clocks:
        for i in range(n_warmup + n_steps):
            if i == n_warmup:
                clocks.start()
            t0 = time.perf_counter()
            step(i)
            torch.cuda.synchronize()
            if i >= n_warmup:
                times.append(time.perf_counter() - t0)
    return {"times": times, **clocks.means()}


class Clocks:
    """The GPU's SM clock and power draw read every 50 ms on a thread from start() to the end of the `with`
    (NVML through torch.cuda; nothing where NVML is missing)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.samples.append((torch.cuda.clock_rate(), torch.cuda.power_draw() / 1e3))
            except Exception:  # no NVML (pynvml) here: the table leaves the columns empty
                return

    def __enter__(self) -> "Clocks":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def means(self) -> dict:
        if not self.samples:
            return {}
        return {"sm_mhz": statistics.fmean(c for c, _ in self.samples),
                "watts": statistics.fmean(w for _, w in self.samples)}  # fmt: skip


def run_microgpt(mb: int, precision: str, n_warmup: int, n_steps: int, m: ModelConfig = SHAPE) -> dict:
    from microgpt.backend import triton_backend
    from microgpt.state import make_state
    from microgpt.step import Step

    t = TrainConfig(micro_batch=mb, n_micro=1, precision=precision, backend="triton", grad_clip=1.0, seed=0)
    K = triton_backend(precision)  # its side stream and cuBLAS's workspace (a "runtime" row of the plan) exist now
    torch.cuda.reset_peak_memory_stats()  # the peak starts from what is allocated: the workspace, nothing else
    S = make_state(m, t, K)
    planned = sum(memory.role_bytes(S.plan, S.K.precision).values())
    step = Step(S)
    data = batches(mb, m)
    losses = []

    def one(i: int) -> None:
        losses.append(step([data[i % len(data)]], 6e-4).loss)

    one(0)  # warm-up (compiles, times the GEMM and attention choices in planned memory), capture, first replay
    peak_first = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = timed(one, n_warmup, n_steps)
    peak_steady = torch.cuda.max_memory_allocated()
    return {**res, "planned": planned, "arena": S.arena.nbytes, "loss_first": losses[0],
            "loss_last": losses[-1], "peak_first": peak_first, "peak_steady": peak_steady,
            "first_vs_plan": peak_first / planned, "steady_vs_plan": peak_steady / planned,
            "gemm": S.K.tuned()["gemm_run"]}  # fmt: skip


def run_torch(mb: int, compiled: bool, n_warmup: int, n_steps: int, m: ModelConfig = SHAPE,
              float8: str | None = None) -> dict:  # fmt: skip
    from bench.torch_gpt import GPT, make_optimizer

    torch.manual_seed(0)
    net = GPT(m).cuda()
    if float8:  # torchao float8 training: every nn.Linear (the block linears) swapped for Float8Linear
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        cfg = Float8LinearConfig() if float8 == "tensorwise" else Float8LinearConfig.from_recipe_name(float8)
        convert_to_float8_training(net, config=cfg)
    opt = make_optimizer(net)
    fwd = torch.compile(net) if compiled else net
    data = [tuple(torch.from_numpy(a).long().pin_memory() for a in b) for b in batches(mb, m)]
    losses = []

    def one(i: int) -> None:
        x, y = (a.cuda(non_blocking=True) for a in data[i % len(data)])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    res = timed(one, n_warmup, n_steps)
    return {**res, "planned": None, "loss_first": float(losses[0]), "loss_last": float(losses[-1])}


def run_one(args: argparse.Namespace) -> dict:
    torch.cuda.reset_peak_memory_stats()
    if args.impl == "microgpt-fp8":
        args.precision = "fp8"
    if args.impl in ("microgpt", "microgpt-fp8"):
        res = run_microgpt(args.mb, args.precision, args.warmup, args.steps)
    else:
        float8 = {"torchao": "tensorwise", "torchao-rowwise": "rowwise"}.get(args.impl)
        res = run_torch(args.mb, args.impl != "eager", args.warmup, args.steps, float8=float8)
        args.precision = f"bf16 + float8 {float8}" if float8 else "bf16"
    tok = args.mb * SHAPE.seq_len
    med = statistics.median(res.pop("times"))
    res.update(impl=args.impl, mb=args.mb, precision=args.precision, step_ms=1000 * med, tokens_per_s=tok / med,
               mfu=tok / med * flops_per_token(SHAPE) / PEAK_FLOPS,
               peak=max(torch.cuda.max_memory_allocated(), res.get("peak_first", 0)))  # fmt: skip
    return res


def vs_plan(r: dict, key: str) -> str:
    """A peak as a percentage over (+) or under (-) the planned bytes."""
    return f"{100 * (r[key] / r['planned'] - 1):+.1f}%" if r.get(key) and r.get("planned") else "-"


def table(rows: list[dict]) -> str:
    lines = ["| impl | precision | micro-batch | tokens/s | vs eager | vs compile | vs microgpt bf16 | MFU | step ms "
             "| SM MHz | W | peak GiB | steady peak GiB | planned GiB | first step vs plan | steady vs plan |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    base = {(r["impl"], r["mb"]): r["tokens_per_s"] for r in rows if "tokens_per_s" in r}
    for r in rows:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['impl']} | | {r['mb']} | failed: {r.get('error', '?')[:60]} | | | | | | | | | | | | |")
            continue
        ratio = [f"{r['tokens_per_s'] / base[(b, r['mb'])]:.2f}x" if (b, r["mb"]) in base else "-"
                 for b in ("eager", "compile", "microgpt")]  # fmt: skip
        planned = f"{r['planned'] / 2**30:.2f}" if r.get("planned") else "-"
        steady = f"{r['peak_steady'] / 2**30:.2f}" if r.get("peak_steady") else "-"
        peak = f"{r['peak'] / 2**30:.2f}"
        clocks = f"{r['sm_mhz']:,.0f} | {r['watts']:.0f}" if "sm_mhz" in r else "- | -"
        lines.append(f"| {r['impl']} | {r.get('precision', '')} | {r['mb']} | {r['tokens_per_s']:,.0f} | {ratio[0]} | "
                     f"{ratio[1]} | {ratio[2]} | "
                     f"{100 * r['mfu']:.1f}% | {r['step_ms']:.1f} | {clocks} | {peak} | {steady} | {planned} | "
                     f"{vs_plan(r, 'peak_first')} | {vs_plan(r, 'peak_steady')} |")  # fmt: skip
    return "\n".join(lines)


def run_all(args: argparse.Namespace) -> None:
    rows = []
    for mb in args.mbs:
        for impl in args.impls:
            cmd = [sys.executable, __file__, "--impl", impl, "--mb", str(mb), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--precision", args.precision]  # fmt: skip
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=os.environ)
                out = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
                row = out[-1] if out else {"impl": impl, "mb": mb, "error": p.stderr.strip().splitlines()[-1:]}
                if p.returncode:
                    sys.stderr.write(p.stderr[-3000:])
            except subprocess.TimeoutExpired:
                row = {"impl": impl, "mb": mb, "error": f"timeout {args.timeout}s"}
            row["error"] = str(row.get("error", ""))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(table(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impl", choices=IMPLS)
    p.add_argument("--mb", type=int, default=8)
    p.add_argument("--mbs", type=int, nargs="+", default=[8, 32])
    p.add_argument("--impls", nargs="+", default=["eager", "compile", "microgpt"])
    p.add_argument("--precision", default="bf16")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--jsonl", help="append each config's result here")
    args = p.parse_args()
    if args.impl:
        print(json.dumps(run_one(args)), flush=True)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
