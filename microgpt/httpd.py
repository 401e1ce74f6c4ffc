"""A small HTTP/1.0 server that no client can stall: the transport of the dashboard (proxy/dashboard.py) and of
`microgpt serve` (use/serve.py), which hold the routes.

One asyncio event loop (in one thread) holds every connection; what to answer is computed in a thread pool (file
reads, a history's parse, a request's parse), off the loop, or, for a request whose body is at most `inline_body`
bytes, on the loop itself (serve: a completion's parse and tokenization take tens of microseconds, and a hop to a
worker and back cost more than that, and up to the interpreter's switch interval each way while the loop is busy
writing other streams); a handler may also return an awaitable of its answer, which the loop awaits (serve's
completions: the answer is ready when the model has written it), and a streamed answer's chunks come from an async
generator on the loop itself. Neither may block. A connection costs the loop a few kilobytes and no thread, so
hundreds of slow or half-open clients leave the others' answers as fast as before.

One reader takes every request (`read_request`), against two deadlines counted from the connection's accept:

    its request head     at most MAX_HEAD bytes (else 431), all of it within HEAD_DEADLINE_S (else 408: a client
                         that sends a byte a minute is cut at the deadline, not at each byte)
    its request body     what Content-Length (ASCII digits) says, at most the server's max_body bytes (else 413,
                         before any of it is read; 0 by default: the dashboard reads none), all of the request within
                         BODY_DEADLINE_S (else 408); a body sent without a Content-Length (chunked) gets 411
    one request          then the answer and the connection closes (HTTP/1.0, no keep-alive)
    its answer           taken within WRITE_DEADLINE_S (a client that does not read is dropped); a file answer is sent
                         from the open file (loop.sendfile), never read whole into memory first; a streamed answer (an
                         async generator of chunks, server-sent events) is written chunk by chunk as it yields them,
                         with no Content-Length: the body ends when the connection closes (HTTP/1.0's close-delimited
                         body, which every client reads), each chunk within WRITE_DEADLINE_S
    a place              at most MAX_CONNECTIONS are open; a new one beyond that closes the connection that has been
                         reading its request longest (its head or its body: a flood of slow clients of either kind
                         cannot lock a new client out), or, with none reading, gets 503 at once

So slow clients are bounded by time (the deadlines) and by count (the cap, the slowest dropped first).
Malformed requests (no request line, a header without a colon, a target that is not a path or that urlsplit
refuses, a Content-Length that is not ASCII digits) get 400; an exception in the handler (a bug) gets 500 and its
traceback on stderr; a client that goes away is not an error and prints nothing; an exception in a streamed
answer's generator ends the stream there, its traceback on stderr. The server's own error answers (400, 408, 411,
413, 431, 500, 503) are plain text unless the routes give an `errors` function (serve's are JSON). Bound at
construction on host:port (127.0.0.1 unless told; a port in use is an error before anything starts);
serve_forever() runs the loop until shutdown(), which lets the answers under way finish for a grace period and
drops every other connection quietly (no traceback for a half-open one); start() runs it in a thread of its own and
stop() ends that (shutdown, the thread joined, close): how serve, the dashboard and the tests run it.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import BinaryIO
from urllib.parse import urlsplit

MAX_HEAD = 16 * 1024
HEAD_DEADLINE_S = 10.0  # from the accept: the whole head
BODY_DEADLINE_S = 30.0  # from the accept: the whole request, its body included
WRITE_DEADLINE_S = 60.0
MAX_CONNECTIONS = 512
WORKERS = 8  # answers computed at once; the rest queue for a worker, their connections held by the loop alone
BACKLOG = 1024  # connections the kernel queues before the loop accepts them (a burst of clients)
REQUEST_LINE = re.compile(r"^([!#$%&'*+.^_`|~0-9A-Za-z-]+) (\S+) HTTP/(\d)\.(\d)$")
LENGTH = re.compile(r"[0-9]{1,18}")  # Content-Length: ASCII digits only (str.isdigit takes "²", int does not)
QUIET = (ConnectionError, TimeoutError, asyncio.IncompleteReadError)  # a client that went away or stalled


@dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]  # names lower-cased; a name given twice is a 400 before any handler sees it
    body: bytes = b""
    peer: str = ""  # the client's address

    @property
    def path(self) -> str:
        """The target's path (urlsplit's: parse_head refuses a target it does not take)."""
        return urlsplit(self.target).path

    @property
    def query(self) -> str:
        return urlsplit(self.target).query


@dataclass
class Answer:
    """What to send: a status, headers, and a body (bytes; or an open file of `length` bytes sent as it is; or
    `chunks`, an async generator of byte strings, run on the event loop, each sent as it comes, the body ending with
    the connection). `closed` is called once the answer is over, sent or not (a streamed answer's client gone:
    serve frees what the request held)."""

    code: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    file: BinaryIO | None = None
    length: int = 0
    send_body: bool = True  # False for HEAD (and 304): the headers only, Content-Length as for GET
    chunks: AsyncGenerator[bytes, None] | None = None
    closed: Callable[[], None] | None = None


Handler = Callable[[Request], "Answer | Awaitable[Answer]"]


def error(code: int, message: str = "", **headers: str) -> Answer:
    """A plain-text error answer; the message goes in the body (UTF-8), never in the status line."""
    body = f"{code} {message}\n".encode("utf-8", "replace")
    return Answer(code, {"Content-Type": "text/plain; charset=utf-8", **headers}, body)


def parse_head(head: bytes) -> Request | None:
    """The request in a head (request line and headers, CRLF-separated, ending with an empty line); None when it is
    not one (an absent or malformed request line, a target that is not a path or that urlsplit refuses, a header
    without a name, a header line folded, a name twice)."""
    lines = head.decode("latin-1").split("\r\n")
    match = REQUEST_LINE.match(lines[0])
    if match is None or not match.group(2).startswith("/"):
        return None
    try:
        urlsplit(match.group(2))
    except ValueError:  # "//[x": an IPv6 netloc never closed, and friends
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip() or name.lower() in headers:
            return None
        headers[name.lower()] = value.strip()
    return Request(match.group(1), match.group(2), headers)


def printable(text: str) -> str:
    """text for a log line: control characters (a hostile target's CR, LF, ESC) written as escapes."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda m: f"\\x{ord(m.group()):02x}", text)


def bound_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    """A socket bound to host:port (an IPv4 or IPv6 address, or a name), listening unless `listen` is False (then
    serve_forever listens: until it does, a connection is refused, not queued). A port in use fails here.

    SO_REUSEADDR is on for the bind and the listen (reuse_address): the connections an earlier server on the port
    closed wait a minute in TIME_WAIT, and without it a server restarted within that minute found its port "in
    use" (Linux lets the bind through only when both sockets set it). Between a bind and a later listen it is off:
    with it on, a second server could bind the same port then (two sockets bound, neither listening, both reusing)
    and fail only at its listen, after loading its model."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        reuse_address(sock, True)
        sock.bind(addr)
        if listen:
            sock.listen(BACKLOG)
        else:
            reuse_address(sock, False)
    except OSError:
        sock.close()
        raise
    return sock


def reuse_address(sock: socket.socket, on: bool) -> None:
    """SO_REUSEADDR: a bind or a listen passes a port's connections in TIME_WAIT (never another server's listen)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(on))


class BoundedHTTPServer:
    """Listens on host:port at construction (listen_now False: binds there, a port in use failing at once, and
    listens from serve_forever(): serve's port is taken before its engine loads, and listened on once it has);
    serve_forever() answers with handler(request) until shutdown().
    `workers` handlers run at once (an awaitable answer or a stream holds none while it waits); a request whose body
    is at most `inline_body` bytes (-1: none) is answered on the loop, not in a worker: the handler must not block
    on such a request."""

    def __init__(
        self,
        port: int,
        handler: Handler,
        log: Callable[[str], None] | None = None,
        *,
        host: str = "127.0.0.1",
        max_body: int = 0,
        workers: int = WORKERS,
        name: str = "microgpt-dashboard",
        errors: Callable[..., Answer] = error,
        on_loop: Callable[[asyncio.AbstractEventLoop], None] | None = None,
        listen_now: bool = True,
        inline_body: int = -1,
    ) -> None:
        self.handler, self.log, self.max_body, self.name, self.errors = handler, log, max_body, name, errors
        self.inline_body = inline_body
        self.on_loop = on_loop  # called on the loop once it runs (serve: the engine's socket read there)
        self.sock = bound_socket(host, port, listen_now)
        self.port = self.sock.getsockname()[1]
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self.reading: dict[asyncio.StreamWriter, float] = {}  # connections whose request is not all here yet
        self.writers: set[asyncio.StreamWriter] = set()  # every open connection
        self.answering = 0  # connections whose request has arrived and whose answer is not yet sent
        self.grace = 0.0  # shutdown(): seconds those get to finish
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopped: asyncio.Event | None = None
        self.ready = threading.Event()
        self.thread: threading.Thread | None = None  # start()'s

    def serve_forever(self) -> None:
        asyncio.run(self._serve())

    def start(self, timeout: float = 10.0) -> None:
        """serve_forever in a daemon thread named after the server; back once its loop answers (at most timeout s)."""
        self.thread = threading.Thread(target=self.serve_forever, name=self.name, daemon=True)
        self.thread.start()
        self.ready.wait(timeout)

    def stop(self, grace: float = 0.0, timeout: float = 10.0) -> None:
        """The end of start(): shutdown(grace), its thread joined (at most timeout s), then close()."""
        if self.thread is not None:
            self.shutdown(grace)
            self.thread.join(timeout)
        self.close()

    async def _serve(self) -> None:
        self.loop, self.stopped = asyncio.get_running_loop(), asyncio.Event()
        reuse_address(self.sock, True)  # on again for the listen (bound_socket): past the port's TIME_WAIT connections
        server = await asyncio.start_server(self._client, sock=self.sock, limit=MAX_HEAD, backlog=BACKLOG)
        if self.on_loop is not None:
            self.on_loop(self.loop)
        self.ready.set()
        await self.stopped.wait()
        server.close()  # no new connection; the answers under way get the grace to finish
        deadline = time.monotonic() + self.grace
        while self.answering and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for writer in list(self.writers):  # the rest (half-open, slow, streams past the grace): dropped quietly
            writer.transport.abort()
        await asyncio.sleep(0)  # their handlers see the reset and end before the loop cancels what is left

    def shutdown(self, grace: float = 0.0) -> None:
        """Stop serve_forever (from another thread): an answer under way gets up to `grace` seconds to be sent (the
        page's last read of a finished run), every other connection is dropped."""
        self.ready.wait(5)
        if self.loop is not None and self.stopped is not None:
            self.grace = grace
            try:
                self.loop.call_soon_threadsafe(self.stopped.set)
            except RuntimeError:  # the loop has ended already
                pass

    def close(self) -> None:
        self.sock.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _make_room(self) -> bool:
        """At MAX_CONNECTIONS: close the connection that has been reading its request longest; False if none is."""
        if len(self.writers) < MAX_CONNECTIONS:
            return True
        if not self.reading:
            return False
        oldest = min(self.reading, key=self.reading.__getitem__)
        del self.reading[oldest]
        oldest.transport.abort()
        return True

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection, from its accept to its close. It never raises: a client that went away, a stall, or the
        server's shutdown (which cancels the handlers left) end it quietly."""
        if not self._make_room():
            answer = self.errors(503, "too many connections")
            writer.write(self._head(answer, answer.body))
            writer.close()
            return
        self.writers.add(writer)
        done = False
        try:
            await self._exchange(reader, writer)
            done = True
        except (*QUIET, asyncio.CancelledError):
            pass
        finally:
            self.writers.discard(writer)
            self.reading.pop(writer, None)
            if done:
                writer.close()  # all of the answer is with the kernel: close at once
            else:
                writer.transport.abort()  # a client that went away or stalled: drop what it did not take

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got = await self.read_request(reader, writer)
        if isinstance(got, Answer):
            return await self._send(writer, got, reader)
        peer = writer.get_extra_info("peername")
        got.peer = str(peer[0]) if isinstance(peer, tuple) else ""
        self.answering += 1
        try:
            answer = await self._answer(got)
            if self.log is not None:
                when = time.strftime("%d/%b/%Y %H:%M:%S")
                line = f"{got.method} {got.target}"
                self.log(f'{got.peer or "-"} - - [{when}] "{printable(line)}" {answer.code} -')
            await self._send(writer, answer, reader)
        finally:
            self.answering -= 1

    async def read_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Request | Answer:
        """The request on a new connection, head and body, within the deadlines counted from now (the module
        docstring); or the error answer that refuses it. While it reads, the connection may be dropped to make room
        (_make_room)."""
        self.reading[writer] = time.monotonic()
        try:
            return await self._read(reader, writer)
        finally:
            self.reading.pop(writer, None)

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Request | Answer:
        start = time.monotonic()
        try:
            async with asyncio.timeout(HEAD_DEADLINE_S):
                head = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            return self.errors(408, f"the request head must arrive within {HEAD_DEADLINE_S:g} s")
        except asyncio.LimitOverrunError:
            return self.errors(431, f"the request head must be at most {MAX_HEAD} bytes")
        request = parse_head(head)
        if request is None:
            return self.errors(400, "malformed request")
        if "transfer-encoding" in request.headers:
            return self.errors(411, "send the request body with a Content-Length (a chunked body is not read)")
        length = request.headers.get("content-length", "0")
        if not LENGTH.fullmatch(length):
            return self.errors(400, f"Content-Length must be a number of bytes, got {printable(length[:40])!r}")
        if int(length) > self.max_body:
            return self.errors(413, f"the request body must be at most {self.max_body} bytes, got {int(length)}")
        if int(length) and request.headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits for it before a large body
        left = start + BODY_DEADLINE_S - time.monotonic()
        try:
            async with asyncio.timeout(max(0.0, left)):
                request.body = await reader.readexactly(int(length))
        except TimeoutError:
            return self.errors(408, f"the request must arrive within {BODY_DEADLINE_S:g} s, its body included")
        return request

    async def _answer(self, request: Request) -> Answer:
        """The handler's answer, computed in a worker, or on the loop for a body of at most inline_body bytes (and
        awaited on the loop where the handler returns an awaitable of it)."""
        try:
            if len(request.body) <= self.inline_body:
                answer = self.handler(request)
            else:
                answer = await asyncio.get_running_loop().run_in_executor(self.pool, self.handler, request)
            return await answer if inspect.isawaitable(answer) else answer
        except Exception:  # a bug, in the handler or in what it returned to await: answered, and shown
            traceback.print_exc(file=sys.stderr)
            return self.errors(500, "internal error (see the server's stderr)")

    def _head(self, answer: Answer, extra: bytes) -> bytes:
        size = answer.length if answer.file is not None else len(answer.body)
        length = [] if answer.chunks is not None else [f"Content-Length: {size}"]
        lines = [
            f"HTTP/1.0 {answer.code} {HTTPStatus(answer.code).phrase}",
            f"Server: {self.name}",
            *(f"{k}: {v}" for k, v in answer.headers.items()),
            *length,
            "Connection: close",
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace") + extra

    async def _send(self, writer: asyncio.StreamWriter, answer: Answer, reader: asyncio.StreamReader) -> None:
        try:
            body = answer.body if answer.send_body and answer.file is None else b""
            writer.write(self._head(answer, body))
            await self._drain(writer)
            if answer.chunks is not None:
                await self._stream(writer, answer.chunks, reader)
            if answer.file is not None and answer.send_body and answer.length:
                if writer.transport.is_closing():  # the client hung up while the head went out
                    raise ConnectionResetError
                loop = asyncio.get_running_loop()
                await asyncio.wait_for(loop.sendfile(writer.transport, answer.file, 0, answer.length), WRITE_DEADLINE_S)
        finally:
            if answer.file is not None:
                answer.file.close()
            if answer.closed is not None:
                answer.closed()

    @staticmethod
    async def _drain(writer: asyncio.StreamWriter) -> None:
        """What the socket did not take at once, sent within WRITE_DEADLINE_S (none left: no timer)."""
        if writer.transport.get_write_buffer_size():
            await asyncio.wait_for(writer.drain(), WRITE_DEADLINE_S)

    async def _stream(
        self, writer: asyncio.StreamWriter, chunks: AsyncGenerator[bytes, None], reader: asyncio.StreamReader
    ) -> None:
        """Each chunk as the generator yields it, written before the next is asked; the generator is closed at the
        end, whatever ended the stream. The deadline applies where a chunk waits for the client (the transport's
        buffer not empty): a write the socket takes at once costs no timer. A client that closes its connection
        ends the stream at once, while the generator waits for its next chunk (serve: a request still queued frees
        its rows then, not when its first token would have been written): its end of the request is its end of
        the stream (a client that half-closes after its request, which no HTTP library does, is taken as gone)."""
        task = asyncio.current_task()

        def gone(read: asyncio.Future) -> None:
            if not read.cancelled() and (read.exception() is not None or read.result() == b""):
                task.cancel()

        watch = asyncio.ensure_future(reader.read(1))
        watch.add_done_callback(gone)
        try:
            while True:
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    return
                except Exception:  # a bug: shown, and the stream ends
                    traceback.print_exc(file=sys.stderr)
                    return
                if writer.transport.is_closing():
                    raise ConnectionResetError
                writer.write(chunk)
                await self._drain(writer)
        finally:
            watch.remove_done_callback(gone)
            watch.cancel()
            await chunks.aclose()
