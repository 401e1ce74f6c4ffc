"""Throughput and memory: microgpt's triton backend against a PyTorch baseline of the same model.

    python3 bench/bench.py                      # every config, one subprocess each; prints one markdown table
    python3 bench/bench.py --impl eager --mb 8  # one config in this process; prints one JSON line
    python3 bench/bench.py --impls compile torchao microgpt microgpt-fp8 --mbs 32 8   # the fp8 table
    python3 bench/bench.py --shape 12m --impls eager compile microgpt microgpt-fp8   # ANDREA-12M, 16 x 4

Impls: eager and compile (the PyTorch baseline, bench/torch_gpt.py, bf16 autocast), torchao and torchao-rowwise
(compile plus torchao's float8 training on every block linear, tensorwise or rowwise scaling; the tied head stays
bf16: it is F.linear on wte, not an nn.Linear, so convert_to_float8_training never sees it), microgpt (--precision,
default bf16) and microgpt-fp8 (microgpt with precision fp8), microgpt-modern and microgpt-modern-fp8 (the same on
the shape's modern twin, MODERN: the model of experiments/ANDREA-*-MODERN-TRAIN.json, train.optimizer "muon").

Shapes (--shape): 120m, ANDREA-120M's model (d 768, 12 layers, 12 heads, T 1024, vocab 50304; one micro-batch per
optimizer step unless --n-micro); 12m, ANDREA-12M's (d 384, 6 layers, 6 heads, T 512, vocab 4096), the seed's
reproducible model, at its recipe's micro-batch 16 x n_micro 4; tiny, a 2-layer toy for the CPU smoke test (there
the PyTorch rows run on the CPU, and microgpt's under TRITON_INTERPRET=1 at --precision fp32). Models come from
experiments/*.json. bf16, AdamW (fused; the modern rows: Muon and AdamW), clip 1.0. Each step: copy the batches in,
forward and backward per micro-batch, clip, the optimizer, zero; tokens/s is the median over the timed steps (host clock
around each step, synchronized). MFU uses FLOPs/token = 6*N + 12*L*T*d against 989 TFLOP/s dense bf16. SM MHz and W: the
GPU's mean SM clock and power draw over the timed steps (NVML; the H200 keeps its power limit by lowering the clock).

Energy: the joules the GPU used over the timed steps, from NVML's total-energy counter read before the first and
after the last timed step ("counter"), or where the card has no counter the mean power draw times that window
("power x time"); tokens/J = the timed steps' tokens over those joules, J/step = those joules over the timed steps.
The counter moves in steps of the driver's update period, so a window under a second reads coarse: give a short
step more --steps (each row's JSON line has its window_s, and joules_power, power x time, beside the counter's
joules as a check; the table's energy column says "coarse" with the window where it is under COARSE_S).

Peak = torch.cuda.max_memory_allocated over the whole run. For microgpt also: the planned bytes (memory.role_bytes
of the state's plan: the arena plus cuBLAS's workspace), the peak over the first step (warm-up, graph capture, first
replay; from just before make_state) and the steady peak over the timed steps, each as a percentage over (+) or
under (-) the plan.
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
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from microgpt import config  # noqa: E402
from microgpt.config import ModelConfig, TrainConfig  # noqa: E402
from microgpt.engine import memory, params  # noqa: E402

PEAK_FLOPS = 989e12  # dense bf16; fp8 runs are counted against it too, so their MFU compares with bf16's
IMPLS = [
    "eager",
    "compile",
    "torchao",
    "torchao-rowwise",
    "microgpt",
    "microgpt-fp8",
    "microgpt-modern",
    "microgpt-modern-fp8",
]
EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
# shape -> (its model, the default micro-batches, the default n_micro)
SHAPES = {
    "120m": (config.load(EXPERIMENTS / "ANDREA-120M-TRAIN.json").model, [8, 32], 1),
    "12m": (config.load(EXPERIMENTS / "ANDREA-12M-TRAIN.json").model, [16], 4),
    "tiny": (ModelConfig(vocab_size=256, d_model=32, n_layer=2, n_head=4, seq_len=32), [2], 2),
}
SHAPE = SHAPES["120m"][0]
MODERN = {
    "120m": config.load(EXPERIMENTS / "ANDREA-120M-MODERN-TRAIN.json").model,  # the modern twin of each shape
    "12m": config.load(EXPERIMENTS / "ANDREA-12M-MODERN-TRAIN.json").model,
    "tiny": ModelConfig(vocab_size=256, d_model=32, n_layer=2, n_head=2, seq_len=32, block="modern"),
}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the PyTorch rows of the tiny smoke test


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def reset_peak() -> None:
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak() -> int | None:
    """The device's peak allocated bytes since reset_peak; None on the CPU (no allocator to ask)."""
    return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else None


flops_per_token = params.flops_per_token  # 6N + 12 L T d (engine/params.py)


def batches(mb: int, m: ModelConfig, n: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [tuple(rng.integers(0, m.vocab_size, (mb, m.seq_len)).astype(np.int32) for _ in range(2)) for _ in range(n)]


def timed(step, n_warmup: int, n_steps: int) -> dict:
    """{"times": each timed step's seconds, **Clocks.means over the timed steps}: the GPU's mean SM clock and power
    draw, and the joules it used. A GPU holds its board power limit by lowering the SM clock (the H200 does at
    micro-batch 32: bench/RESULTS.md, "Where it stands"), so the clock says how much of a difference between two
    rows is the power limit's, and the joules what a step costs there."""
    times: list[float] = []
    with Clocks(nvml_energy()) as clocks:
        for i in range(n_warmup + n_steps):
            if i == n_warmup:
                clocks.start()
            t0 = time.perf_counter()
            step(i)
            sync()
            if i >= n_warmup:
                times.append(time.perf_counter() - t0)
    return {"times": times, **clocks.means()}


def per_joule(res: dict, tokens: int, n_steps: int) -> dict:
    """joules_per_step and tokens_per_j of n_steps steps of `tokens` each, from res["joules"] (Clocks.means); {}
    where nothing was measured."""
    if not res.get("joules"):
        return {}
    return {"joules_per_step": res["joules"] / n_steps, "tokens_per_j": tokens * n_steps / res["joules"]}


def nvml_energy() -> Callable[[], float] | None:
    """A reader of this process's GPU's NVML total-energy counter in joules (NVML counts millijoules since the
    driver loaded; Volta and newer), or None where pynvml (nvidia-ml-py), the GPU or the counter is missing. The
    GPU is found by its UUID, so CUDA_VISIBLE_DEVICES cannot point the reader at another card."""
    if DEVICE != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(DEVICE).uuid}")
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # NVMLError_NotSupported on a card without the counter
    except Exception:
        return None
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3


def gpu_clock_power() -> tuple[float, float]:
    """(SM MHz, W) now, as NVML averages them over its last sample period (torch.cuda reads them through pynvml)."""
    return torch.cuda.clock_rate(), torch.cuda.power_draw() / 1e3


class Clocks:
    """From start() to the end of the `with`: read() (SM MHz, W) every 50 ms on a thread, and counter() (joules,
    a monotonic energy counter: nvml_energy's) at both ends. A reader that raises (no NVML here) leaves its
    columns empty; the counter raising mid-run leaves the window's energy to power x time."""

    def __init__(
        self, counter: Callable[[], float] | None = None, read: Callable[[], tuple[float, float]] = gpu_clock_power
    ) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._counter, self._read = counter, read
        self._ends: list[tuple[float, float | None]] = []  # (host clock, counter's joules) at start() and the end

    def _mark(self) -> None:
        try:
            joules = self._counter() if self._counter is not None else None
        except Exception:
            joules = None
        self._ends.append((time.perf_counter(), joules))

    def start(self) -> None:
        self._mark()
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.samples.append(self._read())
            except Exception:  # no NVML (pynvml) here: the table leaves the columns empty
                return

    def __enter__(self) -> "Clocks":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ends:
            self._mark()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def means(self) -> dict:
        """sm_mhz and watts (means of the samples); window_s (start() to the end, host clock); joules over the
        window and where they came from: energy "counter", or "power x time" (the mean draw times window_s) where
        there is no counter; joules_power, power x time beside the counter's reading, as a check on it."""
        out: dict = {}
        if self.samples:
            out["sm_mhz"] = statistics.fmean(c for c, _ in self.samples)
            out["watts"] = statistics.fmean(w for _, w in self.samples)
        if len(self._ends) == 2:
            (t0, e0), (t1, e1) = self._ends
            out["window_s"] = t1 - t0
            if self.samples:
                out["joules_power"] = out["watts"] * (t1 - t0)
            if e0 is not None and e1 is not None:
                out.update(joules=e1 - e0, energy="counter")
            elif self.samples:
                out.update(joules=out["joules_power"], energy="power x time")
        return out


def run_microgpt(
    mb: int,
    precision: str,
    n_warmup: int,
    n_steps: int,
    m: ModelConfig = SHAPE,
    n_micro: int = 1,
    optimizer: str = "adamw",
) -> dict:
    from microgpt.engine.backend import triton_backend
    from microgpt.engine.state import make_state
    from microgpt.engine.step import Step

    t = TrainConfig(
        micro_batch=mb,
        n_micro=n_micro,
        precision=precision,
        backend="triton",
        grad_clip=1.0,
        seed=0,
        optimizer=optimizer,
    )
    K = triton_backend(precision)  # its side stream and cuBLAS's workspace (a "runtime" row of the plan) exist now
    reset_peak()  # the peak starts from what is allocated: the workspace, nothing else
    S = make_state(m, t, K)
    planned = sum(memory.role_bytes(S.plan, S.K.precision).values())
    step = Step(S)
    data = batches(mb, m)
    losses = []

    def one(i: int) -> None:
        losses.append(step([data[(i * n_micro + j) % len(data)] for j in range(n_micro)], 6e-4).loss)

    one(0)  # warm-up (compiles, times the GEMM and attention choices in planned memory), capture, first replay
    peak_first = peak()
    reset_peak()
    res = timed(one, n_warmup, n_steps)
    peak_steady = peak()
    return {
        **res,
        "planned": planned,
        "arena": S.arena.nbytes,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "peak_first": peak_first,
        "peak_steady": peak_steady,
        "first_vs_plan": peak_first and peak_first / planned,
        "steady_vs_plan": peak_steady and peak_steady / planned,
        "gemm": S.K.tuned()["gemm_run"],
    }


def run_torch(
    mb: int,
    compiled: bool,
    n_warmup: int,
    n_steps: int,
    m: ModelConfig = SHAPE,
    float8: str | None = None,
    n_micro: int = 1,
) -> dict:
    from bench.torch_gpt import GPT, make_optimizer

    torch.manual_seed(0)
    net = GPT(m).to(DEVICE)
    if float8:  # torchao float8 training: every nn.Linear (the block linears) swapped for Float8Linear
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        cfg = Float8LinearConfig() if float8 == "tensorwise" else Float8LinearConfig.from_recipe_name(float8)
        convert_to_float8_training(net, config=cfg)
    opt = make_optimizer(net)
    fwd = torch.compile(net) if compiled else net
    data = [tuple(torch.from_numpy(a).long() for a in b) for b in batches(mb, m)]
    data = [tuple(a.pin_memory() for a in b) for b in data] if DEVICE == "cuda" else data
    losses = []

    def one(i: int) -> None:
        total = 0.0
        for j in range(n_micro):  # accumulate the mean loss's gradient over the micro-batches, as microgpt's step
            x, y = (a.to(DEVICE, non_blocking=True) for a in data[(i * n_micro + j) % len(data)])
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                loss = fwd(x, y) / n_micro
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)

    res = timed(one, n_warmup, n_steps)
    return {**res, "planned": None, "loss_first": float(losses[0]), "loss_last": float(losses[-1])}


def run_one(args: argparse.Namespace) -> dict:
    m, cuda = SHAPES[args.shape][0], DEVICE == "cuda"
    reset_peak()
    if args.impl.endswith("-fp8"):
        args.precision = "fp8"
    if args.impl.startswith("microgpt-modern"):
        m = MODERN[args.shape]
        res = run_microgpt(args.mb, args.precision, args.warmup, args.steps, m, args.n_micro, "muon")
    elif args.impl in ("microgpt", "microgpt-fp8"):
        res = run_microgpt(args.mb, args.precision, args.warmup, args.steps, m, args.n_micro)
    else:
        float8 = {"torchao": "tensorwise", "torchao-rowwise": "rowwise"}.get(args.impl)
        res = run_torch(args.mb, args.impl != "eager", args.warmup, args.steps, m, float8, args.n_micro)
        args.precision = f"bf16 + float8 {float8}" if float8 else "bf16"
    tok = args.mb * args.n_micro * m.seq_len  # a step's tokens
    times = res.pop("times")
    med = statistics.median(times)
    res.update(
        impl=args.impl,
        mb=args.mb,
        n_micro=args.n_micro,
        shape=args.shape,
        device=DEVICE,
        precision=args.precision,
        step_ms=1000 * med,
        tokens_per_s=tok / med,
        mfu=tok / med * flops_per_token(m) / PEAK_FLOPS,
        peak=max(peak(), res.get("peak_first", 0)) if cuda else None,
    )
    return {**res, **per_joule(res, tok, len(times))}


def vs_plan(r: dict, key: str) -> str:
    """A peak as a percentage over (+) or under (-) the planned bytes."""
    return f"{100 * (r[key] / r['planned'] - 1):+.1f}%" if r.get(key) and r.get("planned") else "-"


COLUMNS = ["impl", "precision", "micro-batch", "tokens/s", "tokens/J", "vs eager", "vs compile", "vs microgpt bf16",
           "MFU", "step ms", "J/step", "SM MHz", "W", "peak GiB", "steady peak GiB", "planned GiB",
           "first step vs plan", "steady vs plan", "energy"]  # fmt: skip


COARSE_S = 1.0  # a timed window shorter than this reads NVML's energy counter in too few of its steps


def energy(r: dict) -> str:
    """Where a row's joules come from, and "coarse" with the window where it was too short to read them well."""
    if "energy" not in r:
        return "-"
    window = r.get("window_s")
    return f"{r['energy']}, coarse ({window:.2f} s)" if window is not None and window < COARSE_S else r["energy"]


def gib(r: dict, key: str) -> str:
    return f"{r[key] / 2**30:.2f}" if r.get(key) else "-"


def cells(r: dict, base: dict) -> list[str]:
    """One measured row's cells, in COLUMNS' order."""
    ratio = [
        f"{r['tokens_per_s'] / base[(b, r['mb'])]:.2f}x" if (b, r["mb"]) in base else "-"
        for b in ("eager", "compile", "microgpt")
    ]
    per_j = f"{r['tokens_per_j']:,.0f}" if r.get("tokens_per_j") else "-"
    j_step = f"{r['joules_per_step']:.2f}" if r.get("joules_per_step") else "-"
    clocks = [f"{r['sm_mhz']:,.0f}", f"{r['watts']:.0f}"] if "sm_mhz" in r else ["-", "-"]
    return [
        r["impl"],
        r.get("precision", ""),
        micro_batch(r),
        f"{r['tokens_per_s']:,.0f}",
        per_j,
        *ratio,
        f"{100 * r['mfu']:.1f}%",
        f"{r['step_ms']:.1f}",
        j_step,
        *clocks,
        gib(r, "peak"),
        gib(r, "peak_steady"),
        gib(r, "planned"),
        vs_plan(r, "peak_first"),
        vs_plan(r, "peak_steady"),
        energy(r),
    ]


def micro_batch(r: dict) -> str:
    return f"{r['mb']} x {r['n_micro']}" if r.get("n_micro", 1) > 1 else str(r["mb"])


def table(rows: list[dict]) -> str:
    """The markdown table of rows (run_one's dicts); a row with no tokens_per_s failed, and says so in its place."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    base = {(r["impl"], r["mb"]): r["tokens_per_s"] for r in rows if "tokens_per_s" in r}
    for r in rows:
        if "tokens_per_s" in r:
            row = cells(r, base)
        else:
            failed = f"failed: {str(r.get('error') or '?')[:60]}".replace("|", "/")
            row = [r["impl"], "", micro_batch(r), failed] + [""] * (len(COLUMNS) - 4)
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def run_all(args: argparse.Namespace) -> None:
    rows = []
    for mb in args.mbs:
        for impl in args.impls:
            cmd = [
                sys.executable,
                __file__,
                "--impl",
                impl,
                "--mb",
                str(mb),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--precision",
                args.precision,
                "--shape",
                args.shape,
                "--n-micro",
                str(args.n_micro),
            ]
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
    p.add_argument("--shape", choices=list(SHAPES), default="120m", help="the model (see above)")
    p.add_argument("--mb", type=int, help="with --impl: the micro-batch (default: the shape's first)")
    p.add_argument("--mbs", type=int, nargs="+", help="micro-batches, one row each (default: the shape's)")
    p.add_argument("--n-micro", type=int, help="micro-batches per optimizer step (default: the shape's)")
    p.add_argument("--impls", nargs="+", default=["eager", "compile", "microgpt"])
    p.add_argument("--precision", default="bf16")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--jsonl", help="append each config's result here")
    args = p.parse_args()
    _, mbs, n_micro = SHAPES[args.shape]
    args.mbs, args.mb = args.mbs or mbs, args.mb or mbs[0]
    args.n_micro = args.n_micro or n_micro
    if args.impl:
        print(json.dumps(run_one(args)), flush=True)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
