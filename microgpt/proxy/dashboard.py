"""A read-only HTTP server for the live loss dashboard, on 127.0.0.1: the page, uPlot, and the runs of a folder.

    GET /?QUERY                        302 to the page with the same QUERY (?x=time, ?interval=...), plus the run
                                       when QUERY names none (none at all: every run of a folder of runs)
    GET /live-loss-dashboard.html      the page, package data beside this module (scripts/ links to it)
    GET /vendor/uplot/uPlot.*          the vendored chart library (package data; the page needs no network)
    GET /api/runs                      {"runs": [name...]}: <run> for <root>/<run>.loss.json, <sub>/<run> for
                                       <root>/<sub>/<run>.loss.json (a folder of run folders)
    GET /api/loss?run=R&width=W        the loss history downsampled to W buckets per series (dashdata.py);
                  &since=S&vsince=V    only the train rows after step S and val rows after V (the live poll)
                  &from=A&to=B         the steps in [A, B] (the page's zoom)
    GET /api/state?run=R, /api/samples?run=R   that run's .state.json / .samples.json as they are; a folder
                                       `microgpt train` wrote (train.jsonl, no proxy files) gets a state made from
                                       its log (RunFolder.log_state), so a finished or a live `train` run is served
    GET /<name>.json                   a regular file directly inside the root folder (loss, samples, state)

Nothing else is served: no listing, no other subfolder (checkpoints, archive), no path that resolves outside
the folder (`..`, encoded separators, symlinks out), each a 4xx; a run name is looked up in the folder's
listing, never joined into a path. Only GET and HEAD; any other method gets 405. Requests whose Host is not
127.0.0.1:PORT or localhost:PORT get 403, so a web page elsewhere cannot read the run through DNS rebinding.
File answers carry an ETag (mtime and size): an unchanged file costs a 304, not a download.

One thread per request (daemon threads) with at most MAX_HANDLERS at once; further connections wait in a
listen backlog of BACKLOG. A client that goes away mid-answer is not an error and prints nothing. Requests are not
logged (a page polls several times a second), server errors (5xx) are; --verbose logs every request.

Standalone: `python -m microgpt.proxy.dashboard FOLDER [--port N] [--verbose]`, FOLDER a run folder (a proxy's or
`microgpt train`'s, live or finished) or a folder of them.
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
import sys
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, parse_qsl, quote, unquote, urlencode, urlsplit

from microgpt.errors import ArgParser, InputError, exit_on_input_error
from microgpt.proxy.dashdata import RunFolder, RunNotReady, RunUnavailable, view
from microgpt.runlog import LOG_NAME

PAGE_NAME = "live-loss-dashboard.html"
PAGE = Path(__file__).resolve().with_name(PAGE_NAME)  # package data: a non-editable install serves it too
VENDOR = PAGE.parent / "vendor" / "uplot"
VENDOR_FILES = {"/vendor/uplot/uPlot.iife.min.js": "text/javascript", "/vendor/uplot/uPlot.min.css": "text/css"}
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,250}\.json$")
MAX_URL = 2048  # longer request targets get 414 (no file or run name here comes near it)
MAX_HANDLERS = 32  # requests answered at once; more wait in the backlog
BACKLOG = 256
LINGER_S = 5.0  # after the run: how long an open page gets to read its final state (DashboardServer.linger)
QUIET = (ConnectionError, TimeoutError)  # a client that went away: BrokenPipe, ConnectionReset, a stalled socket


class ServeError(InputError):
    """The dashboard cannot serve (port in use, page missing, no run in the folder); str(err) is one line."""


class Handler(BaseHTTPRequestHandler):
    server: DashboardHTTPServer
    server_version = "microgpt-dashboard"
    sys_version = ""
    timeout = 30  # an idle or stalled client frees its handler slot after this

    def __getattr__(self, name: str) -> Any:
        if name.startswith("do_"):  # every method but GET and HEAD: 405, not http.server's 501
            return self._not_allowed
        raise AttributeError(name)

    def _not_allowed(self) -> None:
        self.send_error(405, "read-only: GET and HEAD only", extra={"Allow": "GET, HEAD"})

    def send_error(self, code: int, message: str | None = None, explain: str | None = None,
                   extra: dict[str, str] | None = None) -> None:  # fmt: skip
        body = f"{code} {message or ''}\n".encode()
        self.send_response(code, message)
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD" and code >= 200 and code not in (204, 304):
            self.wfile.write(body)

    def do_GET(self) -> None:
        self._serve(body=True)

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def _serve(self, body: bool) -> None:
        if self.headers.get("Host", "") not in self.server.hosts:
            return self.send_error(403, "unexpected Host header")
        if len(self.path) > MAX_URL:
            return self.send_error(414, "URI too long")
        url = urlsplit(self.path)
        if url.path == "/":
            pairs = parse_qsl(url.query, keep_blank_values=True)  # the README's ?x=time and friends, kept
            if self.server.run and not any(k == "run" for k, _ in pairs):
                pairs.insert(0, ("run", self.server.run))  # the run the server opens on; none: every run
            query = urlencode(pairs, safe="/", quote_via=quote)
            self.send_response(302)
            self.send_header("Location", f"/{PAGE_NAME}" + (f"?{query}" if query else ""))
            self.send_header("Content-Length", "0")
            return self.end_headers()
        if url.path.startswith("/api/"):
            return self._api(url.path, parse_qs(url.query), body)
        target = self.server.resolve(url.path)
        if target is None:
            return self.send_error(404, "not found")
        self._send_file(target, body)

    def _send_file(self, target: Path, body: bool) -> None:
        try:
            stat = target.stat()
            etag = f'"{stat.st_mtime_ns:x}-{stat.st_size:x}"'
            if self.headers.get("If-None-Match") == etag:  # unchanged: answered without reading the file
                self.send_response(304)
                self.send_header("ETag", etag)
                return self.end_headers()
            data = target.read_bytes() if body else b""
        except OSError:
            return self.send_error(404, "not found")
        ctype = VENDOR_FILES.get(f"/vendor/uplot/{target.name}") if target.parent == VENDOR else None
        html = target.suffix == ".html"
        ctype = ctype or ("text/html; charset=utf-8" if html else "application/json")
        self._send(200, ctype, data, etag=etag, length=stat.st_size if not body else len(data), html=html)

    def _send(self, code: int, ctype: str, data: bytes, etag: str = "", length: int | None = None,
              html: bool = False) -> None:  # fmt: skip
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data) if length is None else length))
        if etag:
            self.send_header("ETag", etag)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Content-Type-Options", "nosniff")
        if html:
            self.send_header("Content-Security-Policy", "default-src 'self'; script-src 'self' 'unsafe-inline'; "
                             "style-src 'self' 'unsafe-inline'")  # fmt: skip
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _api(self, path: str, query: dict[str, list[str]], body: bool) -> None:
        folder = self.server.folder
        if path == "/api/runs":
            return self._json({"runs": list(folder.runs())})
        run = (query.get("run") or [""])[0]
        try:
            if path in ("/api/state", "/api/samples"):
                if path == "/api/state":
                    self.server.state_read = time.monotonic()  # a page is open (linger() waits for its next read)
                target = folder.path(run, path.removeprefix("/api/"))
                if path == "/api/state" and not target.exists() and folder.path(run, "loss").name == LOG_NAME:
                    return self._json(folder.log_state(run), etag=True)
                return self._send_file(target, body)
            if path != "/api/loss":
                return self.send_error(404, "not found")
            args = {k: _int_arg(query, k) for k in ("since", "vsince", "from", "to", "width")}
        except RunUnavailable:
            return self.send_error(404, "no such run")
        except ValueError as e:
            return self.send_error(400, str(e))
        try:
            ans = view(folder.loss(run), args["width"] or 1000, args["since"], args["vsince"], args["from"],
                       args["to"])  # fmt: skip
        except RunNotReady as e:
            return self.send_error(503, str(e), extra={"Retry-After": "1"})
        except RunUnavailable as e:
            return self.send_error(404, str(e))
        sent = self._json(ans)
        self.server.record({"path": self.path, "run": run, "since": args["since"], "points": ans["points"],
                            "max_points": max((len(s["step"]) for s in ans["series"].values()), default=0),
                            "bytes": sent})  # fmt: skip

    def _json(self, obj: Any, etag: bool = False) -> int:
        """obj as JSON; with etag, tagged by its content (the page tells a new state from an old one by the tag)."""
        data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
        self._send(200, "application/json", data, etag=f'"{hashlib.sha256(data).hexdigest()[:16]}"' if etag else "")
        return len(data)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """Every request with --verbose; otherwise only the server's own errors (a page polls all the time)."""
        if self.server.verbose or (isinstance(code, int) and code >= 500):  # an HTTPStatus is an int
            BaseHTTPRequestHandler.log_message(self, '"%s" %s %s', self.requestline, str(code), str(size))

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)


def _int_arg(query: dict[str, list[str]], key: str) -> int | None:
    raw = (query.get(key) or [None])[0]
    if raw is None or raw == "":
        return None
    try:
        return int(float(raw))
    except ValueError:
        raise ValueError(f"{key}={raw[:40]!r}: not a number") from None


class DashboardHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = False  # a port someone else holds must fail, not be shared
    request_queue_size = BACKLOG

    def __init__(self, root: Path, run: str | None, port: int, page: Path, verbose: bool):
        self.root, self.run, self.page, self.verbose = root, run, page, verbose
        self.folder = RunFolder(root)
        self.slots = threading.BoundedSemaphore(MAX_HANDLERS)
        self.requests: deque[dict[str, Any]] = deque(maxlen=1000)  # /api/loss answers, newest last (tests read it)
        self.state_read = -1e9  # time.monotonic() of the last /api/state answer
        super().__init__(("127.0.0.1", port), Handler)
        self.port = self.server_address[1]
        self.hosts = {f"127.0.0.1:{self.port}", f"localhost:{self.port}"}

    def record(self, entry: dict[str, Any]) -> None:
        self.requests.append(entry)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.slots.acquire()  # at the cap, the accept loop waits here and new connections wait in the backlog
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], QUIET):
            return  # the client closed the connection (a page reload, a cancelled fetch): nothing to report
        super().handle_error(request, client_address)

    def resolve(self, url_path: str) -> Path | None:
        """The file a URL path names, or None: the page, uPlot, and *.json directly in the root folder."""
        name = unquote(url_path)
        if name in VENDOR_FILES:
            return VENDOR / name.rsplit("/", 1)[1]
        if not name.startswith("/") or "/" in name[1:] or "\\" in name or "\0" in name:
            return None
        name = name[1:]
        if name == PAGE_NAME:
            return self.page
        if not NAME_RE.match(name):
            return None
        try:
            root = self.root.resolve()
            target = (root / name).resolve()
            if target.parent != root or not target.is_file():
                return None
        except OSError:  # ENAMETOOLONG, ELOOP, EACCES...: not something we serve
            return None
        return target


class DashboardServer:
    """Bind at construction (so a busy port is an error before the run starts); serve in a thread.

    `root` is a run folder or a folder of run folders; `run` is the run the page opens on (None: every run)."""

    def __init__(self, root: Path, run: str | None, port: int, page: Path = PAGE, verbose: bool = False):
        if not page.is_file():
            raise ServeError(f"{page}: dashboard page not found (an install without its package data)")
        if not 0 <= port <= 65535:
            raise ServeError(f"--dashboard {port}: not a TCP port (0-65535; 0 picks a free one)")
        try:
            self.httpd = DashboardHTTPServer(Path(root), run, port, page, verbose)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ServeError(f"--dashboard {port}: port {port} on 127.0.0.1 is in use; pick another "
                                 "or 0 for a free one") from None  # fmt: skip
            raise ServeError(f"--dashboard {port}: cannot listen on 127.0.0.1:{port} ({e.strerror})") from None
        self.url = f"http://127.0.0.1:{self.httpd.port}/"
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
        self.thread.start()
        threading.Thread(target=self.warm, daemon=True).start()

    def warm(self) -> None:
        """Parse every run's history now, so the first page load does not wait for a 200K-row file."""
        for run in self.httpd.folder.runs():
            try:
                self.httpd.folder.loss(run)
            except RunUnavailable:
                pass

    def linger(self, timeout: float = LINGER_S) -> None:
        """The run has ended and its files are final: when a page is open (it read the state in the last minute),
        serve until it has read the state once more (the final one: done, stopped), at most timeout seconds, so it
        keeps the finished run's last state when the server is gone."""
        start = time.monotonic()
        while start - self.httpd.state_read < 60 and time.monotonic() - start < timeout:
            if self.httpd.state_read > start:
                return
            time.sleep(0.02)

    def close(self) -> None:
        if self.thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()


def main(argv: list[str] | None = None) -> int:
    """Serve a folder until Ctrl-C; bad input (no folder, no run there, port in use) is one `error:` line, exit 2."""
    return exit_on_input_error(serve, sys.argv[1:] if argv is None else argv)


def serve(argv: list[str]) -> int:
    p = ArgParser(prog="python -m microgpt.proxy.dashboard", description=__doc__.splitlines()[0])
    p.add_argument("folder", help="a run folder (holding <run>.loss.json) or a folder of run folders")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--run", help="the run the page opens on (default: the folder's only run, else all of them)")
    p.add_argument("--verbose", action="store_true", help="log every request (default: only server errors)")
    args = p.parse_args(argv)
    root = Path(args.folder)
    if not root.is_dir():
        raise ServeError(f"{root}: no such folder")
    runs = list(RunFolder(root).runs())
    if not runs:
        raise ServeError(f"{root}: no run here or in its subfolders (a <run>.loss.json or a train.jsonl)")
    if args.run is not None and args.run not in runs:
        raise ServeError(f"--run {args.run}: not a run in {root} (runs: {', '.join(runs[:10])})")
    run = args.run or (runs[0] if len(runs) == 1 else None)
    server = DashboardServer(root, run, args.port, verbose=args.verbose)
    print(f"dashboard: {server.url}  ({len(runs)} run{'s' * (len(runs) > 1)}; Ctrl-C to stop)", file=sys.stderr)
    threading.Thread(target=server.warm, daemon=True).start()
    try:
        server.httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    server.httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
