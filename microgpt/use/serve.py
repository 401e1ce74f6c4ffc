"""`microgpt serve CKPT_OR_RUN_DIR`: a checkpoint behind an OpenAI-compatible HTTP API, so the clients, chat UIs and
tools that talk to OpenAI-style local servers can use a microgpt model as it is.

    GET  /v1/models               {"object": "list", "data": [the model]}: one model, its id the run's name
    GET  /v1/models/NAME          that model (404 for any other name)
    POST /v1/chat/completions     messages rendered as ChatML with the checkpoint's tokenizer (as `microgpt chat`
                                  renders a turn: data/chat.py), the reply up to <|im_end|> or <|endoftext|>
    POST /v1/completions          a prompt string continued, up to <|endoftext|>

The fields read and refused are oai.py's (max_tokens, temperature, top_p, top_k, n, stop, seed, stream,
stream_options.include_usage, echo). Choice i of a request with seed S draws from seed S + i, so at any temperature
its text is the one `microgpt sample --seed S+i` draws for the same prompt ids. `stream: true` answers with
server-sent events in OpenAI's chunk format (a chat choice's first chunk carries the role), ending `data: [DONE]`.
Answers carry usage (prompt, completion and total tokens; the completion counts every token drawn, the stop token
included). Every malformed request gets a 4xx with OpenAI's error body {"error": {"message", "type", "param",
"code"}}, never a traceback: bad JSON or a body that is no object, a field of the wrong type or out of range, an
unknown model (404 model_not_found) or route (404), a prompt longer than the context (400 context_length_exceeded), a
body over MAX_BODY (413), a malformed or slow request (proxy/httpd.py: 400, 408, 411, 431); past the bound on
requests in flight, 429 (with Retry-After) at once, never a wait.

Batching: scheduler.py. Up to --max-batch sequences (the inference plan's B rows) decode together, each row at its
own position with its own sampling and stops, and a waiting request joins the batch between two passes of the
decode loop (continuous batching); up to --queue more rows wait; past that, 429.

Limits: text in, text out: no tools, images, logprobs, penalties or embeddings (refused with 400 where a request asks
for them); the context is the model's seq_len: a prompt must fit it, and a reply that fills it ends with
finish_reason "length" (no sliding window, unlike `sample`); a prompt is prefilled alone, so a long one delays the
batch's next pass by its prefill; a non-streamed request whose client goes away is decoded to its end; no
authentication (any API key is accepted) and no CORS: it binds 127.0.0.1 unless --host says otherwise. It runs on
the backend `--backend` and `--precision` choose (sample.open_trained: auto is triton where a CUDA GPU is there, in
bf16, else numpy in fp32); nothing here reads the arrays.

Transport: proxy/httpd.py, the dashboard's bounded asyncio HTTP/1.0 server, grown a request body and a streamed answer,
rather than starlette + uvicorn. The API is four routes of JSON in and JSON or server-sent events out, and the work
is one decode thread that a web framework does not help with; the bounded server already has what a server facing
clients needs (deadlines for a request's head, its body and each chunk of the answer, a cap on connections that drops
the slowest first, a worker pool), is tested under hostile clients (tests/proxy/test_dashboard_hostile.py), and adds
no dependency to the runtime's three. A stream is HTTP/1.0's close-delimited body, which every HTTP client reads (the
openai client, curl, browsers' fetch).

SIGTERM or Ctrl-C: the decode loop stops, requests in flight get an error (a stream: an error event, as OpenAI's), the
answers under way get a second to be sent, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import secrets
import signal
import socket
import sys
import threading
from collections.abc import AsyncGenerator, Callable
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from microgpt.engine.backend import add_flags
from microgpt.engine.trained import load_trained
from microgpt.errors import ArgParser, InputError, check_number
from microgpt.httpd import Answer, BoundedHTTPServer, Request
from microgpt.use import oai, sample
from microgpt.use.chat import Stream
from microgpt.use.oai import ApiError, Reply, Spec, json_answer, sse, sse_text
from microgpt.use.scheduler import STOPPING, Busy, Choice, Event, Job, Scheduler

MAX_BODY = 1 << 20  # bytes of a request body: a context of text is a few kB of JSON
MAX_BATCH = 4096
MAX_QUEUE = 100_000
DONE = b"data: [DONE]\n\n"


class ServeError(InputError):
    """serve cannot start: a flag out of range, the port in use, an address that is none."""


class Api:
    """The routes (the module docstring): request -> Answer, in the transport's workers."""

    def __init__(self, name: str, created: int, tok: Any, scheduler: Scheduler, seq_len: int, max_n: int) -> None:
        self.name, self.created, self.tok, self.scheduler = name, created, tok, scheduler
        self.seq_len, self.max_n = seq_len, max_n
        self.stop_ids = frozenset({tok.eot_id})

    def answer(self, req: Request) -> Answer:
        path = urlsplit(req.target).path.rstrip("/")
        routes = {"/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/completions": "POST"}
        try:
            if path.startswith("/v1/models/") and req.method == "GET":
                return self._model(path.removeprefix("/v1/models/"))
            if path not in routes:
                raise ApiError(404, f"unknown route: {req.method} {path[:200]}", err="unknown_url")
            if req.method != routes[path]:
                raise ApiError(405, f"{path} takes {routes[path]}, not {req.method[:20]}", err="method_not_allowed")
            if path == "/v1/models":
                return json_answer({"object": "list", "data": [self._card()]})
            return self._complete(req, chat=path == "/v1/chat/completions")
        except ApiError as e:
            return e.answer(**({"Retry-After": "1"} if e.code == 429 else {}))

    def _encode(self, text: str) -> list[int]:
        """A prompt's ids; an empty one starts a new document (<|endoftext|>), as `microgpt sample` does."""
        return self.tok.encode(text) or [self.tok.eot_id]

    def _card(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "microgpt"}

    def _model(self, name: str) -> Answer:
        if name != self.name:
            raise ApiError(404, f"the model {name[:200]!r} does not exist; this server has {self.name!r}", "model",
                           err="model_not_found")  # fmt: skip
        return json_answer(self._card())

    def _complete(self, req: Request, chat: bool) -> Answer:
        obj = oai.parse_body(req.body)
        model = obj.get("model")
        if not isinstance(model, str) or model != self.name:
            raise ApiError(404 if isinstance(model, str) else 400, f"the model {str(model)[:200]!r} does not exist; "
                           f"this server has {self.name!r}", "model", err="model_not_found")  # fmt: skip
        spec = oai.parse(obj, chat, self._encode, self.seq_len, self.max_n)
        job = self._job(spec)
        try:
            self.scheduler.submit(job)
        except Busy as e:
            raise ApiError(429, f"{e}; retry later", err="rate_limit_exceeded") from None
        except RuntimeError as e:
            raise ApiError(503, str(e)) from None
        reply = Reply.make(secrets.token_hex(12), self.name, chat)
        if spec.stream:
            headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return Answer(200, headers, chunks=self._chunks(job, spec, reply),
                          closed=lambda: self.scheduler.release(job))  # fmt: skip
        try:
            return json_answer(self._whole(job, spec, reply))
        finally:
            self.scheduler.release(job)

    def _job(self, spec: Spec) -> Job:
        seed = secrets.randbelow(2**62) if spec.seed is None else spec.seed
        return Job([Choice(i, spec.prompt, spec.max_tokens, spec.sampling, np.random.default_rng(seed + i),
                           Stream(self.tok.decode, spec.stops), self.stop_ids) for i in range(spec.n)])  # fmt: skip

    @staticmethod
    def _checked(ev: Event) -> Event:
        """ev, or the ApiError of an error event."""
        if ev.finish == "error":
            raise ApiError(503 if ev.text == STOPPING else 500, ev.text)
        return ev

    def _whole(self, job: Job, spec: Spec, reply: Reply) -> dict[str, Any]:
        """The answer once every choice has finished (in the transport's worker, woken once a pass)."""
        ready = threading.Event()
        job.wake = ready.set
        texts, finish, left = [spec.echo] * spec.n, [None] * spec.n, spec.n
        while left:
            ready.clear()  # before take: a pass that sends after it sets it again
            events = job.take()
            if not events:
                ready.wait()
            for ev in map(self._checked, events):
                texts[ev.index] += ev.text
                finish[ev.index] = ev.finish or finish[ev.index]
                left -= ev.finish is not None
        choices = [reply.choice(i, texts[i], finish[i]) for i in range(spec.n)]
        return {**reply.head(), "choices": choices, "usage": self._usage(job, spec)}

    def _usage(self, job: Job, spec: Spec) -> dict[str, int]:
        return oai.usage(len(spec.prompt), sum(len(c.ids) for c in job.choices))

    async def _chunks(self, job: Job, spec: Spec, reply: Reply) -> AsyncGenerator[bytes, None]:
        """The stream, on the transport's event loop (woken once a pass by the decode thread, never blocking): each
        choice's opening chunk (chat: the role; completions: the echo), a chunk per new text, one with the finish
        reason, the usage where asked, [DONE]; an error event where the server fails or stops. What one wake brings
        is written at once."""
        ready = asyncio.Event()
        job.wake = waker(ready)
        head = reply.head(chunk=True) | ({"usage": None} if spec.include_usage else {})
        text = sse_text(head, reply)
        if spec.chat or spec.echo:
            for i in range(spec.n):
                yield sse({**head, "choices": [reply.choice(i, spec.echo, None, chunk=True, role=True)]})
        left = spec.n
        while left:
            ready.clear()  # before take: a pass that sends after it sets it again
            events, out = job.take(), []
            if not events:
                await ready.wait()
            try:
                for ev in map(self._checked, events):
                    if ev.text:
                        out.append(text(ev.index, ev.text))
                    if ev.finish:
                        out.append(sse({**head, "choices": [reply.choice(ev.index, "", ev.finish, chunk=True)]}))
                        left -= 1
            except ApiError as e:
                yield b"".join([*out, sse({"error": e.body()})])
                return
            if out:
                yield b"".join(out)
        if spec.include_usage:
            yield sse({**head, "choices": [], "usage": self._usage(job, spec)}) + DONE
        else:
            yield DONE


def waker(ready: asyncio.Event) -> Callable[[], None]:
    """A Job.wake for a reader on the running event loop: sets `ready` there, from the decode thread."""
    loop = asyncio.get_running_loop()

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(ready.set)
        except RuntimeError:  # the loop has closed (the server stopped): no one reads any more
            pass

    return wake


def parser() -> ArgParser:
    p = ArgParser(prog="microgpt serve", description="Serve a checkpoint over an OpenAI-compatible HTTP API.")
    p.add_argument("checkpoint", help="a step-*.bin checkpoint, or a run folder (its newest valid checkpoint)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: a free one, printed at start)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (rows of the KV cache)")
    p.add_argument("--queue", type=int, default=32, help="more sequences that may wait for a row; past them, 429")
    p.add_argument("--verbose", action="store_true", help="log every request on stderr")
    add_flags(p)
    return p


def listen(args: argparse.Namespace, api: Api) -> BoundedHTTPServer:
    """The transport bound to --host:--port, with workers for every request the bound lets in."""
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
    where = f"--host {args.host} --port {args.port}"
    try:
        return BoundedHTTPServer(args.port, api.answer, log, host=args.host, max_body=MAX_BODY, name="microgpt-serve",
                                 workers=args.max_batch + args.queue + 8, errors=oai.api_error)  # fmt: skip
    except socket.gaierror as e:
        raise ServeError(f"{where}: not an address to listen on ({e.strerror})") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ServeError(f"{where}: the port is in use; pick another, or 0 for a free one") from None
        raise ServeError(f"{where}: cannot listen there ({e.strerror or e})") from None


def build(args: argparse.Namespace) -> tuple[Api, BoundedHTTPServer]:
    """The flags checked, the checkpoint loaded into a plan of --max-batch rows, the routes, and the transport bound
    to --host:--port; nothing runs yet (main starts the decode loop and the transport)."""
    check_number(args.port, "--port (a TCP port, 0: a free one)", 0, 65535, integer=True, error=ServeError)
    check_number(args.max_batch, "--max-batch", 1, MAX_BATCH, integer=True, error=ServeError)
    check_number(args.queue, "--queue", 0, MAX_QUEUE, integer=True, error=ServeError)
    ld = load_trained(args.checkpoint)
    gen, tok = sample.open_trained(ld, args.max_batch, args.backend, args.precision)
    api = Api(ld.exp.name, int(ld.path.stat().st_mtime), tok, Scheduler(gen, args.queue), ld.exp.model.seq_len,
              args.max_batch)  # fmt: skip
    server = listen(args, api)
    print(f"serve: {ld.exp.name} (step {ld.step}, {ld.path})", file=sys.stderr, flush=True)
    return api, server


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    api, server = build(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    api.scheduler.start()
    thread = threading.Thread(target=server.serve_forever, name="serve-http", daemon=True)
    thread.start()
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"serve: http://{host}:{server.port}/v1  (max batch {args.max_batch}, queue {args.queue}; Ctrl-C to stop)",
          file=sys.stderr, flush=True)  # fmt: skip
    while not stop.wait(0.5):
        pass
    api.scheduler.stop()
    server.shutdown(grace=1.0)
    thread.join(timeout=5)
    server.close()
    print("serve: stopped", file=sys.stderr, flush=True)
    return 0
