"""The CPU table: microgpt's NumPy backend against PyTorch's CPU eager on ANDREA-tiny, side by side in one run.

    python3 bench/cpu.py                          # 1 and 2 threads, both impls, 3 rounds: one markdown table
    python3 bench/cpu.py --threads 2 --rounds 5
    python3 bench/cpu.py --impl microgpt-numpy    # one config in this process (threads from its environment)
    python3 bench/cpu.py --profile                # where a NumPy step's time goes, op by op, in this process
    python3 bench/cpu.py --impls microgpt-numpy --src ../before ../after   # two trees' NumPy backends, one run
    python3 bench/cpu.py --gemms                  # the model's GEMMs on NumPy's BLAS and on torch's; memory copy

Model and micro-batch are ANDREA-tiny's (experiments/ANDREA-tiny-TRAIN.json: d 192, 4 layers, 6 heads, T 128,
vocab 2,048, 16 sequences); fp32, one micro-batch an optimizer step, AdamW (lr 6e-4, betas 0.9/0.95, weight decay
0.1 on the 2-D weights), clip 1.0, both from microgpt's init of seed 0, on the same 4 random batches. eager-cpu is
bench/torch_gpt.py (the same architecture as an nn.Module) with fused AdamW; microgpt-numpy is the engine's Step on
the NumPy backend, in a process that never imports torch (as `microgpt train` on a machine without a GPU).

Threads: each config runs in its own process with OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS set to
its thread count (torch also gets torch.set_num_threads; the NumPy backend's own pool reads the same variables as
its BLAS). Rounds: each round runs every config once, in the same order, so that load from other processes on the
machine falls on both impls alike. A config's step time is the median over its timed steps; its row gives the best
round (the least disturbed: on a shared machine the other rounds measure the other processes too) and the median
over the rounds. CPU ms: the process's CPU time a timed step, all its threads together (at one thread, the step's
time less what other processes took from it; above one, also what BLAS threads spend spinning while they wait).
Loss first and last: both impls train the same model on the same batches, so they agree to float32 rounding: the
rows measure the same work.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

SRC_VAR = "MICROGPT_BENCH_SRC"  # a config's process imports microgpt from this tree (run_all's --src), else this one
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if os.environ.get(SRC_VAR):
    sys.path.insert(0, os.environ[SRC_VAR])
import microgpt  # noqa: E402, F401  # before NumPy, as in `microgpt train`: the package sets what NumPy's BLAS reads

# isort: split
import numpy as np  # noqa: E402

from microgpt import config, ops  # noqa: E402
from microgpt.config import ModelConfig, TrainConfig  # noqa: E402
from microgpt.engine.backend import Backend, numpy_backend  # noqa: E402
from microgpt.engine.state import make_state  # noqa: E402
from microgpt.engine.step import Step  # noqa: E402
from microgpt.ops import linear  # noqa: E402

IMPLS = ["eager-cpu", "microgpt-numpy"]
TINY = Path(__file__).resolve().parent.parent / "experiments" / "ANDREA-tiny-TRAIN.json"
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")  # OpenMP (torch), NumPy's BLAS, MKL
LR = 6e-4


def tiny() -> tuple[ModelConfig, int]:
    """ANDREA-tiny's model and micro-batch."""
    exp = config.load(TINY)
    return exp.model, int(exp.train.micro_batch)


def batches(mb: int, m: ModelConfig, n: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    """n random (tokens, targets) micro-batches, as bench/bench.py's."""
    rng = np.random.default_rng(0)
    return [tuple(rng.integers(0, m.vocab_size, (mb, m.seq_len)).astype(np.int32) for _ in range(2)) for _ in range(n)]


def blas_info() -> dict[str, str | int]:
    """NumPy's BLAS as built and, where it is OpenBLAS, the kernel its DYNAMIC_ARCH picked and its thread count,
    asked of the loaded library."""
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    info: dict[str, str | int] = {"numpy_blas": f"{blas['name']} {blas['version']}"}
    path = next((line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line), None)
    if path is None:
        return info
    lib = ctypes.CDLL(path)
    for key, fn in (("openblas_core", "get_corename"), ("openblas_threads", "get_num_threads")):
        names = (f"scipy_openblas_{fn}64_", f"openblas_{fn}64_", f"openblas_{fn}")
        f = next((getattr(lib, s) for s in names if hasattr(lib, s)), None)
        if f is not None:
            f.restype = ctypes.c_char_p if fn == "get_corename" else ctypes.c_int
            value = f()
            info[key] = value.decode() if isinstance(value, bytes) else value
    return info


def timed(step: Callable[[int], float], n_warmup: int, n_steps: int) -> dict:
    """Each timed step's wall seconds and the process's CPU seconds, and the first and last losses."""
    times, cpu, losses = [], [], []
    for i in range(n_warmup + n_steps):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step(i))
        if i >= n_warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {"times": times, "cpu": cpu, "loss_first": losses[0], "loss_last": losses[-1]}


def numpy_step(mb: int, m: ModelConfig, K: Backend | None = None) -> tuple[Callable[[int], float], Step]:
    """The engine's optimizer step on the NumPy backend (or K), as a function of the step index, and the Step."""
    t = TrainConfig(micro_batch=mb, n_micro=1, precision="fp32", backend="numpy", grad_clip=1.0, seed=0)
    step = Step(make_state(m, t, K or numpy_backend()))
    data = batches(mb, m)
    return lambda i: step([data[i % len(data)]], LR).loss, step


def eager_step(mb: int, m: ModelConfig) -> Callable[[int], float]:
    """bench/torch_gpt.py's model and fused AdamW on the CPU: the same step in PyTorch eager. torch is imported
    here, not at the top, so that the NumPy rows run in processes without it."""
    import torch

    from bench.torch_gpt import GPT, make_optimizer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    torch.manual_seed(0)
    net = GPT(m)
    opt = make_optimizer(net, lr=LR)
    data = [tuple(torch.from_numpy(a).long() for a in b) for b in batches(mb, m)]

    def one(i: int) -> float:
        x, y = data[i % len(data)]
        loss = net(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return one


def run_one(impl: str, n_warmup: int, n_steps: int) -> dict:
    """One config in this process: its JSON row."""
    m, mb = tiny()
    res = timed(numpy_step(mb, m)[0] if impl == "microgpt-numpy" else eager_step(mb, m), n_warmup, n_steps)
    med = statistics.median(res.pop("times"))
    info = blas_info()
    if impl == "eager-cpu":
        import torch

        info = {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    return {
        "impl": impl,
        "mb": mb,
        "threads": os.environ.get("OMP_NUM_THREADS", ""),
        "step_ms": 1000 * med,
        "cpu_ms": 1000 * statistics.median(res.pop("cpu")),
        "tokens_per_s": mb * m.seq_len / med,
        **res,
        **info,
        "numpy": np.__version__,
    }


def run_config(impl: str, threads: int, src: str, args: argparse.Namespace) -> dict:
    """One config's row from its own process, its thread variables set to `threads`, microgpt from the tree src
    (this one where empty); or what failed."""
    env = {**os.environ, **{var: str(threads) for var in THREAD_VARS}, SRC_VAR: src}
    cmd = [sys.executable, __file__, "--impl", impl, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "threads": str(threads), "error": f"timeout {args.timeout}s"}
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode or not rows:
        sys.stderr.write(p.stderr[-3000:])
        return {"impl": impl, "threads": str(threads), "error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    return rows[-1]


def table(runs: dict[tuple[int, str], list[dict]], load: tuple[float, float]) -> str:
    """One line per (threads, label): its best round (the one other processes disturbed least) and the median
    over the rounds, each against eager-cpu's at the same threads."""
    rows = [r for rs in runs.values() for r in rs if "step_ms" in r]
    np_row = next((r for r in rows if "numpy_blas" in r), {})
    torch_row = next((r for r in rows if "torch" in r), {})
    lines = [
        f"NumPy {np_row.get('numpy', '?')} with {np_row.get('numpy_blas', '?')} (kernel "
        f"{np_row.get('openblas_core', '?')}); torch {torch_row.get('torch', '?')}; {cpu_name()}, "
        f"{os.cpu_count()} cores; load average {load[0]:.2f} before, {load[1]:.2f} after",
        "",
        "| impl | threads | tokens/s | vs eager-cpu | step ms (best round) | median over rounds | median vs "
        "eager-cpu | CPU ms a step | rounds | loss first | loss last |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ok = {key: [r for r in rs if "step_ms" in r] for key, rs in runs.items()}
    best = {key: min(r["step_ms"] for r in rs) for key, rs in ok.items() if rs}
    med = {key: statistics.median(r["step_ms"] for r in rs) for key, rs in ok.items() if rs}
    for (threads, label), rs in ok.items():
        if not rs:
            error = str(runs[(threads, label)][-1].get("error", "?"))[:80]
            lines.append(f"| {label} | {threads} | failed: {error} | | | | | | | | |")
            continue
        key, base = (threads, label), (threads, "eager-cpu")
        tok = rs[0]["mb"] * tiny()[0].seq_len / best[key] * 1000
        ratio = f"{best[base] / best[key]:.2f}x" if base in best else "-"
        med_ratio = f"{med[base] / med[key]:.2f}x" if base in med else "-"
        cpu = statistics.median(r["cpu_ms"] for r in rs)
        lines.append(
            f"| {label} | {threads} | {tok:,.0f} | {ratio} | {best[key]:.1f} | {med[key]:.1f} | {med_ratio} "
            f"| {cpu:.1f} | {len(rs)} | {rs[0]['loss_first']:.6f} | {rs[0]['loss_last']:.6f} |"
        )
    return "\n".join(lines)


def profile(n_warmup: int, n_steps: int) -> str:
    """Where a NumPy step's wall time goes: every backend function the model and the step call, and inside them the
    precision's GEMM sites (the Matmul's methods) and GELU's passes (the names ops/linear.py calls, wrapped for
    this run), each as its median over n_steps steps after n_warmup (the median, not the mean: on a shared
    machine a few steps lose a time slice to other processes). Threads as this process's environment says."""
    calls: dict[str, int] = {}  # "op > inner > ..." -> calls over the timed steps
    seconds: dict[str, list[float]] = {}  # the same keys -> seconds in each timed step
    stack: list[str] = []
    timing = [-1]  # the timed step's index (-1: warming up)

    def timer(name: str, f: Callable) -> Callable:
        def run(*args, **kwargs):
            key = " > ".join([*stack, name])
            stack.append(name)
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                stack.pop()
                if timing[0] >= 0:
                    calls[key] = calls.get(key, 0) + 1
                    seconds.setdefault(key, [0.0] * n_steps)[timing[0]] += time.perf_counter() - t0

        return run

    K = numpy_backend()
    names = [fn for row in [*ops.OPS.values(), *ops.HELPERS.values()] for fn in row.functions]
    K = dataclasses.replace(K, **{fn: timer(fn, getattr(K, fn)) for fn in names})
    m, mb = tiny()
    one, step = numpy_step(mb, m, K)
    mm = step.S.prec.mm
    for method in ("forward", "backward", "logits_backward"):
        setattr(mm, method, timer(f"mm.{method}", getattr(mm, method)))
    saved = linear.gelu, linear.gelu_backward
    linear.gelu, linear.gelu_backward = timer("gelu", linear.gelu), timer("gelu_backward", linear.gelu_backward)
    walls = []
    try:
        for i in range(n_warmup):
            one(i)
        for i in range(n_steps):
            timing[0] = i
            t0 = time.perf_counter()
            one(n_warmup + i)
            walls.append(time.perf_counter() - t0)
    finally:
        linear.gelu, linear.gelu_backward = saved
    wall = statistics.median(walls)
    lines = [
        f"step {1000 * wall:.1f} ms (wall, the median of {n_steps} steps); threads "
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}",
        "",
        "| op | calls a step | ms a step | % of the step |",
        "|---|---|---|---|",
    ]
    for key in sorted(seconds):
        secs = statistics.median(seconds[key])
        lines.append(f"| {key} | {calls[key] / n_steps:g} | {1000 * secs:.1f} | {100 * secs / wall:.1f} |")
    return "\n".join(lines)


def gemms(reps: int = 20) -> str:
    """The model's GEMM sites at ANDREA-tiny's shapes (N = micro-batch x T rows; the head's in chunks of the NumPy
    backend's logits rows), forward and both gradients, on NumPy's BLAS and on torch's, each as GFLOP/s over the
    median thread CPU time of `reps` calls (CPU time: what other processes take does not count), at the threads the
    environment sets; and the memory bandwidth of one np.copyto of 64 MiB."""
    import torch

    from microgpt.engine import memory

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    m, mb = tiny()
    N, C, V = mb * m.seq_len, m.d_model, m.vocab_size
    R = memory.cpu_logits_rows(m, mb)
    sites = [
        ("w_q, w_k, w_v, w_o", N, C, C),
        ("w_1", N, C, 4 * C),
        ("w_2", N, 4 * C, C),
        ("tied head (a chunk)", R, C, V),
    ]
    rng = np.random.default_rng(0)

    def rate(f: Callable[[], object], flops: int) -> float:
        f()
        ts = []
        for _ in range(reps):
            t0 = time.thread_time()
            f()
            ts.append(time.thread_time() - t0)
        return flops / statistics.median(ts) / 1e9

    lines = ["| site | rows x in -> out | GEMM | NumPy GFLOP/s | torch GFLOP/s |", "|---|---|---|---|---|"]
    for name, n, k, o in sites:
        x, dy, w = (rng.standard_normal(shape).astype(np.float32) for shape in ((n, k), (n, o), (k, o)))
        if name.startswith("tied"):  # the head's weight is wte (V, C): the engine's own three products
            gemm = {
                "y = x @ wte.T": lambda x, dy, w: x @ w.T,
                "dx = dz @ wte": lambda x, dy, w: dy @ w,
                "dwte = dz.T @ x": lambda x, dy, w: dy.T @ x,
            }
            w = np.ascontiguousarray(w.T)
        else:
            gemm = {
                "y = x @ w": lambda x, dy, w: x @ w,
                "dx = dy @ w.T": lambda x, dy, w: dy @ w.T,
                "dw = x.T @ dy": lambda x, dy, w: x.T @ dy,
            }
        t = [torch.from_numpy(a) for a in (x, dy, w)]
        for what, f in gemm.items():
            flops = 2 * n * k * o
            lines.append(
                f"| {name} | {n} x {k} -> {o} | {what} | {rate(lambda: f(x, dy, w), flops):.0f} | "
                f"{rate(lambda: f(*t), flops):.0f} |"
            )
    a = np.ones(16 << 20, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    t0 = time.perf_counter()
    for _ in range(5):
        np.copyto(b, a)
    bandwidth = 5 * 2 * a.nbytes / (time.perf_counter() - t0) / 1e9
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    lines += ["", f"threads {threads}; np.copyto of 64 MiB: {bandwidth:.1f} GB/s (read and write)"]
    return "\n".join(lines)


def cpu_name() -> str:
    return next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")


def run_all(args: argparse.Namespace) -> None:
    """Every config once a round, in the same order; then the table. With --src, the NumPy rows once for each
    tree, labelled by its folder's name (before and after a change in one run)."""
    configs = {
        (n, impl if not src else f"{impl} ({Path(src).resolve().name})"): (impl, src)
        for n in args.threads
        for impl in args.impls
        for src in (args.src if impl == "microgpt-numpy" else [""])
    }
    runs: dict[tuple[int, str], list[dict]] = {key: [] for key in configs}
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        for (n, label), rs in runs.items():
            impl, src = configs[(n, label)]
            rs.append(run_config(impl, n, src, args))
            print(json.dumps(rs[-1]), file=sys.stderr, flush=True)
    print(table(runs, (load0, os.getloadavg()[0])))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impl", choices=IMPLS, help="one config in this process: one JSON line")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=IMPLS)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--src", nargs="+", default=[""], help="microgpt source trees to time (default: this one)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--profile", action="store_true", help="the NumPy step's time op by op, in this process")
    p.add_argument("--gemms", action="store_true", help="the model's GEMMs on NumPy's BLAS and torch's, GFLOP/s")
    args = p.parse_args()
    if args.profile:
        print(profile(args.warmup, args.steps))
    elif args.gemms:
        print(gemms())
    elif args.impl:
        print(json.dumps(run_one(args.impl, args.warmup, args.steps)))
    else:
        run_all(args)


if __name__ == "__main__":
    main()
