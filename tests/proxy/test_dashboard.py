"""The dashboard server: the page and the run folder's JSON over GET/HEAD on 127.0.0.1; nothing else, ever."""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
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
    assert page.status == 200 and b"<canvas" in page.body and page.getheader("Content-Type").startswith("text/html")
    loss = request(served, "GET", "/r.loss.json")
    assert loss.status == 200 and loss.body == b'{"format": "microgpt-loss-1"}'
    assert loss.getheader("Content-Type") == "application/json"
    again = request(served, "GET", "/r.loss.json", {"If-None-Match": loss.getheader("ETag")})
    assert again.status == 304 and again.body == b""
    head = request(served, "HEAD", "/r.loss.json")
    assert head.status == 200 and head.body == b"" and head.getheader("Content-Length") == str(len(loss.body))


@pytest.mark.parametrize(
    "path",
    ["/../secret.json", "/%2e%2e/secret.json", "/..%2fsecret.json", "/%2E%2E%2Fsecret.json", "//etc/passwd",
     "/ckpt/step-00000001.state.json", "/ckpt%2fstep-00000001.state.json", "/archive/r.samples.x.json",
     "/link.json", "/.hidden.json", "/r.loss.json%00.html", "/..\\secret.json", "/missing.json", "/ckpt",
     "/r.loss.json/", "/etc/passwd", "/%2Fetc%2Fpasswd"],
)  # fmt: skip
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


def test_the_seed_path_is_a_link_to_the_package_page() -> None:
    link = REPO / "scripts" / PAGE_NAME
    assert link.is_symlink() and link.resolve() == PAGE and PAGE.parent.name == "proxy"


def test_standalone_without_a_run_is_one_line_exit_2(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "microgpt.proxy.dashboard", str(tmp_path), "--port", "0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0] == f"error: {tmp_path}: no <run>.loss.json here (pass --run NAME)"
