"""Where `microgpt serve` spends host time per token, and what the host costs a GPU's decode step: the real server (a
subprocess, as users run it) on a tiny model (bench/decode.py's tiny-host: d_model 8, one layer, a 2,048-entry
byte-level BPE, NumPy backend, one BLAS thread) whose decode step is emulated as a GPU's: it computes nothing on the
CPU (every row draws one token of text, TOKEN) and takes --step-ms plus --row-us a row from its launch (default 2 ms
and none, about ANDREA-120M's decode step at batch 64 on an H200; `--step-ms 0.42 --row-us 2.7` is its step on one
H100, 0.42 ms at 1 row to 1.11 ms at 256, issue 56), the host free meanwhile. Where the server launches a step and
reads its tokens later (InferState.launch_decode), that read waits until the step's time has passed since its launch
(or since the step before it ended). The patch goes into both processes through a sitecustomize.py on the server's
PYTHONPATH.

    python dev/serve_profile.py                       # 1 stream, then 8 and 64 at once, 256 greedy tokens each
    python dev/serve_profile.py --streams 8 --step-ms 0   # no emulated GPU: the host's own work alone
    python dev/serve_profile.py --temperature 1       # the sampling path
    python dev/serve_profile.py --streams 8 64 256 --step-ms 0.42 --row-us 2.7   # one H100's step, 1 to 256 streams

The server is started as bench/serve.py starts it (`served`), and the clients are its (bench/serve_client.py's
`fleet`: streamed /v1/completions, a thread each, 16 streams a client process, released at one instant). Each phase
reports:

    tokens_per_s  the phase's completion tokens over its wall time, as bench/serve.py counts them
    of_step       tokens_per_s over the emulated step's own rate (streams / (--step-ms + --row-us x streams)): the
                  issue's ratio
    ttft_ms       time to the first event with text, median and p99 (bench/serve.py's)
    cpu_us        per token, CPU time of each of the server's processes (/proc/PID/task/*/schedstat) and of its
                  busiest thread: `front` the HTTP side (its event loop the busiest), `engine` the engine process
                  (scheduler.py; its loop), `total` both
    engine_us     per token, the engine's own wall clock of its loop's phases (GET /stats): the host's work
                  (commands, admit, prefill, launch, finish, send; `host` their sum) and the model's (`model`: the
                  decode step's launch, on the CPU the whole step; `wait`: blocked on a step's result)

It measures any tree that has bench/serve_client.py (f265629 on). The one-process server before the engine had its
own (1035dac) was measured with this file as of 36fdb20 (`git show 36fdb20:dev/serve_profile.py`), which emulates the
step there too. docs/SERVE.md has what the numbers decided, and why.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.decode import SHAPES, random_checkpoint  # noqa: E402
from bench.serve import Server, Terminate, get, served, tokenizer_record  # noqa: E402
from bench.serve_client import fleet, threads  # noqa: E402


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of process pid so far (schedstat's first field: ns on a CPU), by thread id."""
    out: dict[int, float] = {}
    root = Path(f"/proc/{pid}/task")
    for task in root.iterdir() if root.exists() else []:
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return out


SITECUSTOMIZE = """
import os, time
STEP_S = float(os.environ.get("SERVE_PROFILE_STEP_S") or 0)
ROW_S = float(os.environ.get("SERVE_PROFILE_ROW_S") or 0)
if STEP_S or ROW_S:
    from microgpt.engine import infer

    def no_model(self, b):  # the GPU's work: none of it on this CPU; every row draws TOKEN
        self.arena["next_ids"][:b] = TOKEN

    infer.InferState._decode = no_model
    launch, busy = infer.InferState.launch_decode, [0.0]

    def launch_decode(self, b):  # launched now, its tokens read later: the GPU's time passes
        start = max(time.perf_counter(), busy[0])  # the emulated GPU's: after the step before it
        wait = launch(self, b)
        busy[0] = done = start + STEP_S + ROW_S * b

        def waited():
            left = done - time.perf_counter()  # read once: a second read may pass done
            if left > 0:
                time.sleep(left)
            return wait()

        return waited

    infer.InferState.launch_decode = launch_decode
"""
TOKEN = 300  # what every decode step draws under the emulation (a token of text, not the end of document)


def bodies(model: str, n: int, tokens: int, temperature: float) -> list[dict[str, Any]]:
    return [
        {
            "model": model,
            "prompt": f"def request_{k}(self, data):",
            "max_tokens": tokens,
            "seed": k,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for k in range(n)
    ]


class Profiled:
    """A started serve (bench/serve.py's Server) and the pids of its processes: the HTTP side's and the engine's."""

    def __init__(self, server: Server) -> None:
        self.port, self.model = server.port, server.model
        self.pids = {"front": server.proc.pid, "engine": get(self.port, "/stats")["engine_pid"]}

    def cpu(self) -> dict[str, dict[str, float]]:
        return {name: thread_cpu(pid) for name, pid in self.pids.items()}

    def engine_counts(self) -> dict[str, float]:
        return get(self.port, "/stats")["engine"]


def phase(server: Profiled, reqs: list[dict[str, Any]], step_s: float) -> dict[str, Any]:
    """One batch of streamed requests (step_s: the emulated step at their batch); what the server's processes spent
    on it, per token."""
    before, counts0 = server.cpu(), server.engine_counts()
    runs = fleet(server.port, list(enumerate(reqs)), timeout=300)
    n = sum(run.tokens for run in runs)
    wall = max(r.end for r in runs) - min(r.sent for r in runs)
    ttft = sorted(1e3 * (r.events[0] - r.sent) for r in runs if r.events)
    after, counts1 = server.cpu(), server.engine_counts()
    per = 1e6 / n
    cpu: dict[str, float] = {}
    for proc in after:  # each process, and its busiest thread (the event loop; the engine's loop)
        spent = [v - before[proc].get(tid, 0.0) for tid, v in after[proc].items()]
        cpu[proc], cpu[proc + " busiest thread"] = round(sum(spent) * per, 1), round(max(spent) * per, 1)
    sums = {proc: cpu[proc] for proc in after}
    engine = {
        k.removesuffix("_s"): round((counts1[k] - counts0.get(k, 0.0)) * per, 1) for k in counts1 if k.endswith("_s")
    }
    engine["host"] = round(sum(v for k, v in engine.items() if k not in ("model", "wait")), 1)
    of_step = {"of_step": round(n / wall * step_s / len(reqs), 3)} if step_s else {}
    return {
        "tokens": n,
        "tokens_per_s": round(n / wall, 1),
        **of_step,
        "ttft_ms": {"median": round(statistics.median(ttft), 1), "p99": round(ttft[int(0.99 * (len(ttft) - 1))], 1)},
        "cpu_us": cpu | {"total": round(sum(sums.values()), 1)},
        "engine_us": engine,
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over repeats."""
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        if isinstance(value, dict):
            out[key] = {k: round(statistics.median(r[key].get(k, 0.0) for r in rows), 1) for k in value}
        else:
            out[key] = round(statistics.median(r[key] for r in rows), 3 if key == "of_step" else 1)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[8, 64], help="concurrent streams of each phase after 1")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--step-ms", type=float, default=2.0, help="the emulated GPU time of a decode step (0: none)")
    p.add_argument("--row-us", type=float, default=0.0, help="and this much more a row of the step")
    p.add_argument("--repeats", type=int, default=3, help="each phase this many times; the medians are reported")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    step_s, row_s = args.step_ms / 1e3, args.row_us / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tok = tokenizer_record(SHAPES["tiny-host"].vocab_size, folder)
        ckpt = random_checkpoint("tiny-host", folder, tok)[2]
        (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.replace("TOKEN", str(TOKEN)))
        env = {
            "PYTHONPATH": f"{folder}{os.pathsep}{REPO}",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "SERVE_PROFILE_STEP_S": str(step_s),
            "SERVE_PROFILE_ROW_S": str(row_s),
        }
        opts = argparse.Namespace(max_batch=max(args.streams), backend="numpy", precision="fp32", start_timeout=300)
        log = folder / "serve.log"
        try:
            with served(ckpt, opts, log, Terminate(), env=env) as started:
                server = Profiled(started)
                top = max(args.streams)  # warm-up: streams joining one at a time up to the largest (bench/serve.py's)
                threads(server.port, list(enumerate(bodies(server.model, top, 16, args.temperature))), 300, ramp=True)
                report = {}
                for n in (1, *args.streams):
                    rows = [
                        phase(server, bodies(server.model, n, args.tokens, args.temperature), step_s + row_s * n)
                        for _ in range(args.repeats)
                    ]
                    report[n] = summarize(rows)
        except Exception:
            if log.is_file():
                print(f"the server's log:\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise
    head = {
        "tokens": args.tokens,
        "temperature": args.temperature,
        "step_ms": args.step_ms,
        "row_us": args.row_us,
        "repeats": args.repeats,
        "processes": sorted(server.pids),
    }
    for n, row in report.items():
        print(json.dumps({**head, "streams": n, **row}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
