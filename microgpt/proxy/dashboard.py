"""A read-only HTTP server for the live loss dashboard: the page and one run folder's JSON, on 127.0.0.1.

    GET /                              302 to /live-loss-dashboard.html?run=<run>
    GET /live-loss-dashboard.html      the page, package data beside this module (scripts/ links to it)
    GET /<name>.json                   a regular file directly inside the run folder (loss, samples, state)

Nothing else is served: no listing, no subfolder (checkpoints, archive), no path that resolves outside the
run folder (`..`, encoded separators, symlinks out), each a 4xx. Only GET and HEAD; any other method gets
405. Requests whose Host is not 127.0.0.1:PORT or localhost:PORT get 403, so a web page elsewhere cannot
read the run through DNS rebinding. JSON answers carry an ETag (mtime and size): the page polls with
revalidation and an unchanged file costs a 304, not a download.

Standalone, for a finished run: `python -m microgpt.proxy.dashboard RUN_DIR [--port N]`.
"""

from __future__ import annotations

import errno
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from microgpt.errors import ArgParser, InputError, exit_on_input_error

PAGE_NAME = "live-loss-dashboard.html"
PAGE = Path(__file__).resolve().with_name(PAGE_NAME)  # package data: a non-editable install serves it too
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.json$")


class ServeError(InputError):
    """The dashboard cannot serve (port in use, page missing, no run in the folder); str(err) is one line."""


class Handler(BaseHTTPRequestHandler):
    server: DashboardHTTPServer
    server_version = "microgpt-dashboard"
    sys_version = ""

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
        path = urlsplit(self.path).path
        if path == "/":
            self.send_response(302)
            self.send_header("Location", f"/{PAGE_NAME}?run={quote(self.server.run)}")
            self.send_header("Content-Length", "0")
            return self.end_headers()
        target = self.server.resolve(path)
        if target is None:
            return self.send_error(404, "not found")
        try:
            stat = target.stat()
        except OSError:
            return self.send_error(404, "not found")
        etag = f'"{stat.st_mtime_ns:x}-{stat.st_size:x}"'
        if self.headers.get("If-None-Match") == etag:  # unchanged: answered without reading the file
            self.send_response(304)
            self.send_header("ETag", etag)
            return self.end_headers()
        try:
            data = target.read_bytes() if body else b""
        except OSError:
            return self.send_error(404, "not found")
        html = target.suffix == ".html"
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8" if html else "application/json")
        self.send_header("Content-Length", str(stat.st_size if not body else len(data)))
        self.send_header("ETag", etag)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Content-Type-Options", "nosniff")
        if html:
            self.send_header("Content-Security-Policy",
                             "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'")  # fmt: skip
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)


class DashboardHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = False  # a port someone else holds must fail, not be shared

    def __init__(self, run_dir: Path, run: str, port: int, page: Path, verbose: bool):
        self.run_dir, self.run, self.page, self.verbose = run_dir, run, page, verbose
        super().__init__(("127.0.0.1", port), Handler)
        self.port = self.server_address[1]
        self.hosts = {f"127.0.0.1:{self.port}", f"localhost:{self.port}"}

    def resolve(self, url_path: str) -> Path | None:
        """The file a URL path names, or None: only the page and *.json directly in the run folder."""
        name = unquote(url_path)
        if not name.startswith("/") or "/" in name[1:] or "\\" in name or "\0" in name:
            return None
        name = name[1:]
        if name == PAGE_NAME:
            return self.page
        if not NAME_RE.match(name):
            return None
        root = self.run_dir.resolve()
        target = (root / name).resolve()
        if target.parent != root or not target.is_file():
            return None
        return target


class DashboardServer:
    """Bind at construction (so a busy port is an error before the run starts); serve in a thread."""

    def __init__(self, run_dir: Path, run: str, port: int, page: Path = PAGE, verbose: bool = False):
        if not page.is_file():
            raise ServeError(f"{page}: dashboard page not found (an install without its package data)")
        if not 0 <= port <= 65535:
            raise ServeError(f"--dashboard {port}: not a TCP port (0-65535; 0 picks a free one)")
        try:
            self.httpd = DashboardHTTPServer(Path(run_dir), run, port, page, verbose)
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

    def close(self) -> None:
        if self.thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()


def main(argv: list[str] | None = None) -> int:
    """Serve a run folder until Ctrl-C; bad input (no run there, port in use) is one `error:` line, exit 2."""
    return exit_on_input_error(serve, sys.argv[1:] if argv is None else argv)


def serve(argv: list[str]) -> int:
    p = ArgParser(prog="python -m microgpt.proxy.dashboard", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="a run folder holding <run>.loss.json")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--run", help="run name (default: from the folder's *.loss.json)")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    runs = sorted(x.name.removesuffix(".loss.json") for x in run_dir.glob("*.loss.json"))
    run = args.run or (runs[0] if runs else None)
    if run is None:
        raise ServeError(f"{run_dir}: no <run>.loss.json here (pass --run NAME)")
    server = DashboardServer(run_dir, run, args.port, verbose=True)
    print(f"dashboard: {server.url}  (Ctrl-C to stop)", file=sys.stderr)
    try:
        server.httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    server.httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
