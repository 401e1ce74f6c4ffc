"""Serving throughput: `microgpt serve` answering N concurrent streamed completions, against each request alone.

    python3 bench/serve.py                          # GPU: ANDREA-120M, bf16, 8 streams, --max-batch 8, 256 tokens
    python3 bench/serve.py --checkpoint RUN_OR_BIN  # a trained model instead of random weights
    python3 bench/serve.py --device cpu             # the smoke check: a tiny model on the NumPy backend

The server is the real one: `python -m microgpt serve CKPT --port 0 --max-batch B --queue N --backend --precision`
in a subprocess (triton bf16 on the GPU, numpy fp32 on the CPU), stopped with SIGTERM when the bench ends, fails or
is terminated; where it does not come up, its log's tail is printed. The client is the standard library's
http.client, one thread per stream, reading the server-sent events as they arrive (the GPU machine has no openai
package). Each request is POST /v1/completions with stream, stream_options.include_usage, max_tokens --tokens,
--temperature (default 0: greedy) and a seed, for a prompt of its own.

Weights: a checkpoint's, or bench/decode.py's random ones (the seeded init moved off it). A random checkpoint's
tokenizer: the byte tokenizer for a 256-id vocabulary (tiny); for a larger one a byte-level BPE of up to that many
entries trained on the running Python's standard library (the built-in corpus's text), since under the byte tokenizer
the 50,048 ids past the bytes decode to nothing, so almost no token would become an event and the HTTP side would
have nothing to do.

Order: a warm-up (N streams joining one at a time, each once the one before has had its first event, and long enough
to last until the last joins, so that the batch grows through every size from 1 to N and each size's decode step is
prepared before anything is timed: on a GPU tuned and its CUDA graph captured), then each stream's request alone (the
baseline), then all N at once (the measurement). A random model may draw the end of document early; a stream whose
request alone ends before --tokens takes the next prompt instead, up to --tries prompts, and a stream that still
ends early is listed in "ended_early" with its finish reason. Tokens are counted from each stream's usage chunk
(every token drawn, the stop token included), never from its events (a token may decode to no text).

One JSON line: the streams' completion tokens and their total; wall seconds from the first request sent to the last
stream's end, and the total over it (tokens_per_s); each stream's tokens over its own time from sent to end
(stream_tokens_per_s: median, min); time to first token, to the first event that carries a choice (ttft_s: median,
max); the same for each request alone (alone), the gain of batching (tokens_per_s over alone's median), how many
streams' text equals their text alone (same_as_alone: rows are independent, so all where no near-tie rounds the
other way), the prompts, seeds and texts, and the server's exit status (0: it stopped cleanly).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.decode import SHAPES, random_checkpoint  # noqa: E402
from microgpt.data.corpus import stdlib_files  # noqa: E402
from microgpt.data.tokenizer import SPECIAL_TOKENS, ByteTokenizer, train_bpe  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


class BenchError(Exception):
    """The server did not come up, or a request failed: one line, the bench exits 1."""


@dataclass
class Run:
    """One streamed completion as the client saw it; times are time.perf_counter()."""

    prompt: str
    seed: int
    sent: float
    first: float | None = None  # the first event carrying a choice
    end: float = 0.0
    text: str = ""
    finish: str | None = None
    usage: dict[str, int] | None = None
    done: bool = False  # data: [DONE] came

    def event(self, data: bytes, now: float) -> bool:
        """Take one event's data; False at [DONE]."""
        if data == b"[DONE]":
            self.done = True
            return False
        obj = json.loads(data)
        if "error" in obj:
            raise BenchError(f"a stream ended with the server's error: {obj['error'].get('message')}")
        for choice in obj["choices"]:
            self.first = self.first or now
            self.text += choice["text"]
            self.finish = choice["finish_reason"] or self.finish
        self.usage = obj.get("usage") or self.usage
        return True

    @property
    def tokens(self) -> int:
        return self.usage["completion_tokens"]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.end - self.sent)


def stream(port: int, body: dict[str, Any], timeout: float, answered: threading.Event | None = None) -> Run:
    """One streamed completion, read event by event as the server sends them; `answered` is set at its first."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        run = Run(body["prompt"], body["seed"], time.perf_counter())
        conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        res = conn.getresponse()
        if res.status != 200:
            raise BenchError(f"POST /v1/completions: HTTP {res.status} {res.read(400).decode(errors='replace')}")
        for line in res:  # close-delimited HTTP/1.0 body: lines as they arrive
            if line.startswith(b"data: ") and not run.event(line[6:].strip(), time.perf_counter()):
                break
            if run.first and answered:
                answered.set()
        run.end = time.perf_counter()
    finally:
        conn.close()
    if not (run.done and run.usage and run.finish and run.first):
        raise BenchError(f"a stream ended without its finish reason, usage or [DONE]: {run}"[:500])
    return run


def together(port: int, bodies: list[dict[str, Any]], timeout: float, ramp: bool = False) -> list[Run]:
    """Every body streamed at once, a thread each, released together; with ramp, each once the one before it has had
    its first event (so the batch grows one row at a time). Their runs in order."""
    runs: list[Run | Exception | None] = [None] * len(bodies)
    start, answered = threading.Barrier(len(bodies)), [threading.Event() for _ in bodies]

    def one(i: int) -> None:
        start.wait()
        if ramp and i:
            answered[i - 1].wait()
        try:
            runs[i] = stream(port, bodies[i], timeout, answered[i])
        except Exception as e:  # raised in the main thread below
            runs[i] = e
        finally:
            answered[i].set()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in runs:
        if isinstance(r, Exception):
            raise r
    return runs


class Terminate:
    """SIGTERM (what `timeout` sends) as SystemExit(143), so that the finally blocks stop serve; held off while serve
    is being started, until its process is in hand (a signal inside Popen would leave it running without an owner)."""

    def __init__(self) -> None:
        self.holding = self.pending = False
        signal.signal(signal.SIGTERM, self.on_signal)

    def on_signal(self, *_: Any) -> None:
        if self.holding:
            self.pending = True
        else:
            sys.exit(143)

    @contextmanager
    def held(self) -> Iterator[None]:
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
            if self.pending:
                sys.exit(143)


@dataclass
class Server:
    """`microgpt serve` in a subprocess, its output in log; port and model once it answers."""

    log: Path
    proc: subprocess.Popen | None = None
    port: int = 0
    model: str = ""

    def wait_ready(self, timeout: float) -> None:
        """Until GET /v1/models answers (the port from the URL serve prints); BenchError if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"serve exited with status {self.proc.returncode} before answering")
            url = re.search(rb"serve: http://\S+:(\d+)/v1", self.log.read_bytes())
            if url:
                self.port = int(url.group(1))
                conn = http.client.HTTPConnection(HOST, self.port, timeout=30)
                try:
                    conn.request("GET", "/v1/models")
                    res = conn.getresponse()
                    if res.status == 200:
                        self.model = json.load(res)["data"][0]["id"]
                        return
                finally:
                    conn.close()
            time.sleep(0.2)
        raise BenchError(f"serve did not answer GET /v1/models within {timeout:g} s")

    def stop(self) -> None:
        """SIGTERM (serve stops its decode loop and exits 0), then SIGKILL after 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def served(ckpt: Path, args: argparse.Namespace, log: Path, term: Terminate) -> Iterator[Server]:
    """serve on a free port of 127.0.0.1 with the bench's batch, queue, backend and precision, until the block ends."""
    cmd = [sys.executable, "-m", "microgpt", "serve", str(ckpt), "--port", "0", "--max-batch", str(args.max_batch),
           "--queue", str(args.streams), "--backend", args.backend, "--precision", args.precision]  # fmt: skip
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    server = Server(log)
    try:
        with term.held(), open(log, "wb") as out:
            server.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        server.wait_ready(args.start_timeout)
        yield server
    finally:
        server.stop()


def tokenizer_record(vocab_size: int, folder: Path) -> dict[str, Any]:
    """A random checkpoint's tokenizer (the module docstring): bytes for 256 ids, else a BPE saved in folder."""
    if vocab_size <= 256 + len(SPECIAL_TOKENS):
        return ByteTokenizer().describe()
    tok = train_bpe([p.read_text("utf-8", errors="replace") for p in stdlib_files()], vocab_size)
    tok.save(folder / "tokenizer.json")
    return {"kind": "bpe", "path": str(tok.path.resolve()), "sha256": tok.sha256, "vocab_size": tok.vocab_size}


def prompt(k: int) -> str:
    return f"def request_{k}(self, data):"


def body(model: str, k: int, max_tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    """Prompt k's request, seeded with k so that its draws are the same alone and together."""
    return {"model": model, "prompt": prompt(k), "max_tokens": max_tokens, "temperature": args.temperature,
            "seed": k, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip


def alone(server: Server, args: argparse.Namespace) -> tuple[list[int], list[Run], int]:
    """Each stream's request alone: its prompt (the first of up to --tries that runs to --tokens), the run, and how
    many prompts were tried in all."""
    keys, runs, k = [], [], 0
    for _ in range(args.streams):
        for _try in range(args.tries):
            run = stream(server.port, body(server.model, k, args.tokens, args), args.timeout)
            k += 1
            if run.tokens == args.tokens:
                break
        keys.append(k - 1)
        runs.append(run)
    return keys, runs, k


def measure(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up, each request alone, then all together (the module docstring); the row's measured fields."""
    t0 = time.perf_counter()
    warm = [body(server.model, i, min(args.tokens, 16 * args.streams), args) for i in range(args.streams)]
    together(server.port, warm, args.timeout, ramp=True)
    warmup_s = time.perf_counter() - t0
    keys, solo, tried = alone(server, args)
    runs = together(server.port, [body(server.model, k, args.tokens, args) for k in keys], args.timeout)
    return {**summary(runs, solo, args.tokens), "prompts_tried": tried, "warmup_s": warmup_s}


def summary(runs: list[Run], solo: list[Run], max_tokens: int) -> dict[str, Any]:
    """The row's rates from the runs together and the same requests' runs alone."""
    wall = max(r.end for r in runs) - min(r.sent for r in runs)
    total = sum(r.tokens for r in runs)
    rates, ttft = [r.tokens_per_s for r in runs], [r.first - r.sent for r in runs]
    alone_rate = statistics.median(r.tokens_per_s for r in solo)
    early = [{"stream": i, "tokens": r.tokens, "finish_reason": r.finish} for i, r in enumerate(runs)
             if r.tokens < max_tokens]  # fmt: skip
    return {
        "completion_tokens": [r.tokens for r in runs], "total_tokens": total,
        "prompt_tokens": [r.usage["prompt_tokens"] for r in runs], "finish_reasons": [r.finish for r in runs],
        "ended_early": early,
        "wall_s": wall, "tokens_per_s": total / wall,
        "stream_tokens_per_s": {"median": statistics.median(rates), "min": min(rates)},
        "ttft_s": {"median": statistics.median(ttft), "max": max(ttft)},
        "alone": {"tokens_per_s": alone_rate, "ttft_s": statistics.median(r.first - r.sent for r in solo),
                  "completion_tokens": [r.tokens for r in solo]},
        "batching_gain": total / wall / alone_rate,
        "same_as_alone": sum(r.text == s.text for r, s in zip(runs, solo)),
        "prompts": [r.prompt for r in runs], "seeds": [r.seed for r in runs], "texts": [r.text for r in runs],
    }  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=SHAPES, help="random weights of this shape (default: andrea-120m on cuda, tiny)")
    p.add_argument("--checkpoint", help="a step-*.bin or run folder to serve instead (default: random weights)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streamed requests")
    p.add_argument("--max-batch", type=int, help="serve's --max-batch (default: --streams)")
    p.add_argument("--tokens", type=int, help="max_tokens of each request (default: 256 on cuda, 16 on cpu)")
    p.add_argument("--temperature", type=float, default=0.0, help="each request's temperature (0: greedy)")
    p.add_argument("--precision", help="serve's --precision (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--tries", type=int, default=3, help="prompts a stream tries for one that runs to --tokens")
    p.add_argument("--start-timeout", type=float, default=300, help="seconds for serve to answer")
    p.add_argument("--timeout", type=float, default=300, help="seconds a request may wait for its next event")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    gpu = args.device == "cuda"
    args.shape = args.shape or ("andrea-120m" if gpu else "tiny")
    args.max_batch, args.tokens = args.max_batch or args.streams, args.tokens or (256 if gpu else 16)
    args.backend, args.precision = "triton" if gpu else "numpy", args.precision or ("bf16" if gpu else "fp32")
    term = Terminate()
    with tempfile.TemporaryDirectory() as tmp:
        tok = None
        if args.checkpoint:
            ckpt = Path(args.checkpoint).resolve()  # serve runs in the repository
        else:
            tok = tokenizer_record(SHAPES[args.shape].vocab_size, Path(tmp))
            ckpt = random_checkpoint(args.shape, Path(tmp), tok)[2]
        log = Path(tmp) / "serve.log"
        try:
            with served(ckpt, args, log, term) as server:
                row = measure(server, args)
        except (BenchError, OSError) as e:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            print(f"error: {e}\n--- the last lines serve wrote:\n{tail}", file=sys.stderr)
            return 1
    head = {"streams": args.streams, "max_batch": args.max_batch, "backend": args.backend, "precision": args.precision,
            "model": server.model, "shape": None if args.checkpoint else args.shape,
            "tokenizer": tok and {k: tok[k] for k in ("kind", "vocab_size")}, "max_tokens": args.tokens,
            "temperature": args.temperature, "server_rc": server.proc.returncode}  # fmt: skip
    print(json.dumps(head | row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
