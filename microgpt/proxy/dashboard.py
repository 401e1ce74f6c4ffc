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
                                       its log (RunFolder.log_state), so a finished or a live `train` run is served,
                                       and samples from its report card once it has one (RunFolder.log_samples)
    GET /<name>.json                   a regular file directly inside the root folder (loss, samples, state)

Nothing else is served: no listing, no other subfolder (checkpoints, archive), no path that resolves outside
the folder (`..`, encoded separators, symbolic links anywhere below the root, in or out), each a 4xx. Every
route, /api included, reads through one resolver (dashdata.RunFolder.open: one component at a time, O_NOFOLLOW),
and a run name is looked up in the folder's listing (which lists no linked run), never joined into a path.
Only GET and HEAD; any other method gets 405. Requests whose Host is not 127.0.0.1:PORT or localhost:PORT get
403, so a web page elsewhere cannot read the run through DNS rebinding. Every malformed request gets a 4xx: a
query number that is not a finite integer in range (`since=inf`, `width=1e999`) 400, a name in any script 404
(the message is in the body, UTF-8; the status line stays ASCII). File answers carry an ETag (mtime and size):
an unchanged file costs a 304, not a download.

The transport is httpd.py: one event loop holds every connection (one request reader with deadlines for the head and
the whole request, one request each, a deadline to take the answer, a cap on connections that drops the slowest
request first), so slow or half-open clients cannot stall the others. A client that goes away mid-answer is not an
error and prints nothing. Requests are not logged (a page polls several times a second) unless --verbose; a server
error prints its traceback.

Standalone: `python -m microgpt.proxy.dashboard FOLDER [--port N] [--verbose]`, FOLDER a run folder (a proxy's or
`microgpt train`'s, live or finished) or a folder of them.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import parse_qs, parse_qsl, quote, unquote, urlencode

from microgpt.errors import ArgParser, InputError, check_number, exit_on_input_error, parse_number
from microgpt.httpd import Answer, BoundedHTTPServer, Request, error
from microgpt.proxy.dashdata import RunFolder, RunNotReady, RunUnavailable, view
from microgpt.runlog import LOG_NAME

PAGE_NAME = "live-loss-dashboard.html"
PAGE = Path(__file__).resolve().with_name(PAGE_NAME)  # package data: a non-editable install serves it too
VENDOR = PAGE.parent / "vendor" / "uplot"
VENDOR_FILES = {"/vendor/uplot/uPlot.iife.min.js": "text/javascript", "/vendor/uplot/uPlot.min.css": "text/css"}
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,250}\.json$")
MAX_URL = 2048  # longer request targets get 414 (no file or run name here comes near it)
QUERY_NUMBERS = ("since", "vsince", "from", "to", "width")
STEP_LIMIT = 2**53  # a query number the page's JavaScript numbers cannot hold exactly is no step of a run
LINGER_S = 5.0  # after the run: how long an open page gets to read its final state (DashboardServer.linger)
CSP = "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'"
Opened = tuple[BinaryIO, os.stat_result]


class ServeError(InputError):
    """The dashboard cannot serve (port in use, page missing, no run in the folder); str(err) is one line."""


class QueryError(InputError):
    """A query parameter of /api/loss out of type or range (a 400)."""


def query_number(query: dict[str, list[str]], key: str) -> int | None:
    """One integer query parameter (since, vsince, from, to, width), None when absent; QueryError otherwise."""
    raw = (query.get(key) or [""])[0]
    return None if raw == "" else parse_number(raw, key, -STEP_LIMIT, STEP_LIMIT, integer=True, error=QueryError)


def json_answer(obj: Any, etag: bool = False) -> Answer:
    """obj as JSON; with etag, tagged by its content (the page tells a new state from an old one by the tag)."""
    data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    tag = {"ETag": f'"{hashlib.sha256(data).hexdigest()[:16]}"'} if etag else {}
    return Answer(200, {"Content-Type": "application/json", "Cache-Control": "no-cache", **tag}, data)


def open_package(path: Path) -> Opened:
    """A file of the package (the page, uPlot), opened as it is: it is ours, not the run folder's."""
    f = open(path, "rb")
    return f, os.fstat(f.fileno())


class Site:
    """The answers: every route of the module docstring, each run file through the folder's resolver. No sockets
    here (httpd.py calls answer() from its workers); `requests` keeps the last /api/loss answers (the tests')."""

    def __init__(self, root: Path, run: str | None, page: Path):
        self.run, self.page = run, page
        self.folder = RunFolder(root)
        self.requests: deque[dict[str, Any]] = deque(maxlen=1000)
        self.port = 0
        self.hosts: set[str] = set()  # the Host headers a request may carry: ours (no DNS rebinding)
        self.state_read = -1e9  # time.monotonic() of the last /api/state answer (DashboardServer.linger)

    def bind(self, port: int) -> None:
        self.port, self.hosts = port, {f"127.0.0.1:{port}", f"localhost:{port}"}

    def answer(self, req: Request) -> Answer:
        if req.method not in ("GET", "HEAD"):
            return error(405, "read-only: GET and HEAD only", Allow="GET, HEAD")
        if req.headers.get("host", "") not in self.hosts:
            return error(403, "unexpected Host header")
        if len(req.target) > MAX_URL:
            return error(414, "URI too long")
        if req.path == "/":
            pairs = parse_qsl(req.query, keep_blank_values=True)  # the README's ?x=time and friends, kept
            if self.run and not any(k == "run" for k, _ in pairs):
                pairs.insert(0, ("run", self.run))  # the run the server opens on; none: every run
            query = urlencode(pairs, safe="/", quote_via=quote)
            ans = Answer(302, {"Location": f"/{PAGE_NAME}" + (f"?{query}" if query else "")})
        elif req.path.startswith("/api/"):
            ans = self._api(req.path, req.query, req)
        else:
            ans = self._static(unquote(req.path), req)
        ans.send_body = ans.send_body and req.method == "GET"
        return ans

    def _static(self, name: str, req: Request) -> Answer:
        """The page, uPlot, and a regular *.json file directly in the root folder."""
        if name in VENDOR_FILES:
            return self._file(open_package(VENDOR / name.rsplit("/", 1)[1]), req, VENDOR_FILES[name])
        if name == f"/{PAGE_NAME}":
            return self._file(open_package(self.page), req, "text/html; charset=utf-8", CSP)
        if not name.startswith("/") or not NAME_RE.match(name[1:]):
            return error(404, "not found")
        try:
            return self._file(self.folder.open(name[1:]), req, "application/json")
        except RunUnavailable:
            return error(404, "not found")

    def _file(self, opened: Opened, req: Request, ctype: str, csp: str = "") -> Answer:
        f, st = opened
        etag = f'"{st.st_mtime_ns:x}-{st.st_size:x}"'
        headers = {"ETag": etag, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
        if req.headers.get("if-none-match") == etag:  # unchanged: answered without reading the file
            f.close()
            return Answer(304, headers, send_body=False)
        return Answer(
            200,
            {"Content-Type": ctype, **headers, **({"Content-Security-Policy": csp} if csp else {})},
            file=f,
            length=st.st_size,
        )

    def _api(self, path: str, text: str, req: Request) -> Answer:
        if path == "/api/runs":
            return json_answer({"runs": list(self.folder.runs())})
        try:
            query = parse_qs(text, max_num_fields=16)
        except ValueError:
            return error(400, "too many query parameters")
        run = (query.get("run") or [""])[0]
        try:
            if path in ("/api/state", "/api/samples"):
                kind = path.removeprefix("/api/")
                if kind == "state":
                    self.state_read = time.monotonic()  # a page is open (linger() waits for its next read)
                    if self.folder.parts(run, "loss")[-1] == LOG_NAME:  # a `train` folder: no state file
                        return json_answer(self.folder.log_state(run), etag=True)
                elif self.folder.parts(run, "loss")[-1] == LOG_NAME:  # nor samples: its report card's
                    return json_answer(self.folder.log_samples(run), etag=True)
                opened = self.folder.open(*self.folder.parts(run, kind))
                return self._file(opened, req, "application/json")
            if path != "/api/loss":
                return error(404, "not found")
            args = {k: query_number(query, k) for k in QUERY_NUMBERS}
            ans = view(
                self.folder.loss(run), args["width"] or 1000, args["since"], args["vsince"], args["from"], args["to"]
            )
        except QueryError as e:
            return error(400, str(e))
        except RunNotReady as e:
            return error(503, str(e), **{"Retry-After": "1"})
        except RunUnavailable as e:
            return error(404, str(e))
        sent = json_answer(ans)
        self.requests.append(
            {
                "path": req.target,
                "run": run,
                "since": args["since"],
                "points": ans["points"],
                "max_points": max((len(s["step"]) for s in ans["series"].values()), default=0),
                "bytes": len(sent.body),
            }
        )
        return sent


class DashboardServer:
    """Bind at construction (so a busy port is an error before the run starts); serve in a thread.

    `root` is a run folder or a folder of run folders; `run` is the run the page opens on (None: every run).
    `httpd` is the Site: its port, folder and the recorded /api/loss answers."""

    def __init__(
        self,
        root: Path,
        run: str | None,
        port: int,
        page: Path = PAGE,
        verbose: bool = False,
        flag: str = "--dashboard",
    ):
        if not page.is_file():
            raise ServeError(f"{page}: dashboard page not found (an install without its package data)")
        check_number(port, f"{flag} (a TCP port, 0 picks a free one)", 0, 65535, integer=True, error=ServeError)
        self.httpd = Site(Path(root), run, page)
        log = (lambda line: print(line, file=sys.stderr, flush=True)) if verbose else None
        try:
            self.server = BoundedHTTPServer(port, self.httpd.answer, log)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ServeError(
                    f"{flag} {port}: port {port} on 127.0.0.1 is in use; pick another or 0 for a free one"
                ) from None
            raise ServeError(f"{flag} {port}: cannot listen on 127.0.0.1:{port} ({e.strerror})") from None
        self.httpd.bind(self.server.port)
        self.url = f"http://127.0.0.1:{self.server.port}/"

    def start(self) -> None:
        self.server.start()
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
        """Stop serving; an answer under way (linger()'s last read) is still sent, for at most a second."""
        self.server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> int:
    """Serve a folder until Ctrl-C; bad input (no folder, no run there, port in use) is one `error:` line, exit 2."""
    return exit_on_input_error(serve, sys.argv[1:] if argv is None else argv)


def serve(argv: list[str]) -> int:
    p = ArgParser(prog="python -m microgpt.proxy.dashboard", description=__doc__.splitlines()[0])
    p.add_argument("folder", help="a run folder (holding <run>.loss.json) or a folder of run folders")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--run", help="the run the page opens on (default: the folder's only run, else all of them)")
    p.add_argument("--verbose", action="store_true", help="log every request (default: none; errors always)")
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
    server = DashboardServer(root, run, args.port, verbose=args.verbose, flag="--port")
    print(f"dashboard: {server.url}  ({len(runs)} run{'s' * (len(runs) > 1)}; Ctrl-C to stop)", file=sys.stderr)
    # The loop serves in a thread and this one waits on the signals: a SIGINT the kernel hands to a worker thread
    # would never wake a main thread blocked in the loop's select (it hung there, the CI saw it).
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    while not stop.wait(0.5):
        pass
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
