"""serve's HTTP edge (issue 49): every request gets an HTTP answer in OpenAI's error shape, whatever its bytes (a
lone surrogate in the text, a role that is no string, a target urlsplit refuses, a Content-Length isdigit takes and
int does not); slow clients, of the head or of the body, cannot keep a normal request waiting; a stop with
half-open connections and a stream in flight is quiet and ends the stream with an error event."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import time

import openai
import pytest

from microgpt import httpd
from tests.test_serve import HI, raw, served, start, wait_for

SURROGATE = '"\\ud800 lone"'  # JSON text: a lone surrogate, which json.loads takes and no tokenizer encodes


def body_of(port: int, data: bytes) -> tuple[int, dict]:
    """data sent as it is; the status and OpenAI's error object of the answer (it must be JSON)."""
    return raw(port, data.decode("latin-1"))


@pytest.fixture(scope="module")
def api(run_256):
    with served(run_256, "--max-batch", "2", "--queue", "4") as s:
        yield s


def port_of(url: str) -> int:
    return int(url.split(":")[2].split("/")[0])


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", '{"model": "tiny-test", "prompt": %s}' % SURROGATE, "prompt"),
        ("/v1/completions", '{"model": "tiny-test", "prompt": ["ok", %s]}' % SURROGATE, "prompt[1]"),
        ("/v1/completions", '{"model": "tiny-test", "prompt": "ok", "stop": [%s]}' % SURROGATE, "stop"),
        (
            "/v1/chat/completions",
            '{"model": "tiny-test", "messages": [{"role": "user", "content": %s}]}' % SURROGATE,
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            '{"model": "tiny-test", "messages": [{"role": "user", "content": [{"type": "text", '
            '"text": %s}]}]}' % SURROGATE,
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            '{"model": "tiny-test", "messages": [{"role": ["user"], "content": "hi"}]}',
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            '{"model": "tiny-test", "messages": [{"role": {"a": 1}, "content": "hi"}]}',
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            '{"model": "tiny-test", "messages": [{"role": 3, "content": "hi"}]}',
            "messages[0].role",
        ),
        ("/v1/chat/completions", '{"model": %s, "messages": [{"role": "user", "content": "hi"}]}' % SURROGATE, "model"),
        ("/v1/completions", '{"model": "tiny-test", "prompt": [1, 2, 999]}', "prompt"),
        ("/v1/completions", '{"model": "tiny-test", "prompt": [[1, 2], []]}', "prompt"),
        ("/v1/completions", '{"model": "tiny-test", "prompt": "x", "logprobs": 6}', "logprobs"),
        ("/v1/completions", '{"model": "tiny-test", "prompt": "x", "max_tokens": 0}', "max_tokens"),
    ],
)
def test_text_json_takes_and_no_tokenizer_does_is_a_400(api, path: str, body: str, param: str) -> None:
    _, _, url = api
    data = body.encode()
    code, err = body_of(port_of(url), f"POST {path} HTTP/1.0\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    assert code in (400, 404) and err["param"] == param and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize(
    "head",
    [
        b"GET //[ HTTP/1.0\r\n\r\n",
        b"GET //[::1/v1/models HTTP/1.0\r\n\r\n",
        b"POST /v1/completions HTTP/1.0\r\nContent-Length: \xb2\r\n\r\n",  # latin-1's superscript two
        "POST /v1/completions HTTP/1.0\r\nContent-Length: \u0661\r\n\r\n".encode(),  # an Arabic-Indic one
        b"POST /v1/completions HTTP/1.0\r\nContent-Length: +5\r\n\r\n",
    ],
)
def test_heads_the_parser_refuses_are_answered_in_openais_shape(api, head: bytes) -> None:
    _, _, url = api
    code, err = body_of(port_of(url), head)
    assert code == 400 and err["type"] == "invalid_request_error" and err["message"]


def test_a_prompt_past_the_context_names_the_limit_or_is_cut_when_asked(api) -> None:
    a, client, _ = api
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=a.name, prompt="x" * 300, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded" and "context is 256 tokens" in e.value.body["message"]
    cut = client.completions.create(
        model=a.name, prompt="x" * 300, max_tokens=2, extra_body={"truncate_prompt_tokens": 200}
    )
    assert cut.usage.prompt_tokens == 200
    scored = client.completions.create(
        model=a.name, prompt=[[i % 200 + 1 for i in range(257)]], max_tokens=0, echo=True, logprobs=0
    )
    assert len(scored.choices[0].logprobs.token_logprobs) == 257  # scored, never fed: one past the context


def test_slow_heads_and_bodies_do_not_hold_up_a_normal_request(api, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the cap at 40 and 60 slow clients (a third silent, a third inside the head, a third inside the body), a
    chat completion is answered within a second of its send; the real cap (512) is the same mechanism
    (tests/test_httpd.py runs 520 against it)."""
    a, client, url = api
    monkeypatch.setattr(httpd, "MAX_CONNECTIONS", 40)
    socks = []
    for i in range(60):
        s = socket.create_connection(("127.0.0.1", port_of(url)), timeout=10)
        if i % 3 == 1:
            s.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Le")
        elif i % 3 == 2:
            s.sendall(b'POST /v1/chat/completions HTTP/1.0\r\nContent-Length: 500\r\n\r\n{"model": ')
        socks.append(s)
    try:
        time.sleep(0.3)
        for _ in range(3):
            t0 = time.monotonic()
            res = client.with_options(timeout=1.0).chat.completions.create(model=a.name, messages=HI, max_tokens=2)
            assert res.choices[0].finish_reason and time.monotonic() - t0 < 1.0
    finally:
        for s in socks:
            s.close()


def test_a_stop_ends_streams_with_an_error_event_and_prints_no_traceback(run_256) -> None:
    """SIGTERM while a stream waits (the batch of one is taken by a long reply) and half-open connections are held:
    the waiting stream ends with OpenAI's error event, the server exits 0, and its stderr has no traceback."""
    proc, url = start(run_256, "--max-batch", "1", "--queue", "4")
    try:
        port = port_of(url)
        half = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(6)]
        half[1].sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: 50\r\n\r\n{")
        half[2].sendall(b"GET /v1/mod")
        body = json.dumps({"model": "tiny-test", "prompt": "a", "max_tokens": 4000, "stream": True}).encode()
        conns = []
        for _ in range(4):  # the first takes the one row; the others wait for it, the last longest
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            conns.append(conn)
        res = [c.getresponse() for c in conns]
        assert [r.status for r in res] == [200] * 4
        proc.send_signal(signal.SIGTERM)
        tails = [r.read() for r in res]
        assert b'"error"' in tails[-1] and b"shutting down" in tails[-1], tails[-1][-300:]
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err and "serve: stopped" in err, err[-3000:]
        for s in half:
            s.close()
    finally:
        proc.kill()
        proc.wait()


def test_a_client_gone_mid_stream_frees_its_row_and_others_go_on(api) -> None:
    """A streamed reply whose client closes after its first event: its row leaves the batch (held back to 0) while
    another request is answered in full."""
    a, client, url = api
    stream = client.completions.create(model=a.name, prompt="a", max_tokens=4000, stream=True, temperature=0)
    next(iter(stream))
    stream.close()
    res = client.completions.create(model=a.name, prompt="b", max_tokens=5, temperature=0)
    assert res.usage.completion_tokens == 5
    wait_for("the closed stream's row to be freed", lambda: a.engine.held == 0)
