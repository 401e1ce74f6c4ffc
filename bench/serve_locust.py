"""bench/serve.py's load from a client no one here wrote: a locustfile. Locust (an established load generator) owns
the users, their scheduling, the HTTP client and the statistics; this file owns the request and the reading of its
events. bench/serve.py --locust runs it against the server it started, at each --streams (its docstring); by hand,
against a running serve:

    locust -f bench/serve_locust.py --headless -u 64 -r 64 -t 30s --host http://127.0.0.1:8000 --processes 2

Each user streams POST /v1/completions (greedy, ignore_eos, --serve-tokens tokens, a short prompt of its own: a line
of code, as bench/serve.py's "short") and sends the next as soon as one ends. Three entries go to locust's statistics:
"ttft" (the first event with text, ms from the request), "stream" (the whole stream, ms; its content length the
completion tokens, from the usage chunk) and failures (an HTTP error, an error event, a stream without [DONE]).
--serve-out FILE: the run's summary as JSON, written by the process that holds every user's statistics: the
completion tokens of the streams that ended and the seconds from the first request to the last (with
--reset-stats, counted from when every user had started), TTFT median and p99 (locust's percentiles, which round
to 2 significant digits), streams and failures. Locust is not in the project's extras (nothing imports this file);
on the GPU machine its wheels travel with the call (dev/gpu_check.sh, stage serve-locust).
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

from locust import FastHttpUser, constant, events, task
from locust.runners import WorkerRunner

PROMPT = "def request_{}(self, data):"  # bench/serve.py's short prompt
users = itertools.count()


@events.init_command_line_parser.add_listener
def _(parser: Any) -> None:
    parser.add_argument("--serve-model", default="", help="the model's name (default: the first of GET /v1/models)")
    parser.add_argument("--serve-tokens", type=int, default=256, help="max_tokens of each stream")
    parser.add_argument("--serve-out", default="", help="write the run's summary (JSON) to this file")


class Stream(FastHttpUser):
    """One concurrent stream: a streamed completion, then the next."""

    wait_time = constant(0)
    network_timeout = 600.0
    connection_timeout = 60.0

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.model = opts.serve_model or self.client.get("/v1/models").json()["data"][0]["id"]
        self.tokens, self.key = opts.serve_tokens, next(users)

    @task
    def complete(self) -> None:
        body = {
            "model": self.model,
            "prompt": PROMPT.format(self.key),
            "max_tokens": self.tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        fire = self.environment.events.request.fire
        t0 = time.perf_counter()
        res = self.client.request("POST", "/v1/completions", json=body, stream=True, name="head")
        first, usage, done, error = None, None, False, None
        if res.status_code != 200:
            return  # locust counted the failure ("head")
        while line := res.stream.readline(b"\n"):  # each event's line as it arrives (HTTP/1.0: the body ends at close)
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                done = True
                continue
            obj = json.loads(data)
            if "error" in obj:
                error = obj["error"].get("message")
            elif first is None and any(c.get("text") for c in obj.get("choices", ())):
                first = time.perf_counter()
                fire(request_type="SSE", name="ttft", response_time=1e3 * (first - t0), response_length=0,
                     exception=None, context={})  # fmt: skip
            usage = obj.get("usage") or usage
        wall = 1e3 * (time.perf_counter() - t0)
        failed = error or (None if done and usage else "the stream ended without its usage or [DONE]")
        fire(
            request_type="SSE",
            name="stream",
            response_time=wall,
            response_length=usage["completion_tokens"] if usage and not failed else 0,
            exception=RuntimeError(failed) if failed else None,
            context={},
        )


@events.quitting.add_listener
def _summary(environment: Any, **_: Any) -> None:
    """The run's figures (the module docstring) where --serve-out asks, on the process that holds every user's."""
    out = environment.parsed_options.serve_out
    if not out or isinstance(environment.runner, WorkerRunner):
        return
    stats = environment.stats
    ttft, stream = stats.get("ttft", "SSE"), stats.get("stream", "SSE")
    seconds = max(1e-9, stats.total.last_request_timestamp - stats.total.start_time)
    summary = {
        "users": environment.runner.target_user_count,
        "seconds": seconds,
        "completed": stream.num_requests,
        "failures": stats.total.num_failures,
        "completion_tokens": stream.total_content_length,
        "tokens_per_s": stream.total_content_length / seconds,
        "ttft_ms": {"median": ttft.get_response_time_percentile(0.5), "p99": ttft.get_response_time_percentile(0.99)},
        "stream_ms": {"median": stream.get_response_time_percentile(0.5)},
        "errors": [str(e.error)[:300] for e in list(stats.errors.values())[:3]],
    }
    with open(out, "w") as f:
        json.dump(summary, f)
