"""microgpt serve: the OpenAI-compatible API, checked with the official `openai` client as the real client against a
real server (in this process where the test must hold the decode loop still, else the CLI in a subprocess) on a
3-step run's checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from microgpt import checkpoint
from microgpt.data.chatml import prompt_text
from microgpt.data.tokenizer import EOT
from microgpt.use import oai, serve
from microgpt.use.sample import Sampling, generate, load
from tests.conftest import REPO, cli, one_error

HI = [{"role": "user", "content": "hi"}]


@contextmanager
def served(run: Path, *flags: str, decoding: bool = True) -> Iterator[tuple[serve.Api, openai.OpenAI, str]]:
    """serve.build's routes and transport on a free port, the transport running; the decode loop too unless
    decoding is False (the test starts it: requests wait in the queue until then). The api, a client, the URL."""
    api, server = serve.build(serve.parser().parse_args([str(run), "--port", "0", *flags]))
    server.start()
    if decoding:
        api.engine.start()
    url = f"http://127.0.0.1:{server.port}/v1"
    try:
        yield api, openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120), url
    finally:
        api.engine.stop()
        server.stop()


@pytest.fixture(scope="module")
def api(run_256: Path) -> Iterator[tuple[serve.Api, openai.OpenAI, str]]:
    with served(run_256, "--max-batch", "2", "--queue", "2") as s:
        yield s


def wait_for(what: str, cond) -> None:
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline, f"waited 60 s for {what}"
        time.sleep(0.01)


def post(url: str, body: bytes, method: str = "POST") -> tuple[int, dict]:
    """A raw request (what the openai client would never send); its status and JSON body."""
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as res:
            return res.status, json.load(res)
    except urllib.error.HTTPError as e:
        assert e.headers["Content-Type"] == "application/json"
        return e.code, json.load(e)


def test_models_and_a_chat_reply_streamed_as_whole(api) -> None:
    """GET /v1/models names the run; a seeded chat reply streamed (role first, deltas, finish, usage) is the
    non-streamed reply of the same seed."""
    a, client, _ = api
    assert [m.id for m in client.models.list()] == [a.name] == ["tiny-test"]
    assert client.models.retrieve(a.name).owned_by == "microgpt"
    kw = {"model": a.name, "messages": HI, "max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 3}
    whole = client.chat.completions.create(**kw)
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_completions_are_samples_greedy_continuation_and_stop(api, run_256: Path) -> None:
    """A completion at temperature 0 is sample.generate's greedy continuation of the prompt's ids (cut at the
    end of document), streamed or not; with a stop string from that text it ends before the stop's first
    occurrence, "stop"; an empty prompt starts a new document."""
    a, client, _ = api
    res = client.completions.create(model=a.name, prompt="def ", max_tokens=30, temperature=0)
    ids = a.tok.encode("def ")
    greedy = generate(load(str(run_256), 1)[0], ids, 30, Sampling(), [0])[0]
    eot = greedy.index(a.tok.eot_id) if a.tok.eot_id in greedy else len(greedy)
    text = a.tok.decode(greedy[:eot]).split(EOT)[0]
    assert res.choices[0].text == text and res.choices[0].finish_reason == ("stop" if eot < 30 else "length")
    stop = text[8:10]
    assert len(stop) == 2
    cut = client.completions.create(model=a.name, prompt="def ", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"
    stops = ["\n\nQ:", "</s>", "zzz", "<|im_end|>", stop]  # 5: as lm-eval's generation tasks send (until + eos)
    for stream in (False, True):
        five = client.completions.create(
            model=a.name, prompt="def ", max_tokens=30, temperature=0, stop=stops, stream=stream
        )
        got = "".join(c.choices[0].text for c in five) if stream else five.choices[0].text
        assert got == text[: text.find(stop)] and all(s not in text[: text.find(stop)] for s in stops)
    streamed = client.completions.create(model=a.name, prompt="def ", max_tokens=30, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text
    empty = client.completions.create(model=a.name, prompt="", max_tokens=5, seed=1)  # a new document: <|endoftext|>
    assert empty.usage.prompt_tokens == 1 and empty.usage.completion_tokens >= 1


def test_two_concurrent_requests_decode_in_one_batch_and_a_third_gets_429(run_256: Path) -> None:
    """With the decode loop held, two requests wait in the batch's two rows (no queue) and a third is refused at
    once with 429 and OpenAI's error body; started, the loop admits both into one batch, and each reply is the one
    its request gets alone."""
    with served(run_256, "--max-batch", "2", "--queue", "0", decoding=False) as (a, client, _):
        reqs = [
            {
                "model": a.name,
                "messages": [{"role": "user", "content": f"tell me {w}"}],
                "max_tokens": 16,
                "temperature": 0.8,
                "seed": s,
            }
            for w, s in (("more", 1), ("a story", 2))
        ]
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(client.chat.completions.create, **r) for r in reqs]
            wait_for("two requests in flight", lambda: a.engine.held == 2)
            with pytest.raises(openai.RateLimitError) as busy:
                client.chat.completions.create(**reqs[0])
            assert busy.value.status_code == 429 and busy.value.response.headers["Retry-After"] == "1"
            assert busy.value.body["code"] == "rate_limit_exceeded" and "2 of its 2 rows" in busy.value.body["message"]
            a.engine.start()  # both waiting: the first pass admits them together
            together = [f.result().choices[0].message.content for f in futures]
        alone = [client.chat.completions.create(**r).choices[0].message.content for r in reqs]
        assert together == alone and together[0] != together[1]


def test_64_concurrent_greedy_streams_each_get_the_text_of_their_request_alone(tmp_path: Path) -> None:
    """64 streamed greedy requests at once (bench/serve.py's client threads, each prompt its own, ignore_eos so that
    every stream runs its max_tokens), in one batch of 64 rows: each stream's text is the one its request gets
    alone, its usage counts every token, and the server ends with no row held. The weights are bench/decode.py's
    random ones, moved off the init (a 3-step run answers nearly every prompt with the same text)."""
    from bench.decode import random_checkpoint
    from bench.serve_client import threads

    ckpt = random_checkpoint("tiny", tmp_path)[2]
    with served(ckpt, "--max-batch", "64", "--queue", "0") as (a, _, url):
        port = int(url.split(":")[2].split("/")[0])
        bodies = [
            (
                k,
                {
                    "model": a.name,
                    "prompt": f"def request_{k}(self, data):"[k % 7 :],
                    "max_tokens": 24,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "ignore_eos": True,
                },
            )
            for k in range(64)
        ]
        alone = [threads(port, [kb], 120)[0] for kb in bodies]
        together = threads(port, bodies, 120)
        assert [r.text for r in together] == [r.text for r in alone]
        assert len({r.text for r in alone}) > 8  # the prompts lead to texts of their own
        assert all(r.tokens == 24 and r.finish == "length" for r in together)
        wait_for("every row released", lambda: a.engine.held == 0)


@pytest.mark.parametrize(
    "kw, param, code",
    [
        ({"model": "gpt-4"}, "model", "model_not_found"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", None),
        ({"messages": []}, "messages", "invalid_type"),
        ({"temperature": 3}, "temperature", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"n": 3}, "n", "invalid_value"),
        ({"stop": [str(i) for i in range(oai.MAX_STOPS + 1)]}, "stop", "invalid_value"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unsupported"),
        ({"messages": [{"role": "user", "content": "x" * 300}]}, "messages", "context_length_exceeded"),
    ],
)
def test_a_bad_request_gets_a_4xx_with_openais_error_body(api, kw: dict, param: str, code: str | None) -> None:
    a, client, _ = api
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(**{"model": a.name, "messages": HI, **kw})
    assert err.value.status_code == (404 if code == "model_not_found" else 400)
    assert err.value.body["param"] == param and err.value.body["code"] == code
    assert err.value.body["type"] == "invalid_request_error" and err.value.body["message"]


def test_the_tokenizer_routes_answer_as_vllms(api) -> None:
    """GET /tokenizer_info, POST /tokenize and /detokenize, as vLLM's (lm-eval's remote tokenizer reads them): the
    checkpoint's tokenizer's ids and text, an end-of-text string that encodes to its id, chat messages as the chat
    route feeds them; a bad body is a 400 naming its field in one line."""
    a, client, url = api
    root = url.removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/tokenizer_info", timeout=60) as res:
        info = json.load(res)
    assert info["model_max_length"] == 256 and info["vocab_size"] == a.model.vocab and info["chat_template"]
    code, eos = post(
        f"{root}/tokenize", json.dumps({"prompt": info["eos_token"], "add_special_tokens": False}).encode()
    )
    assert code == 200 and eos["tokens"] == [a.tok.eot_id]
    text = "def add(a, b):\n    return a + b  # \u00e9 \U0001f600"
    ids = a.tok.encode(text)
    code, got = post(f"{root}/tokenize", json.dumps({"prompt": text, "model": a.name}).encode())
    assert code == 200 and got == {"count": len(ids), "max_model_len": 256, "tokens": ids}
    assert post(f"{root}/detokenize", json.dumps({"tokens": ids}).encode()) == (200, {"prompt": text})
    code, chat = post(f"{root}/tokenize", json.dumps({"messages": HI}).encode())
    reply = client.chat.completions.create(model=a.name, messages=HI, max_tokens=1)
    assert (
        code == 200 and chat["count"] == reply.usage.prompt_tokens and chat["tokens"] == a.tok.encode(prompt_text(HI))
    )
    for route, body, param in [
        ("tokenize", {}, "prompt"),
        ("tokenize", {"prompt": ["a"]}, "prompt"),
        ("tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
        ("tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("tokenize", {"prompt": "x", "model": "gpt-4"}, "model"),
        ("detokenize", {}, "tokens"),
        ("detokenize", {"tokens": [1, True]}, "tokens"),
        ("detokenize", {"tokens": [1, a.model.vocab]}, "tokens"),
    ]:
        code, err = post(f"{root}/{route}", json.dumps(body).encode())
        assert code == (404 if param == "model" else 400), (route, body, code)
        assert err["error"]["param"] == param and "\n" not in err["error"]["message"], (route, body, err)
    assert post(f"{root}/tokenize", b"{bad")[1]["error"]["code"] == "invalid_json"
    assert post(f"{root}/detokenize", b"[1]")[1]["error"]["code"] == "invalid_json"
    assert post(f"{root}/tokenizer_info", b"{}")[0] == 405 and post(f"{root}/tokenize", None, "GET")[0] == 405


def test_requests_no_client_sends_get_json_errors(api) -> None:
    """Bad JSON, a body that is no object, an unknown route or model, the wrong method, a body over the bound, a
    chunked body: 4xx with OpenAI's error body."""
    _, _, url = api
    assert post(f"{url}/chat/completions", b"{bad")[0] == 400
    code, body = post(f"{url}/chat/completions", b"[1, 2]")
    assert code == 400 and body["error"]["code"] == "invalid_json"
    assert post(f"{url}/embeddings", b"{}")[0] == 404
    assert post(f"{url}/models", b"{}")[0] == 405
    assert post(f"{url}/models/gpt-4", None, "GET")[0] == 404
    port = int(url.split(":")[2].split("/")[0])
    big = raw(port, f"POST /v1/completions HTTP/1.1\r\nContent-Length: {serve.MAX_BODY + 1}\r\n\r\n")
    assert big[0] == 413 and "at most 1048576 bytes" in big[1]["message"]  # refused before the body is sent
    chunked = raw(port, "POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
    assert chunked[0] == 411 and chunked[1]["message"].startswith("send the request body with a Content-Length")


def stats(url: str) -> dict:
    """GET /stats: the engine's counters and this side's."""
    with urllib.request.urlopen(url.removesuffix("/v1") + "/stats", timeout=60) as res:
        return json.load(res)


def raw(port: int, request: str) -> tuple[int, dict]:
    """Bytes sent as they are (a request head no client library sends); the answer's status and JSON error."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request.encode())
        head, _, body = b"".join(iter(lambda: sock.recv(65536), b"")).partition(b"\r\n\r\n")
    assert b"\r\nContent-Type: application/json\r\n" in head, head
    return int(head.split()[1]), json.loads(body)["error"]


def start(run: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`microgpt serve` in a subprocess; the process and the URL it printed (its lines before that: `proc.head`)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "microgpt.cli", "serve", str(run), "--port", "0", *flags],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    proc.head = []
    for line in proc.stderr:
        if line.startswith("serve: http://"):
            return proc, line.split()[1]
        proc.head.append(line)
    raise AssertionError(f"serve exited {proc.wait()} without a URL")


def test_the_cli_serves_on_localhost_and_stops_on_sigterm(run_256: Path) -> None:
    """`microgpt serve RUN` binds 127.0.0.1 unless told, answers the openai client's streamed chat, and exits 0 on
    SIGTERM."""
    proc, url = start(run_256)
    try:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        chunks = list(client.chat.completions.create(model="tiny-test", messages=HI, max_tokens=8, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "serve: stopped" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_bad_flags_and_a_port_in_use_are_one_line_errors(run_256: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        one_error(cli("serve", str(run_256), "--port", port), 2, f"--port {port}: the port is in use")
    one_error(cli("serve", str(run_256), "--max-batch", "0"), 2, "--max-batch must be an integer in [1, 4096]")
    one_error(cli("serve", str(run_256), "--port", "70000"), 2, "--port (a TCP port, 0: a free one)")
    one_error(cli("serve", str(run_256), "--host", "no.such.host.invalid", "--port", "0"), 2, "not an address")
    one_error(cli("serve", str(tmp_path / "nothing")), 2, "nothing")


# sitecustomize for serve's two processes: every open of a .bin (a path) appended to $SERVE_OPENS as "PID PATH"
OPENS_HOOK = """import os, sys


def _opens(event, args, log=os.environ["SERVE_OPENS"]):
    if event == "open" and isinstance(args[0], (str, bytes)) and os.fsdecode(args[0]).endswith(".bin"):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {os.path.realpath(args[0])}\\n")


sys.addaudithook(_opens)
"""


def test_the_engine_process_is_the_one_reader_of_the_checkpoint(run_256: Path, tmp_path: Path) -> None:
    """Every open of a .bin in serve's two processes logged (an audit hook each, through sitecustomize): the run
    folder's checkpoint is opened once, by the engine process; the HTTP side opens none, yet names the model, its
    step and its file, and answers with its tokenizer."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(OPENS_HOOK)
    log = tmp_path / "opens.log"
    path = [str(tmp_path / "site"), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    proc, url = start(run_256, env={**os.environ, "PYTHONPATH": os.pathsep.join(path), "SERVE_OPENS": str(log)})
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        res = client.completions.create(model="tiny-test", prompt="def ", max_tokens=4, temperature=0)
        assert res.usage.prompt_tokens == 4 and res.usage.completion_tokens == 4
        engine_pid = stats(url)["engine_pid"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    ckpt = checkpoint.resolve(run_256)
    assert f"serve: tiny-test (step 3, {ckpt}) on cpu" in "".join(proc.head)
    opens = [line.split(" ", 1) for line in log.read_text().splitlines()]
    assert [(int(pid), p) for pid, p in opens if p.startswith(os.path.realpath(run_256))] == [
        (engine_pid, os.path.realpath(ckpt))
    ]
    assert engine_pid != proc.pid


def test_a_bad_checkpoint_is_the_engines_one_error_line(run_256: Path, tmp_path: Path) -> None:
    """A truncated checkpoint: the engine process's reason, naming the file, is serve's one `error:` line, exit 2."""
    ckpt = checkpoint.resolve(run_256)
    bad = tmp_path / ckpt.name
    bad.write_bytes(ckpt.read_bytes()[:-4])
    shutil.copy(checkpoint.sidecar_path(ckpt), checkpoint.sidecar_path(bad))
    one_error(cli("serve", str(bad), "--port", "0"), 2, str(bad))


@pytest.mark.parametrize("chat", [False, True])
def test_a_text_event_is_the_chunk_encoded_whole(chat: bool) -> None:
    """oai.sse_text (the JSON around a token's text encoded once a choice) gives sse()'s bytes for any text."""
    reply = oai.Reply.make("abc", 'a "model" \\ \x00', chat)  # the name holds the mark: encoded whole
    for name in ("tiny-test", reply.model):
        reply = oai.Reply(reply.id, name, chat, reply.created)
        for head in (reply.head(chunk=True), reply.head(chunk=True) | {"usage": None}):
            event = oai.sse_text(head, reply)
            for index, text in [(0, "x"), (1, 'quote " and \\ back'), (0, "é 😀 \u2028\n\t\x00\x1f"), (3, "\ufffd")]:
                want = oai.sse({**head, "choices": [reply.choice(index, text, None, chunk=True)]})
                assert event(index, text) == want


def test_a_stream_whose_client_goes_away_leaves_the_batch(run_256: Path) -> None:
    """A streamed request whose client closes once the answer's head came, before the decode loop starts: the stream
    fails at a write, its job is released unfinished and leaves the batch, and the next request is answered."""
    with served(run_256, "--max-batch", "2", "--queue", "2", decoding=False) as (a, client, url):
        released, release = [], a.engine.release
        a.engine.release = lambda job: (released.append(job.left), release(job))
        body = json.dumps({"model": a.name, "prompt": "def ", "max_tokens": 4000, "stream": True, "temperature": 0})
        with socket.create_connection(("127.0.0.1", int(url.split(":")[2].split("/")[0])), timeout=60) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
            got = b""
            while b"\r\n\r\n" not in got:
                got += sock.recv(65536)
            assert got.startswith(b"HTTP/1.0 200") and a.engine.held == 1
        a.engine.start()
        wait_for("the stream to fail and release its job", lambda: released)
        assert released == [1]  # its one choice unfinished: 252 positions of the context were left
        wait_for("its row to leave the batch", lambda: a.engine.held == 0 and stats(url)["engine"]["active"] == 0)
        assert client.completions.create(model=a.name, prompt="def ", max_tokens=3).usage.completion_tokens >= 1


@pytest.mark.parametrize("skips", [0, 1], ids=["plain", "skips"])
def test_a_modern_block_model_serves_its_own_greedy_tokens_and_logprobs(tmp_path: Path, skips: int) -> None:
    """model.block "modern" through serve: two concurrent greedy completions are sample.generate's continuations,
    and echo's prompt logprobs are the scoring forward's per-token losses (its untied head, its soft-cap); with a
    skip connection too (model.skips: the decode step's kept streams, rows at their own positions)."""
    import numpy as np

    from microgpt.engine.trained import load_trained
    from microgpt.use import evaluate
    from tests.conftest import write_experiment
    from tests.test_modern import MODERN_RUN

    model = {**MODERN_RUN["model"], "skips": skips}
    exp = write_experiment(tmp_path, model=model, train={**MODERN_RUN["train"], "steps": 3})
    assert cli("train", str(exp), "--out", str(tmp_path / "run")).returncode == 0
    run = tmp_path / "run"
    with served(run, "--max-batch", "2") as (a, client, _):
        prompts = ["def ", "import os"]
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: client.completions.create(model=a.name, prompt=p, max_tokens=12,
                                                                    temperature=0), prompts))  # fmt: skip
        for prompt, res in zip(prompts, got):
            greedy = generate(load(str(run), 1)[0], a.tok.encode(prompt), 12, Sampling(), [0])[0]
            assert res.choices[0].text == a.tok.decode(greedy).split(EOT)[0]
        text = "def add(a, b):\n    return a + b\n"
        scored = client.completions.create(model=a.name, prompt=text, max_tokens=0, echo=True, logprobs=1)
    ids = a.tok.encode(text)
    ld = load_trained(run)
    S = evaluate.scorer(ld, evaluate.eval_backend(ld, "numpy", None))
    x, y = np.array([ids[:-1]], np.int32), np.array([ids[1:]], np.int32)
    want = -S.score(x, y)[2][0]
    np.testing.assert_allclose(scored.choices[0].logprobs.token_logprobs[1:], want, atol=1e-4)


# what guidellm 0.8.1 (an outside load generator: bench/serve_guidellm.py) sends, captured from it: GET /health
# before it starts (and again before each benchmark), then each request of a synthetic_text data set's
# output_tokens as below (its prompt words of its own)
GUIDELLM_COMPLETION = {
    "model": "NAME",
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "max_tokens": 4,
    "ignore_eos": True,
    "prompt": "1 0 m0 quick brown fox",
}


def test_guidellms_requests_are_answered_as_it_reads_them(api) -> None:
    """GET /health is 200 while the engine takes requests (guidellm refuses to start on a 404) and 503 once it does
    not; guidellm's streamed completion gets every token it asked for and the usage chunk it counts them from."""
    a, _, url = api
    root = url.removesuffix("/v1")
    assert post(f"{root}/health", None, "GET") == (200, {})
    a.engine.gone = "the server is stopping"
    try:
        code, err = post(f"{root}/health", None, "GET")
        assert code == 503 and err["error"]["message"] == "the server is stopping"
    finally:
        a.engine.gone = ""
    body = json.dumps(GUIDELLM_COMPLETION | {"model": a.name}).encode()
    req = urllib.request.Request(f"{url}/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as res:
        assert res.headers["Content-Type"] == "text/event-stream"
        data = [line[6:].strip() for line in res if line.startswith(b"data: ")]
    assert data[-1] == b"[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert "".join(c["text"] for e in events for c in e["choices"])  # sampled (no temperature: OpenAI's 1)
    ids = a.tok.encode(GUIDELLM_COMPLETION["prompt"])
    assert events[-1]["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 4, "total_tokens": len(ids) + 4}
