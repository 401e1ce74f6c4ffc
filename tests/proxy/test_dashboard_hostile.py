"""The dashboard under hostile input (issue 35): links that point out of the folder (and in), query numbers that
overflow, names outside latin-1, NaN and Infinity in a history, malformed requests, and clients that hold
connections open without finishing their request. Every request gets an answer (a 4xx where it is wrong), nothing
outside the folder is ever sent, and a normal client is answered while a hundred slow ones wait."""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from microgpt import httpd
from microgpt.proxy.dashboard import DashboardServer
from tests.proxy._helpers import ProxyRun, write_exp
from tests.proxy.test_dashboard import loss_file, request

SECRET = b'{"secret": "outside the run folder"}'


def strict(body: bytes) -> object:
    """The body as JSON a browser accepts: NaN or Infinity anywhere fail."""
    return json.loads(body, parse_constant=lambda name: pytest.fail(f"{name} in an answer"))


@pytest.fixture
def linked(tmp_path: Path) -> Iterator[DashboardServer]:
    """A folder of runs where some run files are links: to a file outside, to a file inside, to a folder."""
    root, outside = tmp_path / "runs", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.json").write_bytes(SECRET)
    (outside / "x.loss.json").write_text(loss_file("x", 5))
    (root / "r.loss.json").write_text(loss_file("r", 5))
    (root / "r.state.json").symlink_to(outside / "secret.json")  # a real run whose state is a link out
    (root / "r.samples.json").symlink_to(root / "r.loss.json")  # a link that stays inside: refused as well
    (root / "out.loss.json").symlink_to(outside / "x.loss.json")  # a run that is only a link
    (root / "sub" / "in.loss.json").symlink_to(outside / "x.loss.json")
    (root / "sub" / "ok.loss.json").write_text(loss_file("ok", 3))
    (root / "sub" / "ok.state.json").symlink_to(outside / "secret.json")
    (root / "linkdir").symlink_to(outside, target_is_directory=True)
    os.mkfifo(root / "fifo.json")  # opening a FIFO for reading would wait for a writer forever
    server = DashboardServer(root, None, 0)
    server.start()
    yield server
    server.close()


def test_the_api_follows_no_link_and_lists_no_linked_run(linked: DashboardServer) -> None:
    assert strict(request(linked, "GET", "/api/runs").body) == {"runs": ["r", "sub/ok"]}
    for path in (
        "/api/state?run=r",
        "/api/samples?run=r",
        "/api/state?run=sub/ok",
        "/api/loss?run=out",
        "/api/loss?run=sub/in",
        "/api/state?run=out",
        "/api/loss?run=linkdir/x",
        "/r.state.json",
        "/out.loss.json",
        "/fifo.json",
        "/r.samples.json",
    ):
        resp = request(linked, "GET", path)
        assert resp.status == 404 and b"secret" not in resp.body, (path, resp.status, resp.body)
    assert strict(request(linked, "GET", "/api/loss?run=r").body)["rows"] == 5  # the real files still serve
    assert strict(request(linked, "GET", "/api/loss?run=sub/ok").body)["rows"] == 3
    assert request(linked, "GET", "/r.loss.json").body == loss_file("r", 5).encode()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[DashboardServer]:
    """A run with a normal history, one whose history holds NaN, Infinity and 1e999, and one named outside latin-1."""
    (tmp_path / "r.loss.json").write_text(loss_file("r", 20))
    rows = [
        {"step": 1, "loss": 3.0, "lr": "NaN", "grad_norm": 1.0, "time": 1.0},
        {"step": 2, "loss": "NaN", "lr": 1e-3, "grad_norm": "Infinity", "time": 2.0},
        {"step": 3, "loss": "-Infinity", "lr": 1e-3, "grad_norm": "1e999", "time": "NaN"},
        {"step": 4, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "time": 4.0, "mixture": {"a": "NaN", "b": 0.5}},
    ]
    text = json.dumps(
        {
            "format": "microgpt-loss-1",
            "run": "nan",
            "meta": {"x": "NaN", "y": ["Infinity", 1]},
            "train": rows,
            "val": [{"step": 2, "val_loss": "NaN"}, {"step": 4, "val_loss": 2.0}],
            "marks": [{"kind": "stop", "step": 2, "time": "Infinity"}],
        }
    )
    for constant in ("NaN", "-Infinity", "Infinity", "1e999"):  # JSON has none of them: as a writer other than ours
        text = text.replace(f'"{constant}"', constant)
    (tmp_path / "nan.loss.json").write_text(text)
    (tmp_path / "тест☃.loss.json").write_text(loss_file("тест☃", 7))
    server = DashboardServer(tmp_path, None, 0)
    server.start()
    yield server
    server.close()


def test_nan_and_infinity_in_a_history_are_left_out_of_a_valid_answer(served: DashboardServer) -> None:
    for query in ("", "&since=1&vsince=0", "&from=1&to=3", "&width=16"):
        resp = request(served, "GET", f"/api/loss?run=nan{query}")
        assert resp.status == 200, (query, resp.status, resp.body)
        ans = strict(resp.body)
        series = ans["series"]
        first = 2 if "since" in query else 1
        assert series["loss"]["step"] == [s for s in (1, 4) if s >= first], query  # NaN and -Infinity left out
        assert series["grad_norm"]["step"] == [s for s in (1, 4) if s >= first]  # Infinity and 1e999 too
        assert series["mix:b"]["step"] == [4] and "mix:a" not in series
    ans = strict(request(served, "GET", "/api/loss?run=nan").body)
    assert ans["meta"] == {"x": None, "y": [None, 1]} and ans["marks"][0]["time"] is None
    assert ans["val"] == {"step": [4], "y": [2.0]}


@pytest.mark.parametrize(
    "query",
    [
        "since=inf",
        "width=1e999",
        "from=nan",
        "to=-inf",
        "since=1e300",
        "vsince=1e20",
        "width=" + "9" * 1000,
        "since=1.5",
        "to=0x10",
        "width=",
        "since=--1",
    ],
)
def test_query_numbers_that_overflow_or_are_not_integers_are_400(served: DashboardServer, query: str) -> None:
    resp = request(served, "GET", f"/api/loss?run=r&{query}")
    if query == "width=":  # an empty parameter is an absent one
        assert resp.status == 200
        return
    key = query.split("=")[0]
    assert resp.status == 400 and f"{key} must be an integer".encode() in resp.body, (query, resp.status, resp.body)
    assert request(served, "GET", "/api/loss?run=r&since=10").status == 200  # and the server still answers


def test_names_outside_latin_1_are_answered(served: DashboardServer) -> None:
    assert "тест☃" in strict(request(served, "GET", "/api/runs").body)["runs"]
    ans = strict(request(served, "GET", "/api/loss?run=%D1%82%D0%B5%D1%81%D1%82%E2%98%83").body)
    assert ans["rows"] == 7
    for path in (
        "/api/loss?run=%E2%98%83",
        "/api/state?run=%E6%97%A5%E6%9C%AC",
        "/api/samples?run=%F0%9F%98%80",
        "/%E2%98%83.json",
        "/api/loss?run=%FF%FE",
    ):
        resp = request(served, "GET", path)
        assert resp.status == 404, (path, resp.status)
    assert "no run '☃' here" in request(served, "GET", "/api/loss?run=%E2%98%83").body.decode()


def raw_exchange(server: DashboardServer, data: bytes, timeout: float = 10) -> bytes:
    """Send bytes as they are; everything the server answers before it closes."""
    with socket.create_connection(("127.0.0.1", server.httpd.port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_malformed_requests_get_a_4xx(served: DashboardServer) -> None:
    host = f"Host: 127.0.0.1:{served.httpd.port}\r\n".encode()
    cases = {
        b"GARBAGE\r\n\r\n": b"400",
        b"GET /r.loss.json\r\n\r\n": b"400",  # no version
        b"GET http://evil.example/r.loss.json HTTP/1.0\r\n" + host + b"\r\n": b"400",  # not a path
        b"GET /r.loss.json HTTP/1.0\r\n" + host + b"no colon here\r\n\r\n": b"400",
        b"GET /r.loss.json HTTP/1.0\r\n" + host + host + b"\r\n": b"400",  # Host twice
        b"GET /r.loss.json HTTP/1.0\r\n" + host + b" folded: header\r\n\r\n": b"400",
        b"GET /r.loss.json HTTP/1.0\r\n" + host + b"X: " + b"a" * (httpd.MAX_HEAD + 10) + b"\r\n\r\n": b"431",
        b"GET /api/loss?" + b"&".join(b"a=%d" % i for i in range(100)) + b" HTTP/1.0\r\n" + host + b"\r\n": b"400",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)) + b"\r\n\r\n": b"400",  # a TLS hello
    }
    for data, code in cases.items():
        answer = raw_exchange(served, data)
        assert answer.startswith(b"HTTP/1.0 " + code), (data[:60], answer[:80])
    ok = raw_exchange(served, b"GET /r.loss.json HTTP/1.0\r\n" + host + b"\r\n")
    assert ok.startswith(b"HTTP/1.0 200") and ok.endswith(loss_file("r", 20).encode())


def slow_clients(server: DashboardServer, n: int) -> list[socket.socket]:
    """n connections that never finish a request: half of them send nothing, half stop inside the request line."""
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", server.httpd.port), timeout=10)
        if i % 2:
            s.sendall(b"GET /api/loss?run=r HTTP/1.0\r\nHost: 127.0.0.1")
        socks.append(s)
    return socks


def still_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:  # nothing yet, and not closed
        return True
    except ConnectionError:
        return False


ANSWER_BOUND_S = 1.0  # the bound for a normal request while slow clients hold connections


def answered_within(server: DashboardServer, path: str) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", server.httpd.port, timeout=ANSWER_BOUND_S)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.body = resp.read()
    except TimeoutError:
        pytest.fail(f"GET {path}: no answer within {ANSWER_BOUND_S} s while slow clients hold connections open")
    finally:
        conn.close()
    return resp


def test_a_hundred_slow_clients_do_not_stall_a_normal_one(served: DashboardServer) -> None:
    socks = slow_clients(served, 100)
    try:
        time.sleep(0.2)  # let the server accept them all (before: 32 of them took every handler)
        for path in ("/api/runs", "/api/loss?run=r&width=100", "/r.loss.json", "/live-loss-dashboard.html"):
            for _ in range(3):
                assert answered_within(served, path).status == 200, path
        assert all(still_open(s) for s in socks)  # held open, not dropped to make the answers possible
    finally:
        for s in socks:
            s.close()


def test_a_slow_head_is_cut_at_its_deadline(served: DashboardServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline is for the whole head, not per byte: a client that trickles bytes is answered 408 and closed."""
    monkeypatch.setattr(httpd, "HEAD_DEADLINE_S", 0.5)
    with socket.create_connection(("127.0.0.1", served.httpd.port), timeout=10) as s:
        start = time.monotonic()
        for byte in b"GET /r.loss.json HTTP/1.0\r\n":
            try:
                s.sendall(bytes([byte]))
            except ConnectionError:
                break
            time.sleep(0.05)
            if time.monotonic() - start > 5:
                break
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.0 408"), answer


def test_past_the_connection_cap_the_oldest_waiting_head_makes_room(
    served: DashboardServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(httpd, "MAX_CONNECTIONS", 40)
    socks = slow_clients(served, 60)
    try:
        time.sleep(0.3)
        assert answered_within(served, "/api/runs").status == 200
        alive = [still_open(s) for s in socks]
        assert not any(alive[:20]) and all(alive[-20:]), alive  # the oldest went first; the newest still wait
    finally:
        for s in socks:
            s.close()


def test_the_live_run_dashboard_answers_hostile_requests(tmp_path: Path) -> None:
    """`microgpt run --dashboard`: the same answers from the server of a live run, which goes on training."""
    exp = write_exp(tmp_path, train={"steps": 100_000, "ckpt_every": 100_000, "eval_every": 100_000})
    run = ProxyRun(exp, tmp_path / "run", "--dashboard", "0")
    try:
        url = run.wait_for(lambda: (run.file("state") or {}).get("dashboard"), "the dashboard's url")
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        run.wait_for(lambda: len(run.steps()) >= 3, "three steps")
        (tmp_path / "run" / "link.loss.json").symlink_to(tmp_path / "run" / "proxy-test.loss.json")

        def get(path: str) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", path)
            status = conn.getresponse().status
            conn.close()
            return status

        assert [
            get(p)
            for p in (
                "/api/loss?run=proxy-test&since=inf",
                "/api/loss?run=proxy-test&width=1e999",
                "/api/loss?run=%E2%98%83",
                "/api/loss?run=link",
                "/api/state?run=link",
            )
        ] == [400, 400, 404, 404, 404]
        assert get("/api/loss?run=proxy-test&since=1") == 200
        done = len(run.steps())
        run.wait_for(lambda: len(run.steps()) > done, "the run to go on")
    finally:
        run.kill()


@pytest.mark.parametrize(
    "step, card",
    [
        ({"time": 1e12}, {"samples": 5}),  # a time past any date; samples that are no list
        ({"time": -1e300}, {"samples": [5, {"prompt": 3, "text": ["x"], "seed": "s"}], "checkpoints": [7]}),
        ({"time": 2**53}, {"samples": {"a": 1}, "checkpoints": "x"}),
    ],
)
def test_a_train_folder_with_values_of_the_wrong_kind_is_served(tmp_path: Path, step: dict, card: dict) -> None:
    """A `microgpt train` folder whose log record says `time` 1e12 made /api/state a 500 (a date past year 9999);
    a report card saying `"samples": 5` did the same to /api/samples (issue 57). Every value the dashboard reads
    passes one check (dashdata.field_of): a value of the wrong kind is left out, the answer is 200."""
    start = {"event": "start", "run": "r", "step": 0, "config": {"train": {"steps": 5}}, "pid": None, "time": 1.7e9}
    records = [start, {"event": "step", "step": 1, "loss": 2.0, **step}, {"event": "done", "step": 1}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "report.json").write_text(json.dumps(card))
    server = DashboardServer(tmp_path, None, 0)
    server.start()
    try:
        state = request(server, "GET", "/api/state?run=r")
        assert state.status == 200, state.body
        assert strict(state.body)["status"] == "done" and strict(state.body)["step"] == 1
        samples = request(server, "GET", "/api/samples?run=r")
        assert samples.status == 200, samples.body
        for s in strict(samples.body)["samples"]:
            assert s["prompt"] is None and s["text"] == "" and s["step"] is None
        loss = request(server, "GET", "/api/loss?run=r")
        assert loss.status == 200 and strict(loss.body)["clock"]["time"] == [None]
    finally:
        server.close()
