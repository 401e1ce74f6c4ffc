"""Serving throughput and latency: `microgpt serve` under 1 to 256 concurrent streams, against the engine's own decode
step at the same batch, in one run; and a chat workload with prefix reuse on and off.

    python3 bench/serve.py                          # GPU: ANDREA-120M, bf16; 1, 8, 64, 256 streams; short and
                                                    # 512-token prompts; 256 tokens each; then the chat workload
    python3 bench/serve.py --checkpoint RUN_OR_BIN  # a trained model instead of random weights
    python3 bench/serve.py --device cpu             # the smoke check: a tiny model on the NumPy backend
    python3 bench/serve.py --locust "python3 -m locust"   # then locust at the same streams (bench/serve_locust.py)
    python3 bench/serve.py --guidellm guidellm      # then guidellm at the same streams and prompt lengths
                                                    # (bench/serve_guidellm.py)

Order: the decode step alone first, for each (batch, prompt length) of the sweep (bench/decode.py's run_microgpt: a
plan of that many rows, the prompt prefilled, then --tokens steps replayed as one CUDA graph, greedy on the device);
then the server, the real one (`python -m microgpt serve CKPT --port 0 --max-batch MAX --queue MAX --backend
--precision`, a subprocess, stopped with SIGTERM when the bench ends, fails or is terminated; where it does not come up,
its log's tail is printed; serve's engine prepares every decode size's step before it is ready: on a GPU tuned and its
graph captured), warmed up by streams joining one at a time (the first prefills and requests on a GPU); then each prompt
kind's first 8 prompts alone (the reference for same_as_alone); then each (prompt kind, streams) row: all streams sent
at once. Then, where asked, the outside clients against the same server: --locust (bench/serve_locust.py: short
prompts) and --guidellm (bench/serve_guidellm.py: each prompt kind's length, in tokens of the checkpoint's tokenizer),
each row beside the decode step alone at its batch.

Requests: POST /v1/completions, streamed, greedy (--temperature 0), max_tokens --tokens, ignore_eos (a random model
would end some streams early), a prompt of its own per stream: "short" is a line of code as text (about 10 tokens),
a number N is N token ids of the standard library's text (BPE). Clients run in several processes (bench/serve_client.py:
16 streams each, released at one instant), so that reading 256 streams does not bound what is measured; times are
time.perf_counter, one clock for every process of the machine. Every wait is bounded (serve's start by
--start-timeout, a request's next event by --timeout, a client process by twice that: bench/serve_client.py), and one
that runs out ends the bench with one error line that names what it waited for (and serve's last lines), not a hang.

One JSON line per row on stdout, then the table as markdown: streams, prompt tokens, completion tokens/s over the wall
from the first request to the last stream's end, time to first token (the first event with text) median and p99,
inter-token latency p99 (the gaps between a stream's events; an event carries every token since the last, so a client
that reads slowly sees fewer, longer ones; tokens_per_event says how many), the decode step's own tokens/s at that batch
and the ratio of the two, the decode steps the engine prepared while the row ran (prepared_in_row: 0, or what was timed
held a warm-up and a graph capture) and its padded rows, the engine loop's milliseconds by phase while it ran
(engine_ms, from GET /stats; in the table the host's phases a decode step, and prefill's with its windows), and
same_as_alone (streams 0..7 whose text equals that prompt's alone: rows are independent, so all of them but where a
near-tie rounds the other way at another batch size). The chat rows: --chat conversations at once, each a shared
system prompt (--system tokens) and --turns user turns, each turn sent with the whole history once the last reply is
in; TTFT of the turns after the first, and the engine's reused prompt tokens (GET /stats), with prefix reuse on and,
a second server, off.

Weights: a checkpoint's, or bench/decode.py's random ones (the seeded init moved off it). A random checkpoint's
tokenizer: the byte tokenizer for a 256-id vocabulary (tiny); for a larger one a byte-level BPE of up to that many
entries trained on the running Python's standard library (the built-in corpus's text).
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.decode import SHAPES, backend, random_checkpoint, run_microgpt  # noqa: E402
from bench.serve_client import CLIENTS_PER_PROC, BenchError, Run, fleet, stream, threads  # noqa: E402
from bench.serve_guidellm import GuidellmError, write_tokenizer  # noqa: E402
from bench.serve_guidellm import run as run_guidellm  # noqa: E402
from microgpt.data.corpus import stdlib_files  # noqa: E402
from microgpt.data.tokenizer import SPECIAL_TOKENS, ByteTokenizer, load_tokenizer, train_bpe  # noqa: E402
from microgpt.engine.trained import load_trained  # noqa: E402
from microgpt.errors import InputError  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
ALONE = 8  # prompts of each kind run alone, the reference for same_as_alone


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
                self.model = get(self.port, "/v1/models")["data"][0]["id"]
                return
            time.sleep(0.2)
        raise BenchError(f"serve did not answer GET /v1/models within {timeout:g} s")

    def stop(self) -> None:
        """SIGTERM (serve stops its engine and exits 0), then SIGKILL after 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def get(port: int, path: str, timeout: float = 60) -> dict[str, Any]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        return json.load(conn.getresponse())
    except TimeoutError:
        raise BenchError(f"GET {path}: no answer within {timeout:g} s") from None
    finally:
        conn.close()


@contextmanager
def served(
    ckpt: Path, args: argparse.Namespace, log: Path, term: Terminate, *flags: str, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """serve on a free port of 127.0.0.1 with args' max_batch (its --max-batch and --queue), backend, precision and
    start_timeout, until the block ends; env: more of serve's environment (this one's, the repository on PYTHONPATH)."""
    batch = str(args.max_batch)
    cmd = [
        sys.executable,
        "-m",
        "microgpt",
        "serve",
        str(ckpt),
        "--port",
        "0",
        "--max-batch",
        batch,
        "--queue",
        batch,
        "--backend",
        args.backend,
        "--precision",
        args.precision,
        *flags,
    ]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PYTHONPATH": path} | (env or {})
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


class Prompts:
    """Prompt k of a kind: "short" a line of code as text, N the N token ids of the library's text at offset k."""

    def __init__(self, tok: Any) -> None:
        files = stdlib_files()
        self.text = np.array(tok.encode("".join(p.read_text("utf-8", errors="replace") for p in files[:60])))
        self.tok = tok

    def get(self, kind: str, k: int) -> str | list[int]:
        if kind == "short":
            return f"def request_{k}(self, data):"
        n = int(kind)
        start = (k * 997) % max(1, self.text.size - n)
        return self.text[start : start + n].tolist()

    def tokens(self, kind: str) -> int:
        """The prompt's length in tokens (a short one's, at k = 0)."""
        return len(self.tok.encode(self.get(kind, 0))) if kind == "short" else int(kind)


def body(model: str, max_tokens: int, args: argparse.Namespace, seed: int, **content: Any) -> dict:
    """A streamed request; content: its prompt= (/v1/completions) or messages= (/v1/chat/completions)."""
    return {
        "model": model,
        **content,
        "max_tokens": max_tokens,
        "temperature": args.temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def row_of(runs: list[Run], alone: dict[int, str]) -> dict[str, Any]:
    """A row's figures from its runs (the module docstring)."""
    wall = max(r.end for r in runs) - min(r.sent for r in runs)
    total = sum(r.tokens for r in runs)
    ttft = [r.events[0] - r.sent for r in runs if r.events]
    gaps = [b - a for r in runs for a, b in zip(r.events, r.events[1:])]
    same = [runs[k].text == alone[k] for k in range(min(len(runs), ALONE)) if k in alone]
    return {
        "completion_tokens": total,
        "wall_s": wall,
        "tokens_per_s": total / wall,
        "ttft_ms": {"median": 1e3 * statistics.median(ttft), "p99": 1e3 * pct(ttft, 99)},
        "itl_ms": {"median": 1e3 * pct(gaps, 50), "p99": 1e3 * pct(gaps, 99)},
        "tokens_per_event": total / max(1, sum(len(r.events) for r in runs)),
        "same_as_alone": f"{sum(same)}/{len(same)}",
        "finish_reasons": sorted({r.finish for r in runs}),
        "texts": [r.text for r in runs[:ALONE]],
    }


def decode_rates(args: argparse.Namespace, m: Any, w: np.ndarray, lengths: dict[str, int]) -> dict:
    """The engine's own decode step, tokens/s, at each (streams, prompt kind) of the sweep (bench/decode.py)."""
    K = backend(args)
    out = {}
    for kind, t in lengths.items():
        for b in args.streams:
            prompts = np.random.default_rng(b).integers(0, m.vocab_size, (b, t)).astype(np.int32)
            res = run_microgpt(K, m, w, prompts, args.tokens, args)
            out[b, kind] = res["decode_tokens_per_s"]
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return out


def warm_up(server: Server, args: argparse.Namespace, prompts: Prompts, top: int) -> None:
    """Streams joining one at a time up to `top` (a stream ends after 16 + top / 4 tokens, so the batch does not grow
    to `top`: the engine prepared every decode size at its start; /stats counts any prepared later)."""
    t0 = time.perf_counter()
    warm = [
        (k, body(server.model, min(args.tokens, 16 + top // 4), args, k, prompt=prompts.get("short", k)))
        for k in range(top)
    ]
    threads(server.port, warm, args.timeout, ramp=True)
    print(f"bench: warm-up to {top} streams in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def sweep(server: Server, args: argparse.Namespace, prompts: Prompts, step: dict) -> list[dict]:
    """Warm-up, each kind's prompts alone, then every row (the module docstring)."""
    warm_up(server, args, prompts, max(args.streams))
    rows = []
    for kind in args.prompts:
        alone = {
            k: stream(
                server.port,
                "/v1/completions",
                body(server.model, args.tokens, args, k, prompt=prompts.get(kind, k)),
                k,
                args.timeout,
            ).text
            for k in range(ALONE)
        }
        for n in args.streams:
            bodies = [(k, body(server.model, args.tokens, args, k, prompt=prompts.get(kind, k))) for k in range(n)]
            row = {"streams": n, "prompt": kind, "prompt_tokens": prompts.tokens(kind)}
            before = get(server.port, "/stats")["engine"]
            row |= row_of(fleet(server.port, bodies, args.timeout), alone)
            after = get(server.port, "/stats")["engine"]
            row["prepared_in_row"] = after["prepared"] - before["prepared"]  # decode steps prepared while timed
            row["padded_rows"] = after.get("padded_rows", 0) - before.get("padded_rows", 0)
            row["prefill_windows"] = after.get("prefill_windows", 0) - before.get("prefill_windows", 0)
            row["engine_steps"] = after.get("steps", 0) - before.get("steps", 0)
            row["engine_ms"] = {  # the engine loop's seconds by phase while the row ran (scheduler.py's counts)
                k.removesuffix("_s"): round(1e3 * (after[k] - before.get(k, 0.0)), 3) for k in after if k.endswith("_s")
            }
            row["decode_step_tokens_per_s"] = step.get((n, kind))
            row["of_decode_step"] = row["tokens_per_s"] / step[n, kind] if (n, kind) in step else None
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def locust_rows(server: Server, args: argparse.Namespace, prompts: Prompts, step: dict, folder: Path) -> list[dict]:
    """--locust: the locustfile (bench/serve_locust.py) against the same server at each --streams, for
    --locust-seconds after every user started, in as many client processes as 16 users a process ask; one row each,
    client "locust", beside the decode step alone at that batch (the short prompts': the locustfile's)."""
    rows = []
    for n in args.streams:
        out, procs = folder / f"locust-{n}.json", -(-n // CLIENTS_PER_PROC)
        cmd = [
            *shlex.split(args.locust),
            *("-f", str(REPO / "bench" / "serve_locust.py"), "--headless", "--only-summary", "--reset-stats"),
            *("-u", str(n), "-r", str(n), "-t", f"{args.locust_seconds:g}s", "--host", f"http://{HOST}:{server.port}"),
            *("--serve-model", server.model, "--serve-tokens", str(args.tokens), "--serve-out", str(out)),
            *(["--processes", str(procs)] if procs > 1 else []),
        ]
        try:
            res = subprocess.run(
                cmd, cwd=folder, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=args.locust_seconds + args.timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise BenchError(
                f"locust at {n} users did not end within {args.locust_seconds + args.timeout:g} s"
            ) from None
        if not out.is_file():
            raise BenchError(f"locust at {n} users wrote no summary (exit {res.returncode}): {res.stderr[-600:]}")
        row = {"client": "locust", "streams": n, "prompt": "short", "prompt_tokens": prompts.tokens("short")}
        row |= json.loads(out.read_text())
        row["decode_step_tokens_per_s"] = step.get((n, "short"))
        row["of_decode_step"] = row["tokens_per_s"] / step[n, "short"] if (n, "short") in step else None
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def guidellm_rows(
    server: Server, args: argparse.Namespace, prompts: Prompts, step: dict, folder: Path, tok: tuple[dict, Any]
) -> list[dict]:
    """--guidellm: guidellm (bench/serve_guidellm.py) against the same server, for each prompt kind at every --streams
    (one guidellm process a kind), --guidellm-seconds each, its prompts of that kind's length in tokens of the
    checkpoint's tokenizer (tok: its record and the ModelConfig, written as a Hugging Face folder for it); one row
    each, client "guidellm", beside the decode step alone at that batch and prompt length."""
    try:
        tokenizer = write_tokenizer(*tok, folder / "hf-tokenizer")
    except InputError as e:
        raise BenchError(f"guidellm needs the checkpoint's tokenizer as a Hugging Face folder: {e}") from None
    rows = []
    for kind in args.prompts:
        try:
            got = run_guidellm(
                args.guidellm, f"http://{HOST}:{server.port}", tokenizer, args.streams, prompts.tokens(kind),
                args.tokens, args.guidellm_seconds, args.timeout, folder,
            )  # fmt: skip
        except GuidellmError as e:
            raise BenchError(str(e)) from None
        for row in got:
            n = row["streams"]
            row = {"client": "guidellm", "streams": n, "prompt": kind, **row}
            row["decode_step_tokens_per_s"] = step.get((n, kind))
            row["of_decode_step"] = row["tokens_per_s"] / step[n, kind] if (n, kind) in step else None
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def chat(server: Server, args: argparse.Namespace, prompts: Prompts, tok: Any, reuse: bool) -> dict[str, Any]:
    """--chat conversations at once, --turns turns each over a shared system prompt; TTFT by turn, reused tokens."""
    system = tok.decode(prompts.get(str(args.system), 0))
    before = get(server.port, "/stats")["engine"]
    history = [[{"role": "system", "content": system}] for _ in range(args.chat)]
    ttft: list[list[float]] = []
    for turn in range(args.turns):
        for k, h in enumerate(history):
            h.append({"role": "user", "content": f"turn {turn}: what is request_{k}?"})
        bodies = [(k, body(server.model, args.chat_tokens, args, k, messages=h)) for k, h in enumerate(history)]
        runs = fleet(server.port, bodies, args.timeout, path="/v1/chat/completions")
        ttft.append([r.events[0] - r.sent for r in runs if r.events])
        for h, r in zip(history, runs):
            h.append({"role": "assistant", "content": r.text})
    after = get(server.port, "/stats")["engine"]
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("reused_tokens", "copied_tokens", "prefill_tokens")}
    return {
        "chat": args.chat,
        "turns": args.turns,
        "system_tokens": args.system,
        "prefix_reuse": reuse,
        "ttft_ms_first_turn": {"median": 1e3 * statistics.median(ttft[0]), "p99": 1e3 * pct(ttft[0], 99)},
        "ttft_ms_later_turns": {
            "median": 1e3 * statistics.median(sum(ttft[1:], [])),
            "p99": 1e3 * pct(sum(ttft[1:], []), 99),
        },
        **d,
        "reused_share": d["reused_tokens"] / max(1, d["reused_tokens"] + d["prefill_tokens"]),
    }


def outside_table(rows: list[dict], client: str) -> str:
    """An outside load generator's rows (locust's, guidellm's: the latter with its inter-token latency) as markdown."""
    itl = client == "guidellm"
    lines = [
        f"| {client} streams | prompt | tokens/s | TTFT median / p99 ms |{' ITL p99 ms |' * itl} streams done "
        "| failures | decode step tokens/s | ratio |",
        "|---|---|---|---|" + "---|" * itl + "---|---|---|---|",
    ]
    for r in rows:
        step, ratio = r["decode_step_tokens_per_s"], r["of_decode_step"]
        cells = [f"{r['streams']}", f"{r['prompt_tokens']:.0f}", f"{r['tokens_per_s']:,.0f}"]
        cells += [f"{r['ttft_ms']['median']:.1f} / {r['ttft_ms']['p99']:.1f}"]
        cells += [f"{r['itl_ms']['p99']:.1f}"] * itl + [f"{r['completed']}", f"{r['failures']}"]
        cells += [f"{step:,.0f}" if step else "-", f"{ratio:.2f}x" if ratio else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


HOST_PHASES = ("commands", "admit", "prefill", "launch", "finish", "send")  # the engine loop's own work (scheduler.py)


def table(rows: list[dict]) -> str:
    lines = [
        "| streams | prompt | tokens/s | TTFT median / p99 ms | ITL p99 ms | tokens/event | decode step tokens/s |"
        " ratio | same as alone | engine host ms a step | engine prefill ms (windows) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        step, ratio = r["decode_step_tokens_per_s"], r["of_decode_step"]
        ms, steps = r.get("engine_ms", {}), r.get("engine_steps", 0)
        host = f"{sum(ms.get(k, 0.0) for k in HOST_PHASES) / steps:.3f}" if steps else "-"
        prefill = "-" if "prefill" not in ms else f"{ms['prefill']:,.1f} ({r['prefill_windows']:g})"
        lines.append(
            f"| {r['streams']} | {r['prompt_tokens']} | {r['tokens_per_s']:,.0f} | "
            f"{r['ttft_ms']['median']:.1f} / {r['ttft_ms']['p99']:.1f} | {r['itl_ms']['p99']:.1f} | "
            f"{r['tokens_per_event']:.2f} | {f'{step:,.0f}' if step else '-'} | "
            f"{f'{ratio:.2f}x' if ratio else '-'} | {r['same_as_alone']} | {host} | {prefill} |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=SHAPES, help="random weights of this shape (default: andrea-120m on cuda, tiny)")
    p.add_argument("--checkpoint", help="a step-*.bin or run folder to serve instead (default: random weights)")
    p.add_argument(
        "--streams", type=int, nargs="+", help="concurrent streams of each row (default: 1 8 64 256; cpu: 1 2)"
    )
    p.add_argument(
        "--prompts", nargs="+", help="prompt kinds: short, or a number of tokens (default: short 512; cpu: short 24)"
    )
    p.add_argument("--tokens", type=int, help="max_tokens of each request (default: 256 on cuda, 8 on cpu)")
    p.add_argument("--temperature", type=float, default=0.0, help="each request's temperature (0: greedy)")
    p.add_argument("--precision", help="serve's --precision (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument(
        "--chat",
        type=int,
        help="conversations of the chat rows (default: 64 on cuda, none on cpu: "
        "the tiny model's context holds no conversation)",
    )
    p.add_argument("--turns", type=int, default=4, help="turns of each conversation")
    p.add_argument("--system", type=int, help="system prompt tokens (default: 384 on cuda, 16 on cpu)")
    p.add_argument("--chat-tokens", type=int, help="max_tokens of a chat turn (default: 64 on cuda, 4 on cpu)")
    p.add_argument(
        "--locust",
        help='the command that runs locust (e.g. "python3 -m locust"): the locustfile bench/serve_locust.py at each '
        "--streams too, against the same server (an outside client's figures beside the bench's own)",
    )
    p.add_argument(
        "--guidellm",
        help='the command that runs guidellm (e.g. "guidellm"): bench/serve_guidellm.py at each --streams and '
        "--prompts too, against the same server (an outside client's figures beside the bench's own)",
    )
    p.add_argument("--guidellm-seconds", type=float, help="each guidellm row's seconds (default: 20 on cuda, 5 on cpu)")
    p.add_argument("--locust-seconds", type=float, help="each locust run's seconds (default: 20 on cuda, 8 on cpu)")
    p.add_argument("--repeats", type=int, default=3, help="the decode step's timing runs (bench/decode.py's)")
    p.add_argument("--start-timeout", type=float, help="seconds for serve to answer (default: 600 on cuda, 120 on cpu)")
    p.add_argument(
        "--timeout",
        type=float,
        help="seconds a request may wait for its next event, a client process twice that (default: 600 on cuda, 120 "
        "on cpu, where nothing is tuned or compiled)",
    )
    return p


def defaults(args: argparse.Namespace) -> None:
    gpu = args.device == "cuda"
    args.shape = args.shape or ("andrea-120m" if gpu else "tiny")
    args.streams = args.streams or ([1, 8, 64, 256] if gpu else [1, 2])
    args.prompts = args.prompts or (["short", "512"] if gpu else ["short", "24"])
    args.tokens = args.tokens or (256 if gpu else 8)
    args.chat = (64 if gpu else 0) if args.chat is None else args.chat
    args.system = args.system or (384 if gpu else 16)
    args.chat_tokens = args.chat_tokens or (64 if gpu else 4)
    args.start_timeout = args.start_timeout or (600 if gpu else 120)
    args.timeout = args.timeout or (600 if gpu else 120)
    args.locust_seconds = args.locust_seconds or (20 if gpu else 8)
    args.guidellm_seconds = args.guidellm_seconds or (20 if gpu else 5)
    args.max_batch = max(args.streams + [args.chat])
    args.backend, args.precision = "triton" if gpu else "numpy", args.precision or ("bf16" if gpu else "fp32")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    defaults(args)
    term = Terminate()
    with tempfile.TemporaryDirectory() as tmp:
        tok = None
        if args.checkpoint:
            try:
                ld = load_trained(args.checkpoint)
            except InputError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            ckpt, m, w = ld.path.resolve(), ld.exp.model, ld.weights
            record = ld.side.get("tokenizer", {})
        else:
            record = tokenizer_record(SHAPES[args.shape].vocab_size, Path(tmp))
            m, w, ckpt = random_checkpoint(args.shape, Path(tmp), record)
        tok = load_tokenizer(record)
        prompts = Prompts(tok)
        lengths = {kind: prompts.tokens(kind) for kind in args.prompts}
        if max(lengths.values()) + args.tokens > m.seq_len:
            print(
                f"error: a {max(lengths.values())}-token prompt and --tokens {args.tokens} pass the context of "
                f"{m.seq_len}",
                file=sys.stderr,
            )
            return 2
        t0 = time.perf_counter()
        step = decode_rates(args, m, w, lengths)
        print(f"bench: the decode step alone in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        log = Path(tmp) / "serve.log"
        chats, guided = [], []
        try:
            with served(ckpt, args, log, term) as server:
                rows = sweep(server, args, prompts, step)
                outside = locust_rows(server, args, prompts, step, Path(tmp)) if args.locust else []
                if args.guidellm:
                    guided = guidellm_rows(server, args, prompts, step, Path(tmp), (record, m))
                if args.chat:
                    chats.append(chat(server, args, prompts, tok, True))
            if args.chat:
                with served(ckpt, args, log, term, "--no-prefix-reuse") as server:
                    warm_up(server, args, prompts, args.chat)
                    chats.append(chat(server, args, prompts, tok, False))
        except (BenchError, OSError) as e:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            print(f"error: {e}\n--- the last lines serve wrote:\n{tail}", file=sys.stderr)
            return 1
    head = {
        "model": server.model,
        "shape": None if args.checkpoint else args.shape,
        "backend": args.backend,
        "precision": args.precision,
        "max_batch": args.max_batch,
        "max_tokens": args.tokens,
        "tokenizer": {k: record.get(k) for k in ("kind", "vocab_size")},
        "server_rc": server.proc.returncode,
        "seconds": time.perf_counter() - t0,
    }
    for c in chats:
        print(json.dumps({"chat_row": c}), flush=True)
    print(json.dumps({"run": head}), flush=True)
    print(table(rows))
    if outside:
        print(outside_table(outside, "locust"))
    if guided:
        print(outside_table(guided, "guidellm"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
