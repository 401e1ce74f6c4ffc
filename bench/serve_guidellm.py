"""A running `microgpt serve` under guidellm (an established load generator no one here wrote): its concurrent
profile at each --streams, and its own figures per concurrency. guidellm owns the users, their scheduling, the HTTP
client (httpx), the prompts and the statistics; this file owns the command line and the reading of guidellm's JSON.
bench/serve.py --guidellm runs it against the server it started (its docstring); by hand, against a running serve:

    python3 bench/serve_guidellm.py --url http://127.0.0.1:8000 --checkpoint RUN --streams 1 8 64 256
    GUIDELLM="/path/venv/bin/guidellm" python3 bench/serve_guidellm.py --url ... --tokenizer HF_FOLDER

What guidellm sends: GET /health and /v1/models, then POST /v1/completions streamed (stream_options include_usage),
max_tokens --tokens with ignore_eos (every stream is --tokens long), temperature 0 (greedy, as bench/serve.py's and the
locustfile's: guidellm's backend extras; it sends none of its own), a synthetic prompt of exactly --prompt-tokens tokens
of the checkpoint's tokenizer (guidellm makes it with a Hugging Face tokenizer: --tokenizer, an exported folder such as
`microgpt export RUN --format hf` writes, or --checkpoint, whose tokenizer is written as that folder's tokenizer.json
and tokenizer_config.json). Each concurrency N keeps N streams in flight, a stream's end sending the next, for --seconds
(guidellm's max_duration); all of them run in one guidellm process (--override profile.streams), which writes one JSON
file.

One JSON line per concurrency on stdout (client "guidellm"): streams, prompt tokens (the server's usage, median), the
streams completed, failed (guidellm's errored) and cut (incomplete: in flight when --seconds ran out), the completion
tokens of the completed ones and the benchmark's seconds, tokens/s (guidellm's own output tokens per second: its tokens
over time, within a few percent of the completed streams' tokens over the seconds), TTFT median and p99, ITL median and
p99 (guidellm's inter-token latency: a stream's time from its first token to its last over its tokens after the first,
one average per stream weighted by its tokens: its p99 is of streams' averages, not of single gaps between events as
bench/serve.py's), tokens per event (guidellm's output tokens per streaming iteration, mean). Every wait is bounded:
guidellm gets --seconds per concurrency plus --timeout, then is killed, and the error names what it waited for; where
guidellm cannot be run, exits non-zero or writes no JSON, one error line (with its output's tail), exit 1. guidellm is
not in the project's extras (nothing here imports it): GUIDELLM or --guidellm names the command; on the GPU machine its
wheels travel with the call (dev/gpu_check.sh, stage serve-guidellm).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EXTRAS = 'extras={"body":{"temperature":0}}'  # added to each request's body (no comma: guidellm splits on them)
STARTUP_S = 120.0  # guidellm's own start (imports, the tokenizer, the data set) and its end (the report), at most


class GuidellmError(Exception):
    """guidellm could not be run or gave no figures; the message is the one error line."""


def write_tokenizer(record: dict[str, Any], model: Any, folder: Path) -> Path:
    """A checkpoint's tokenizer (its sidecar's record, its ModelConfig) as a Hugging Face folder: the export's
    tokenizer.json and tokenizer_config.json (microgpt/use/export.py), which guidellm's AutoTokenizer loads."""
    from microgpt.use.export import tokenizer_files

    tok_json, cfg, _ = tokenizer_files(record, model)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return folder


def command(
    guidellm: str, url: str, tokenizer: Path | str, streams: list[int], prompt_tokens: int, tokens: int,
    seconds: float, out: Path,
) -> list[str]:  # fmt: skip
    """guidellm's command line for one prompt length at every concurrency of streams."""
    return [
        *shlex.split(guidellm),
        "run",
        *("--backend", f"kind=openai_http,target={url},request_format=/v1/completions,{EXTRAS}"),
        *("--profile", "kind=concurrent", "--override", "profile.streams", ",".join(map(str, streams))),
        *("--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={tokens}"),
        *("--tokenizer", f"kind=huggingface_auto,model={tokenizer}"),
        *("--constraint", f"kind=max_duration,seconds={seconds:g}"),
        *("--output", f"kind=json,path={out}"),
        "--disable-console-interactive",
    ]


def successful(metrics: dict[str, Any], name: str) -> dict[str, Any]:
    return metrics[name]["successful"]


def rows_of(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per benchmark of guidellm's JSON report (the module docstring)."""
    rows = []
    for b in report["benchmarks"]:
        m, totals = b["metrics"], b["metrics"]["request_totals"]
        ttft, itl = successful(m, "time_to_first_token_ms"), successful(m, "inter_token_latency_ms")
        rows.append(
            {
                "client": "guidellm",
                "streams": b["config"]["strategy"]["streams"],
                "prompt_tokens": successful(m, "prompt_token_count")["median"],
                "completed": totals["successful"],
                "failures": totals["errored"],
                "cut": totals["incomplete"],
                "completion_tokens": successful(m, "output_token_count")["total_sum"],
                "seconds": b["duration"],
                "tokens_per_s": successful(m, "output_tokens_per_second")["mean"],
                "ttft_ms": {"median": ttft["median"], "p99": ttft["percentiles"]["p99"]},
                "itl_ms": {"median": itl["median"], "p99": itl["percentiles"]["p99"]},
                "tokens_per_event": successful(m, "output_tokens_per_iteration")["mean"],
            }
        )
    return rows


def run(
    guidellm: str, url: str, tokenizer: Path | str, streams: list[int], prompt_tokens: int, tokens: int,
    seconds: float, timeout: float, folder: Path,
) -> list[dict[str, Any]]:  # fmt: skip
    """guidellm at every concurrency of streams (one process); its rows; GuidellmError with one line otherwise."""
    out = folder / f"guidellm-{prompt_tokens}.json"
    cmd = command(guidellm, url, tokenizer, streams, prompt_tokens, tokens, seconds, out)
    limit = STARTUP_S + len(streams) * (seconds + timeout)
    try:
        res = subprocess.run(
            cmd, cwd=folder, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=limit,
            env=os.environ | {"GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING"},
        )  # fmt: skip
    except FileNotFoundError as e:
        raise GuidellmError(f"guidellm cannot be run ({guidellm!r}): {e}") from None
    except subprocess.TimeoutExpired:
        raise GuidellmError(f"guidellm at streams {streams} did not end within {limit:g} s") from None
    tail = " | ".join((res.stderr + res.stdout).strip().splitlines()[-6:])[-800:]
    if res.returncode != 0 or not out.is_file():
        raise GuidellmError(f"guidellm at streams {streams} exited {res.returncode} without its report: {tail}")
    rows = rows_of(json.loads(out.read_text()))
    if [r["streams"] for r in rows] != streams:
        raise GuidellmError(f"guidellm's report has streams {[r['streams'] for r in rows]}, not {streams}: {tail}")
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="the server's root, e.g. http://127.0.0.1:8000")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokenizer", help="a Hugging Face tokenizer folder or name (the served model's tokenizer)")
    src.add_argument("--checkpoint", help="the served run folder or step-*.bin: its tokenizer, written for guidellm")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 64, 256], help="concurrent streams of each row")
    p.add_argument("--prompt-tokens", type=int, default=16, help="each prompt's length in tokens")
    p.add_argument("--tokens", type=int, default=256, help="max_tokens of each stream (ignore_eos: all of them)")
    p.add_argument("--seconds", type=float, default=20.0, help="each concurrency's seconds (guidellm's max_duration)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds past --seconds a concurrency may take")
    p.add_argument(
        "--guidellm", default=os.environ.get("GUIDELLM", "guidellm"), help="the command that runs guidellm "
        '(default: $GUIDELLM, else "guidellm"; e.g. "env PYTHONPATH=/tmp/guidellm-site python3 -m guidellm")',
    )  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            tokenizer: Path | str = args.tokenizer
            if args.checkpoint:
                from microgpt.engine.trained import load_trained
                from microgpt.errors import InputError

                try:
                    ld = load_trained(args.checkpoint)
                except InputError as e:
                    raise GuidellmError(str(e)) from None
                tokenizer = write_tokenizer(ld.side.get("tokenizer", {}), ld.exp.model, Path(tmp) / "tokenizer")
            rows = run(
                args.guidellm, args.url, tokenizer, args.streams, args.prompt_tokens, args.tokens, args.seconds,
                args.timeout, Path(tmp),
            )  # fmt: skip
        except GuidellmError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    for r in rows:
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
