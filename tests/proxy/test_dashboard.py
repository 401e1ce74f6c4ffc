"""The dashboard server: the page and the run folder's JSON over GET/HEAD on 127.0.0.1; nothing else, ever."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from microgpt.errors import InputError
from microgpt.proxy.dashboard import PAGE, PAGE_NAME, DashboardServer, ServeError
from tests.conftest import REPO


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    tmp_path = tmp_path_factory.mktemp("served")
    run_dir = tmp_path / "run"
    (run_dir / "ckpt").mkdir(parents=True)
    (run_dir / "archive").mkdir()
    (run_dir / "r.loss.json").write_text('{"format": "microgpt-loss-1"}')
    (run_dir / "ckpt" / "step-00000001.state.json").write_text("{}")
    (run_dir / "archive" / "r.samples.x.json").write_text("{}")
    (run_dir / ".hidden.json").write_text("{}")
    (tmp_path / "secret.json").write_text('{"secret": 1}')
    (run_dir / "link.json").symlink_to(tmp_path / "secret.json")
    server = DashboardServer(run_dir, "r", 0)
    server.start()
    yield server
    server.close()


def request(server: DashboardServer, method: str, path: str, headers: dict | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", server.httpd.port, timeout=10)
    conn.request(method, path, headers=headers or {})  # sent as written: no client-side path normalization
    resp = conn.getresponse()
    resp.body = resp.read()
    conn.close()
    return resp


def test_serves_the_page_and_the_run_files(served: DashboardServer) -> None:
    assert served.url.startswith("http://127.0.0.1:")
    root = request(served, "GET", "/")
    assert root.status == 302 and root.getheader("Location") == "/live-loss-dashboard.html?run=r"
    page = request(served, "GET", "/live-loss-dashboard.html?run=r")
    assert page.status == 200 and b"uPlot.iife.min.js" in page.body
    assert page.getheader("Content-Type").startswith("text/html")
    loss = request(served, "GET", "/r.loss.json")
    assert loss.status == 200 and loss.body == b'{"format": "microgpt-loss-1"}'
    assert loss.getheader("Content-Type") == "application/json"
    again = request(served, "GET", "/r.loss.json", {"If-None-Match": loss.getheader("ETag")})
    assert again.status == 304 and again.body == b""
    head = request(served, "HEAD", "/r.loss.json")
    assert head.status == 200 and head.body == b"" and head.getheader("Content-Length") == str(len(loss.body))


@pytest.mark.parametrize(
    "path",
    [
        "/../secret.json",
        "/%2e%2e/secret.json",
        "/..%2fsecret.json",
        "/%2E%2E%2Fsecret.json",
        "//etc/passwd",
        "/ckpt/step-00000001.state.json",
        "/ckpt%2fstep-00000001.state.json",
        "/archive/r.samples.x.json",
        "/link.json",
        "/.hidden.json",
        "/r.loss.json%00.html",
        "/..\\secret.json",
        "/missing.json",
        "/ckpt",
        "/r.loss.json/",
        "/etc/passwd",
        "/%2Fetc%2Fpasswd",
    ],
)
def test_nothing_outside_the_run_folder_is_served(served: DashboardServer, path: str) -> None:
    resp = request(served, "GET", path)
    assert 400 <= resp.status < 500 and b"secret" not in resp.body, (path, resp.status)


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "BREW"])
def test_only_get_and_head(served: DashboardServer, method: str) -> None:
    resp = request(served, method, "/r.loss.json")
    assert resp.status == 405 and resp.getheader("Allow") == "GET, HEAD"


def test_a_foreign_host_header_is_refused(served: DashboardServer) -> None:
    """DNS rebinding: a page on evil.example resolving to 127.0.0.1 must not read the run."""
    resp = request(served, "GET", "/r.loss.json", {"Host": f"evil.example:{served.httpd.port}"})
    assert resp.status == 403
    assert request(served, "GET", "/r.loss.json", {"Host": f"localhost:{served.httpd.port}"}).status == 200


def test_a_port_in_use_is_one_clear_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServeError, match=f"port {port} on 127.0.0.1 is in use") as err:
            DashboardServer(tmp_path, "r", port)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, InputError)


def test_standalone_names_its_own_port_flag(tmp_path: Path) -> None:
    """`python -m microgpt.proxy.dashboard --port N` on a port in use named `--dashboard` (run's flag): it names
    --port (issue 57)."""
    (tmp_path / "r.loss.json").write_text(loss_file("r", 3))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "microgpt.proxy.dashboard", str(tmp_path), "--port", str(port)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and res.stderr.splitlines() == [
        f"error: --port {port}: port {port} on 127.0.0.1 is in use; pick another or 0 for a free one"
    ], res.stderr


def test_a_restarted_dashboard_binds_its_port_at_once(tmp_path: Path) -> None:
    """A page's connection answered and one held open when the dashboard stops: the port's connections wait in
    TIME_WAIT, and a dashboard started again on that port at once found it in use (issue 57)."""
    (tmp_path / "r.loss.json").write_text(loss_file("r", 3))
    first = DashboardServer(tmp_path, "r", 0)
    first.start()
    port = first.httpd.port
    held = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        assert request(first, "GET", "/api/runs").status == 200
        first.close()
    finally:
        held.close()
    again = DashboardServer(tmp_path, "r", port)
    again.start()
    try:
        assert request(again, "GET", "/api/runs").status == 200
    finally:
        again.close()


def test_the_seed_path_is_a_link_to_the_package_page() -> None:
    link = REPO / "scripts" / PAGE_NAME
    assert link.is_symlink() and link.resolve() == PAGE and PAGE.parent.name == "proxy"


def test_standalone_without_a_run_is_one_line_exit_2(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "microgpt.proxy.dashboard", str(tmp_path), "--port", "0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0] == f"error: {tmp_path}: no run here or in its subfolders (a <run>.loss.json or a train.jsonl)"


def test_the_vendored_chart_library_is_served_as_shipped(served: DashboardServer) -> None:
    for name, ctype in (("uPlot.iife.min.js", "text/javascript"), ("uPlot.min.css", "text/css")):
        resp = request(served, "GET", f"/vendor/uplot/{name}")
        assert resp.status == 200 and resp.getheader("Content-Type") == ctype
        assert resp.body == (PAGE.parent / "vendor" / "uplot" / name).read_bytes()
    assert request(served, "GET", "/vendor/uplot/LICENSE").status == 404  # only the two files the page loads
    csp = request(served, "GET", f"/{PAGE_NAME}").getheader("Content-Security-Policy")
    assert "script-src 'self'" in csp and "default-src 'self'" in csp  # no CDN: nothing from elsewhere


def loss_file(run: str, steps: int) -> str:
    train = [
        {
            "step": s,
            "loss": 5 - s / 100,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "tokens_per_s": 1000.0,
            "tokens": 64,
            "time": 1e9 + s,
        }
        for s in range(1, steps + 1)
    ]
    return json.dumps({"format": "microgpt-loss-1", "run": run, "meta": {}, "train": train, "val": [], "marks": []})


def test_a_folder_of_run_folders_is_listed_and_served_by_run_name(tmp_path: Path) -> None:
    for sub, run, steps in (("a", "r1", 10), ("b", "r2", 20)):
        (tmp_path / sub / "ckpt").mkdir(parents=True)
        (tmp_path / sub / f"{run}.loss.json").write_text(loss_file(run, steps))
        (tmp_path / sub / f"{run}.state.json").write_text(json.dumps({"run": run, "status": "done"}))
        (tmp_path / sub / "ckpt" / "x.loss.json").write_text(loss_file("x", 1))  # not a run: a run's subfolder
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "old.loss.json").write_text(loss_file("old", 1))
    server = DashboardServer(tmp_path, None, 0)
    server.start()
    try:
        root = request(server, "GET", "/")
        assert root.status == 302 and root.getheader("Location") == f"/{PAGE_NAME}"  # the page shows every run
        assert json.loads(request(server, "GET", "/api/runs").body) == {"runs": ["a/r1", "b/r2"]}
        ans = json.loads(request(server, "GET", "/api/loss?run=b/r2&width=100").body)
        assert ans["rows"] == 20 and ans["series"]["loss"]["step"] == list(range(1, 21))
        assert json.loads(request(server, "GET", "/api/loss?run=a%2Fr1").body)["rows"] == 10  # the page encodes /
        assert json.loads(request(server, "GET", "/api/state?run=a/r1").body)["status"] == "done"
        for bad in ("a/ckpt/x", "archive/old", "../a/r1", "a/../b/r2", "", "a/r1.loss", "a/r1/"):
            assert request(server, "GET", f"/api/loss?run={bad}").status == 404, bad
        assert request(server, "GET", "/api/samples?run=a/r1").status == 404  # a run without samples yet
        assert request(server, "GET", "/api/loss?run=a/r1&since=abc").status == 400
    finally:
        server.close()


@pytest.mark.parametrize(
    "path",
    [
        "/" + "x" * 300 + ".json",
        "/" + "x" * 300,
        "/api/loss?run=" + "x" * 300,
        "/api/state?run=" + "y" * 300,
        "/" + "z" * 5000 + ".json",
    ],
)
def test_a_very_long_name_is_404_or_414(served: DashboardServer, path: str) -> None:
    """Issue 14: a 300-character name used to reach stat() and escape as ENAMETOOLONG, with no HTTP answer."""
    assert request(served, "GET", path).status in (404, 414)


def test_200_concurrent_requests_are_all_answered(tmp_path: Path) -> None:
    """Issue 14: with the default listen backlog of 5, a burst of 200 connections lost a third of them. The burst
    arrives before the server accepts anything (as when every handler is busy): the backlog alone must hold it."""
    (tmp_path / "r.loss.json").write_text('{"format": "microgpt-loss-1"}')
    server = DashboardServer(tmp_path, "r", 0)
    n, host = 200, f"127.0.0.1:{server.httpd.port}"

    def connect(_: int) -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", server.httpd.port), timeout=3)
        except OSError:  # a SYN the kernel dropped because the accept queue was full
            return None
        s.sendall(f"GET /r.loss.json HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        return s

    def answer(s: socket.socket | None) -> bytes:
        if s is None:
            return b""
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        s.close()
        return data

    try:
        with ThreadPoolExecutor(n) as pool:
            socks = list(pool.map(connect, range(n)))
        server.start()
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(answer, socks))
    finally:
        server.close()
    assert sum(a.startswith(b"HTTP/1.0 200") and a.endswith(b'"microgpt-loss-1"}') for a in answers) == n


def test_a_client_that_hangs_up_mid_answer_prints_no_traceback(tmp_path: Path) -> None:
    """Issue 14: a page reload or a cancelled fetch is not an error; the server logs the request and goes on."""
    (tmp_path / "r.loss.json").write_text(loss_file("r", 100_000))  # ~10 MB: larger than the socket buffers
    cmd = [sys.executable, "-m", "microgpt.proxy.dashboard", str(tmp_path), "--port", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        port = int(re.match(r"dashboard: http://127\.0\.0\.1:(\d+)/", proc.stderr.readline()).group(1))
        for _ in range(5):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(f"GET /r.loss.json HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            assert s.recv(100).startswith(b"HTTP/1.0 200")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
            s.close()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("HEAD", "/r.loss.json")
        assert conn.getresponse().status == 200  # still serving
        conn.close()
    finally:
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=30)[1]
    assert proc.returncode == 0
    assert "Traceback" not in err and "Error" not in err, err


def test_a_half_written_history_is_503_until_complete(tmp_path: Path) -> None:
    (tmp_path / "r.loss.json").write_text(loss_file("r", 50)[:700])  # a copy in progress, not the proxy's writer
    server = DashboardServer(tmp_path, "r", 0)
    server.start()
    try:
        resp = request(server, "GET", "/api/loss?run=r")
        assert resp.status == 503 and resp.getheader("Retry-After") == "1" and b"not readable yet" in resp.body
        (tmp_path / "r.loss.json").write_text(loss_file("r", 50))
        assert json.loads(request(server, "GET", "/api/loss?run=r").body)["last_step"] == 50
    finally:
        server.close()


def test_a_missing_folder_is_one_line_exit_2(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "microgpt.proxy.dashboard", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 2 and res.stderr == f"error: {tmp_path / 'nope'}: no such folder\n"
