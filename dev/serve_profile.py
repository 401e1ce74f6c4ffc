"""Where `microgpt serve` spends host time per token: the real scheduler and HTTP path in this process, on a model
whose decode step costs almost nothing (bench/decode.py's tiny-wide: ANDREA-120M's 50,304-id vocabulary on a
width of 8, NumPy backend, fp32), so that what is left is the host's work per token.

    python dev/serve_profile.py                       # 1 stream, then 8 at once, 256 greedy tokens each
    python dev/serve_profile.py --temperature 1       # the sampling path
    python dev/serve_profile.py --streams 4 --repeats 3

The server is serve.build's (the routes, the scheduler, the bounded HTTP transport) with timers wrapped around the
functions of the per-token path; the clients are bench/serve.py's streamed /v1/completions, in a subprocess so that
their parsing does not share the server's GIL. Each phase reports, per token (one row of one pass):

    wall_us    the decode thread's wall time in each timed function (the decode step: the model; on the GPU its graph
               replay and the wait for it), summed over the phase and divided by the tokens
    cpu_us     the calling thread's CPU time in each (time.thread_time: a wait for the GIL is not counted)
    threads    each thread group's CPU time over the phase per token (/proc/self/task/*/schedstat): the decode
               thread, the HTTP event loop, the transport's pool of workers, and the native threads (BLAS)
    tokens_per_s  the phase's completion tokens over its wall time, as bench/serve.py counts them

A function absent from this tree is skipped, so the same script measures the tree before and after a change. Nested
timers (the decode pass holds the others) are not subtracted: "pass" is the whole of one decode pass over its rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

# one thread for NumPy's BLAS and the backend's row passes (before NumPy loads): on a machine of few cores, threads
# of a step this small only contend with the server's own
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.decode import SHAPES, random_checkpoint  # noqa: E402
from bench.serve import stream, together, tokenizer_record  # noqa: E402
from microgpt.engine import infer  # noqa: E402
from microgpt.use import chat, oai, sample, scheduler, serve  # noqa: E402

# (module or class, attribute, label): the per-token path, where each exists in this tree
TARGETS = [
    (scheduler.Scheduler, "_decode", "pass"),
    (infer.InferState, "decode", "step"),
    (infer.InferState, "run", "prefill"),
    (sample.Generator, "run", "gen.run"),
    (sample.Generator, "decode", "gen.decode"),
    (sample.Generator, "greedy", "gen.greedy"),
    (sample.Generator, "logits", "gen.logits"),
    (scheduler, "pick", "pick"),
    (chat.Stream, "push", "Stream.push"),
    (scheduler.Job, "send", "Job.send"),
    (serve, "sse", "sse encode"),
    (oai, "sse", "sse encode"),
    (oai.Reply, "text_chunk", "sse encode"),
]


class Timers:
    """Wall and thread-CPU seconds and calls per label, from wrappers put around TARGETS."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.rows = 0  # rows decoded (tokens drawn by decode passes)

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()
        self.rows = 0

    def install(self) -> None:
        wrapped: set[int] = set()
        for owner, name, label in TARGETS:
            raw = vars(owner).get(name)
            if raw is None or id(raw) in wrapped:
                continue
            fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
            wrapper = self._wrap(fn, label, name == "_decode")
            wrapped.add(id(wrapper))
            setattr(owner, name, type(raw)(wrapper) if isinstance(raw, (staticmethod, classmethod)) else wrapper)

    def _wrap(self, fn: Any, label: str, count_rows: bool) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            if count_rows:
                self.rows += len(a[0].active)
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.wall[label] += time.perf_counter() - w
                self.cpu[label] += time.thread_time() - c
                self.calls[label] += 1

        return timed


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread group of this process so far (schedstat's first field: ns on a CPU)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = defaultdict(float)
    for tid in os.listdir("/proc/self/task"):
        try:
            ns = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        name = names.get(int(tid), "native (BLAS)")
        group = "http workers" if name.startswith("microgpt-serve") else name
        out[group] += ns / 1e9
    return out


def bodies(model: str, n: int, tokens: int, temperature: float, first: int) -> list[dict[str, Any]]:
    return [{"model": model, "prompt": f"def request_{k}(self, data):", "max_tokens": tokens, "seed": k,
             "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
            for k in range(first, first + n)]  # fmt: skip


def client(argv: list[str]) -> int:
    """The clients' side (a subprocess): PORT, then the bodies as JSON; one JSON line of tokens and seconds."""
    port, reqs = int(argv[0]), json.loads(argv[1])
    t0 = time.perf_counter()
    runs = together(port, reqs, 300) if len(reqs) > 1 else [stream(port, reqs[0], 300)]
    print(json.dumps({"tokens": sum(r.tokens for r in runs), "wall_s": time.perf_counter() - t0}))
    return 0


def phase(port: int, reqs: list[dict[str, Any]], timers: Timers) -> dict[str, Any]:
    """One batch of requests from the client subprocess; what the server spent on it, per token."""
    cmd = [sys.executable, __file__, "--client", str(port), json.dumps(reqs)]
    timers.reset()
    before = thread_cpu()
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    after = thread_cpu()
    got = json.loads(res.stdout)
    n = got["tokens"]
    per = 1e6 / n
    return {
        "tokens": n, "rows_decoded": timers.rows, "tokens_per_s": n / got["wall_s"],
        "wall_us": {k: round(v * per, 1) for k, v in sorted(timers.wall.items())},
        "cpu_us": {k: round(v * per, 1) for k, v in sorted(timers.cpu.items())},
        "calls_per_token": {k: round(v / n, 2) for k, v in sorted(timers.calls.items())},
        "threads_cpu_us": {k: round((after[k] - before.get(k, 0.0)) * per, 1) for k in sorted(after)},
    }  # fmt: skip


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over repeats."""
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        if isinstance(value, dict):
            out[key] = {k: round(statistics.median(r[key].get(k, 0.0) for r in rows), 1) for k in value}
        else:
            out[key] = round(statistics.median(r[key] for r in rows), 1)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=SHAPES, default="tiny-wide")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3, help="each phase this many times; the medians are reported")
    return p


def main(argv: list[str]) -> int:
    if argv[:1] == ["--client"]:
        return client(argv[1:])
    args = parser().parse_args(argv)
    timers = Timers()
    timers.install()
    with tempfile.TemporaryDirectory() as tmp:
        tok = tokenizer_record(SHAPES[args.shape].vocab_size, Path(tmp))
        ckpt = random_checkpoint(args.shape, Path(tmp), tok)[2]
        flags = [str(ckpt), "--port", "0", "--max-batch", str(args.streams), "--queue", str(args.streams),
                 "--backend", "numpy", "--precision", "fp32"]  # fmt: skip
        api, server = serve.build(serve.parser().parse_args(flags))
        thread = threading.Thread(target=server.serve_forever, name="http loop", daemon=True)
        thread.start()
        api.scheduler.thread.name = "decode thread"
        api.scheduler.start()
        try:
            phase(server.port, bodies(api.name, args.streams, 32, args.temperature, 0), timers)  # warm-up
            report = {}
            for name, n in (("alone", 1), ("together", args.streams)):
                runs = [phase(server.port, bodies(api.name, n, args.tokens, args.temperature, 0), timers)
                        for _ in range(args.repeats)]  # fmt: skip
                report[name] = summarize(runs)
        finally:
            api.scheduler.stop()
            server.shutdown()
            thread.join(timeout=10)
            server.close()
    head = {"shape": args.shape, "streams": args.streams, "tokens": args.tokens, "temperature": args.temperature,
            "repeats": args.repeats}  # fmt: skip
    for name, row in report.items():
        print(json.dumps({**head, "phase": name, **row}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
