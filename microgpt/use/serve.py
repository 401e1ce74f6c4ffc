"""`microgpt serve CKPT_OR_RUN_DIR`: a checkpoint behind an OpenAI-compatible HTTP API, so the clients, chat UIs and
tools that talk to OpenAI-style local servers can use a microgpt model as it is; and a chat page for people.

    GET  /                        the chat page (chat.html, package data: one self-contained file, no network)
    GET  /v1/models               {"object": "list", "data": [the model]}: one model, its id the run's name
    GET  /health                  200 {} while the engine takes requests, else 503 (vLLM's route: guidellm and
                                  other load generators ask it before they start)
    GET  /v1/models/NAME          that model (404 for any other name)
    POST /v1/chat/completions     messages rendered as ChatML with the checkpoint's tokenizer (as `microgpt chat`
                                  renders a turn: data/chat.py), the reply up to <|im_end|> or <|endoftext|>
    POST /v1/completions          prompts continued, up to <|endoftext|>; echo and logprobs for scoring clients
    GET  /tokenizer_info          vLLM's tokenizer routes, which lm-evaluation-harness's tokenizer_backend "remote"
    POST /tokenize                reads: the end-of-text string and the chat template; {"prompt"} or {"messages"}
    POST /detokenize              -> {"count", "max_model_len", "tokens"}; {"tokens"} -> {"prompt"}
    GET  /stats                   the engine's counters (steps, rows decoded, prefill and reused tokens, host seconds
                                  by phase: scheduler.py) and this side's: bench/serve.py and dev/serve_profile.py

The fields read and refused are oai.py's. Choice i of a request with seed S draws from seed S + i, so at any
temperature its text is the one `microgpt sample --seed S+i` draws for the same prompt ids. `stream: true` answers
with server-sent events in OpenAI's chunk format (a chat choice's first chunk carries the role), ending `data:
[DONE]`; one event carries the text of every token that arrived since the last (a reader that falls behind gets
fewer, longer events, never a slower engine). Answers carry usage (prompt, completion and total tokens; the
completion counts every token drawn, the stop token included, up to the token that completed a stop string). Every
request gets an HTTP answer, and every error OpenAI's body {"error": {"message", "type", "param", "code"}}, never a
traceback: bad JSON or a body that is no object, a field of the wrong type, out of range or not UTF-8, an unknown
model (404 model_not_found) or route (404), a prompt longer than the context (400 context_length_exceeded), a body
over MAX_BODY (413), a malformed or slow request (httpd.py: 400, 408, 411, 431); past the bound on rows in flight,
429 (with Retry-After) at once, never a wait.

Two processes. This one holds HTTP (httpd.py's bounded server), parses and tokenizes requests, decodes the tokens
into text, finds the stop strings and writes the events (jobs.py: the engine as this side sees it); the engine
(scheduler.py, a child process; the one reader of the checkpoint) holds the model and only steps it. They exchange
ids over a socket pair (wire.py): a request's rows in, each step's tokens out. Why: scheduler.py's docstring and
docs/SERVE.md (measured on the CPU; on a GPU a decode step is 1-3 ms, which the HTTP side's Python per token would
otherwise be added to). Up to --max-batch rows decode together, each at its own position with its own sampling and
stops; a waiting row joins the batch at the next step (continuous batching), its prompt prefilled batched with the
others that wait, reusing the keys and values of a prefix a cache row holds (a chat's system prompt and history); up
to --queue more rows wait; past that, 429.

Limits: no tools, images, penalties or embeddings, and no logprobs in chat (refused with 400 where a request asks
for them); the context is the model's seq_len: a prompt must fit it (or name truncate_prompt_tokens), and a reply that
fills it ends with finish_reason "length" (no sliding window, unlike `sample`); no authentication (any API key is
accepted) and no CORS: it binds 127.0.0.1 unless --host says otherwise. It runs on the backend `--backend` and
`--precision` choose (sample.open_trained: auto is triton where a CUDA GPU is there, in bf16, else numpy in fp32).

SIGTERM or Ctrl-C: new requests are refused, requests in flight get an error (a stream: an error event, as
OpenAI's), the answers under way get a second to be sent, the engine process ends, exit 0.
"""

from __future__ import annotations

import argparse
import errno
import secrets
import signal
import socket
import sys
import threading
from collections.abc import AsyncGenerator, Awaitable
from pathlib import Path
from typing import Any

import numpy as np

from microgpt import checkpoint, config
from microgpt.data.tokenizer import PieceCache
from microgpt.engine.backend import add_flags
from microgpt.errors import ArgParser, InputError, check_number
from microgpt.httpd import Answer, BoundedHTTPServer, Request
from microgpt.use import oai
from microgpt.use.chat import Stream
from microgpt.use.export import CHAT_TEMPLATE
from microgpt.use.jobs import STOPPING, Busy, Choice, Engine, Event, Job
from microgpt.use.oai import ApiError, Reply, Spec, json_answer, sse, sse_text
from microgpt.use.wire import RowSpec

MAX_BODY = 1 << 20  # bytes of a request body: a context of text is a few kB of JSON
# a body up to this size is parsed and tokenized on the event loop, not in a worker (httpd.py): a completion's whole
# parse is tens of microseconds where a hop to a worker and back cost more, and up to the interpreter's 5 ms switch
# interval each way while the loop writes other streams. The tokenizer's encode holds the interpreter's lock (two
# threads encode no faster than one), so a worker never ran it beside the loop either; 16 KiB of text encodes in
# about 8 ms on the CPU (a 2,048-entry BPE), the longest the loop is held by one request
INLINE_BODY = 16 << 10
MAX_BATCH = 4096
MAX_QUEUE = 100_000
DONE = b"data: [DONE]\n\n"
PAGE = Path(__file__).resolve().with_name("chat.html")  # package data


class ServeError(InputError):
    """serve cannot start: a flag out of range, the port in use, an address that is none, an engine that failed."""


class Api:
    """The routes (the module docstring): request -> Answer, or an awaitable of it, on the transport's event loop (a
    body of at most INLINE_BODY bytes: every completion a client sends in practice) or in its workers."""

    def __init__(self, name: str, created: int, tok: Any, engine: Engine, model: oai.Model) -> None:
        self.name, self.created, self.tok, self.engine, self.model = name, created, tok, engine, model

    def answer(self, req: Request) -> Answer | Awaitable[Answer]:
        path = req.path.rstrip("/") or "/"
        routes = {
            "/": "GET",
            "/stats": "GET",
            "/health": "GET",
            "/v1/models": "GET",
            "/v1/chat/completions": "POST",
            "/v1/completions": "POST",
            "/tokenizer_info": "GET",
            "/tokenize": "POST",
            "/detokenize": "POST",
        }
        try:
            if path.startswith("/v1/models/") and req.method == "GET":
                return self._model(path.removeprefix("/v1/models/"))
            if path not in routes:
                raise ApiError(404, f"unknown route: {req.method} {path[:200]}", err="unknown_url")
            if req.method != routes[path]:
                raise ApiError(405, f"{path} takes {routes[path]}, not {req.method[:20]}", err="method_not_allowed")
            if path == "/":
                page = open(PAGE, "rb")
                return Answer(
                    200,
                    {"Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-cache"},
                    file=page,
                    length=PAGE.stat().st_size,
                )
            if path == "/stats":
                return self._stats()
            if path == "/health":
                if self.engine.gone:
                    raise ApiError(503, self.engine.gone)
                return json_answer({})
            if path == "/v1/models":
                return json_answer({"object": "list", "data": [self._card()]})
            if path in ("/tokenizer_info", "/tokenize", "/detokenize"):
                return self._tokenizer(path, req)
            return self._complete(req, chat=path == "/v1/chat/completions")
        except ApiError as e:
            return e.answer(**({"Retry-After": "1"} if e.code == 429 else {}))

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "microgpt",
            "max_model_len": self.model.seq_len,
        }

    def _model(self, name: str) -> Answer:
        self._check_model(name)
        return json_answer(self._card())

    def _check_model(self, name: Any) -> None:
        """ApiError unless name is this server's model: 404 model_not_found (400 for a name that is no string)."""
        if not isinstance(name, str) or name != self.name:
            raise ApiError(
                404 if isinstance(name, str) else 400,
                f"the model {str(name)[:200]!r} does not exist; this server has {self.name!r}",
                "model",
                err="model_not_found",
            )

    def _tokenizer(self, path: str, req: Request) -> Answer:
        """vLLM's tokenizer routes, which lm-evaluation-harness's tokenizer_backend="remote" reads (so it scores
        against serve with no exported folder): the tokenizer's end-of-text and chat template, text to ids, ids to
        text."""
        eos = self.tok.decode([self.tok.eot_id])
        if path == "/tokenizer_info":
            return json_answer(
                {
                    "tokenizer_class": type(self.tok).__name__,
                    "eos_token": eos,
                    "bos_token": eos,  # a document starts after <|endoftext|>, as the HF export's tokenizer says
                    "model_max_length": self.model.seq_len,
                    "vocab_size": self.model.vocab,
                    "chat_template": CHAT_TEMPLATE,
                }
            )
        obj = oai.parse_body(req.body)
        if "model" in obj:
            self._check_model(obj["model"])
        if path == "/tokenize":
            ids = self.tok.encode(oai.tokenize_text(obj))
            return json_answer({"count": len(ids), "max_model_len": self.model.seq_len, "tokens": ids})
        return json_answer({"prompt": self.tok.decode(oai.token_ids(obj, "tokens", self.model.vocab))})

    async def _stats(self) -> Answer:
        counters = await self.engine.counters()
        return json_answer({"engine": counters, "held": self.engine.held, **self.engine.info})

    def _complete(self, req: Request, chat: bool) -> Answer | Awaitable[Answer]:
        obj = oai.parse_body(req.body)
        self._check_model(obj.get("model"))
        spec = oai.parse(obj, chat, self.model)
        job, rows = self._job(spec)
        try:
            self.engine.submit(job, rows)
        except Busy as e:
            raise ApiError(429, f"{e}; retry later", err="rate_limit_exceeded") from None
        except RuntimeError as e:
            raise ApiError(503, str(e)) from None
        reply = Reply.make(secrets.token_hex(12), self.name, chat)
        if spec.stream:
            headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return Answer(200, headers, chunks=self._chunks(job, spec, reply), closed=lambda: self.engine.release(job))
        return self._whole(job, spec, reply)

    def _job(self, spec: Spec) -> tuple[Job, list[RowSpec]]:
        seed = secrets.randbelow(2**62) if spec.seed is None else spec.seed
        stop = () if spec.ignore_eos else (self.tok.eot_id,)
        choices, rows = [], []
        for i in range(spec.choices):
            prompt = spec.prompts[i // spec.n]
            choices.append(Choice(i, prompt, Stream(self.tok.decode, spec.stops)))
            s = spec.sampling
            rows.append(
                RowSpec(
                    i,
                    np.asarray(prompt, np.int32).tobytes(),
                    spec.max_tokens,
                    s.temperature,
                    s.top_k,
                    s.top_p,
                    seed + i,
                    stop,
                    -1 if spec.logprobs is None else spec.logprobs,
                    spec.echo and spec.logprobs is not None,
                )
            )
        return Job(spec, choices), rows

    @staticmethod
    def _checked(ev: Event) -> Event:
        """ev, or the ApiError of an error event."""
        if ev.finish == "error":
            raise ApiError(503 if ev.text == STOPPING else 500, ev.text)
        return ev

    def _echo(self, spec: Spec, c: Choice) -> str:
        return spec.texts[c.index // spec.n] if spec.echo else ""

    async def _whole(self, job: Job, spec: Spec, reply: Reply) -> Answer:
        """The answer once every choice has finished, awaited on the event loop."""
        try:
            texts = [self._echo(spec, c) for c in job.choices]
            finish: list[str | None] = [None] * len(job.choices)
            left = len(job.choices)  # as this reader has seen them end (the job's own count may be ahead)
            while left:
                await job.ready.wait()
                for ev in map(self._checked, job.take()):
                    texts[ev.index] += ev.text
                    finish[ev.index] = ev.finish or finish[ev.index]
                    left -= ev.finish is not None
            choices = [
                reply.choice(c.index, texts[c.index], finish[c.index], logprobs=self._logprobs(spec, c))
                for c in job.choices
            ]
            return json_answer({**reply.head(), "choices": choices, "usage": self._usage(job, spec)})
        except ApiError as e:
            return e.answer()
        finally:
            self.engine.release(job)

    def _logprobs(self, spec: Spec, c: Choice) -> dict[str, Any] | None:
        """A whole choice's logprobs (echo: the prompt's first), where asked."""
        if spec.logprobs is None:
            return None
        return oai.completion_logprobs([*(c.echo or []), *c.lps], self.tok.decode)

    def _usage(self, job: Job, spec: Spec) -> dict[str, int]:
        return oai.usage(sum(map(len, spec.prompts)), sum(c.drawn for c in job.choices))

    async def _chunks(self, job: Job, spec: Spec, reply: Reply) -> AsyncGenerator[bytes, None]:
        """The stream, on the transport's event loop: each choice's opening chunk (chat: the role; completions: the
        echo), a chunk per wake with the text that came, one with the finish reason, the usage where asked, [DONE]
        (the last three in the write of the wake that ended the last choice); an error event where the server fails
        or stops. A choice's logprobs come with the chunks, every token's once
        (those behind text held back come with a later chunk, or the finish's); their text_offset runs on from
        chunk to chunk, so that the chunks' logprobs joined are the whole answer's (as vLLM's stream)."""
        head = reply.head(chunk=True) | ({"usage": None} if spec.include_usage else {})
        text = sse_text(head, reply)
        offsets = [0] * len(job.choices)  # each choice's characters of token text so far

        def logprobs(index: int, entries: list | None) -> dict[str, Any] | None:
            if not entries:
                return None
            lps = oai.completion_logprobs(entries, self.tok.decode, offsets[index])
            offsets[index] += sum(map(len, lps["tokens"]))
            return lps

        if spec.chat or spec.echo:
            for c in job.choices:
                if spec.echo and spec.logprobs is not None:
                    while c.echo is None and not job.events:  # the prompt's logprobs come before its tokens
                        job.ready.clear()  # no set can come between this and the wait: both on this loop
                        await job.ready.wait()
                lps = logprobs(c.index, c.echo)
                yield sse(
                    {
                        **head,
                        "choices": [
                            reply.choice(c.index, self._echo(spec, c), None, chunk=True, role=True, logprobs=lps)
                        ],
                    }
                )
        left = len(job.choices)  # as this reader has seen them end (the job's own count may be ahead)
        while left:
            await job.ready.wait()
            out = []
            try:
                for ev in map(self._checked, job.take()):
                    left -= ev.finish is not None
                    lps = logprobs(ev.index, ev.logprobs)
                    if ev.text and lps is None:
                        out.append(text(ev.index, ev.text))
                    elif ev.text:
                        out.append(sse({**head, "choices": [reply.choice(ev.index, ev.text, None, True, False, lps)]}))
                        lps = None
                    if ev.finish:  # with the logprobs of tokens that brought no text (a stop token, held text)
                        out.append(sse({**head, "choices": [reply.choice(ev.index, "", ev.finish, True, False, lps)]}))
            except ApiError as e:
                yield b"".join([*out, sse({"error": e.body()})])
                return
            if not left:  # the end in the same write as the last text
                if spec.include_usage:
                    out.append(sse({**head, "choices": [], "usage": self._usage(job, spec)}))
                out.append(DONE)
            if out:
                yield b"".join(out)


def parser() -> ArgParser:
    p = ArgParser(prog="microgpt serve", description="Serve a checkpoint over an OpenAI-compatible HTTP API.")
    p.add_argument("checkpoint", help="a step-*.bin checkpoint, or a run folder (its newest valid checkpoint)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: a free one, printed at start)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (rows of the KV cache)")
    p.add_argument("--queue", type=int, default=32, help="more sequences that may wait for a row; past them, 429")
    p.add_argument(
        "--no-prefix-reuse",
        action="store_true",
        help="prefill every prompt whole (bench/serve.py's comparison): no keys and values of a cached prefix reused",
    )
    p.add_argument("--verbose", action="store_true", help="log every request on stderr")
    add_flags(p)
    return p


def transport(args: argparse.Namespace, holder: list[Api]) -> BoundedHTTPServer:
    """The transport bound to --host:--port (before the engine starts: a port in use is an error at once; it listens
    once started), answering with the Api that build puts in holder once the engine is ready."""
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
    where = f"--host {args.host} --port {args.port}"
    try:
        return BoundedHTTPServer(
            args.port,
            lambda req: holder[0].answer(req),
            log,
            host=args.host,
            max_body=MAX_BODY,
            inline_body=INLINE_BODY,
            name="microgpt-serve",
            errors=oai.api_error,
            on_loop=lambda loop: holder[0].engine.attach(loop),
            listen_now=False,  # a bad checkpoint is an error before anything listens
        )
    except socket.gaierror as e:
        raise ServeError(f"{where}: not an address to listen on ({e.strerror})") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ServeError(f"{where}: the port is in use; pick another, or 0 for a free one") from None
        raise ServeError(f"{where}: cannot listen there ({e.strerror or e})") from None


def build(args: argparse.Namespace) -> tuple[Api, BoundedHTTPServer]:
    """The flags checked, the transport bound to --host:--port (not listening yet), the engine process started and
    its model loaded; nothing is served yet (main starts the engine's loop and the transport). The engine process is
    the one reader of the checkpoint: this side builds the model's card and its tokenizer from the sidecar the
    engine read (Engine.wait_ready), so a bad checkpoint is the engine's one error line, before anything listens."""
    check_number(args.port, "--port (a TCP port, 0: a free one)", 0, 65535, integer=True, error=ServeError)
    check_number(args.max_batch, "--max-batch", 1, MAX_BATCH, integer=True, error=ServeError)
    check_number(args.queue, "--queue", 0, MAX_QUEUE, integer=True, error=ServeError)
    holder: list[Api] = []
    server = transport(args, holder)
    engine = Engine(args)
    try:
        engine.wait_ready()
    except BaseException:
        engine.stop()
        server.close()
        raise
    path, side = Path(engine.loaded["path"]), engine.loaded["side"]
    exp = config.from_dict(side["config"], f"{checkpoint.sidecar_path(path)}: field 'config'")
    tok = engine.tok
    pieces = PieceCache(tok)  # a chat's history encoded once a message, not once a turn
    model = oai.Model(
        exp.model.seq_len,
        exp.model.vocab_size,
        lambda text: pieces.encode(text) or [tok.eot_id],
        tok.decode,
        args.max_batch,
        args.max_batch + args.queue,
    )
    holder.append(Api(exp.name, int(path.stat().st_mtime), tok, engine, model))
    print(
        f"serve: {exp.name} (step {engine.loaded['step']}, {path}) on {engine.info.get('device')}",
        file=sys.stderr,
        flush=True,
    )
    return holder[0], server


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    api, server = build(args)
    api.engine.start()
    server.start()
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"serve: http://{host}:{server.port}/v1  (max batch {args.max_batch}, queue {args.queue}; chat page at "
        f"http://{host}:{server.port}/; Ctrl-C to stop)",
        file=sys.stderr,
        flush=True,
    )
    failed = False
    while not stop.wait(0.5) and not failed:
        failed = api.engine.proc.poll() is not None
    api.engine.stop()
    server.stop(grace=1.0, timeout=5)
    if failed:
        print(f"error: the engine process exited ({api.engine.proc.returncode}); its stderr is above", file=sys.stderr)
        return 1
    print("serve: stopped", file=sys.stderr, flush=True)
    return 0
