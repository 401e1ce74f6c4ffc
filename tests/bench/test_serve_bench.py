"""bench/serve.py on the CPU (its smoke check): the real `microgpt serve` on the tiny random model, swept over 1 and 2
streams and two prompt kinds, and the chat workload with prefix reuse on and off on a run's checkpoint. Each stream's
text must be the model's own greedy continuation of its prompt (ignore_eos: all of --tokens), the rows' figures must
add up and name the decode step's own rate. Also: a checkpoint that is none and a server that does not come up are
reported in one line (with serve's output), and a terminated bench leaves no server behind; the client processes keep
SIGTERM's default action, and one that dies or stalls, or a server that never answers, is one error line with no
process left behind, not a hang. No timing is asserted."""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench import serve, serve_client
from bench.decode import random_checkpoint
from microgpt.data.tokenizer import load_tokenizer
from microgpt.use.sample import Sampling, generate, load
from tests.conftest import REPO, json_lines

FIELDS = {"streams", "prompt", "prompt_tokens", "completion_tokens", "wall_s", "tokens_per_s", "ttft_ms", "itl_ms",
          "tokens_per_event", "same_as_alone", "finish_reasons", "texts", "decode_step_tokens_per_s",
          "of_decode_step", "prepared_in_row", "padded_rows", "prefill_windows", "engine_ms",
          "engine_steps"}  # fmt: skip


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "bench/serve.py", "--device", "cpu", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def test_the_sweep_rows_are_the_models_tokens_and_add_up(tmp_path: Path) -> None:
    res = bench("--streams", "1", "2", "--prompts", "short", "20", "--tokens", "6", "--repeats", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = json_lines(res.stdout)
    rows, (run,) = lines[:-1], [r["run"] for r in lines[-1:]]
    assert [(r["streams"], r["prompt"]) for r in rows] == [(1, "short"), (2, "short"), (1, "20"), (2, "20")]
    assert run["server_rc"] == 0 and (run["backend"], run["precision"], run["max_batch"]) == ("numpy", "fp32", 2)
    gen, tok, _ = load(str(random_checkpoint("tiny", tmp_path)[2]), 1)
    prompts = serve.Prompts(tok)
    for r in rows:
        assert FIELDS <= r.keys() and r["finish_reasons"] == ["length"] and r["completion_tokens"] == 6 * r["streams"]
        for k, text in enumerate(r["texts"]):
            p = prompts.get(r["prompt"], k)
            ids = generate(gen, tok.encode(p) if isinstance(p, str) else p, 6, Sampling(), [k])[0]
            assert text == tok.decode(ids), (r["streams"], r["prompt"], k)
        assert r["same_as_alone"] == f"{r['streams']}/{r['streams']}"
        assert r["prepared_in_row"] == 0  # every decode step the rows ran was prepared before the server was ready
        phases = r["engine_ms"]  # the engine's loop while the row ran: each phase's share of the row's wall
        assert {"admit", "prefill", "launch", "finish", "model"} <= phases.keys()
        assert all(v >= 0 for v in phases.values()) and phases["model"] <= 1e3 * r["wall_s"]
        assert r["prefill_windows"] == int(r["prefill_windows"]) >= 0
        assert r["engine_steps"] >= r["completion_tokens"] // r["streams"]  # a step a token at least, some rows more
        assert math.isclose(r["tokens_per_s"], r["completion_tokens"] / r["wall_s"])
        assert math.isclose(r["of_decode_step"], r["tokens_per_s"] / r["decode_step_tokens_per_s"])
        assert 0 < r["ttft_ms"]["median"] <= r["ttft_ms"]["p99"] < 1e3 * r["wall_s"]
        assert r["tokens_per_event"] >= 1
        # no gap where every stream's tokens came in one event (serve's HTTP side read the engine's passes together)
        itl = r["itl_ms"]
        assert itl["p99"] >= itl["median"] >= 0 or r["tokens_per_event"] == 6 and math.isnan(itl["p99"])
    table = [line for line in res.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| streams | prompt | tokens/s |") and len(table) == 1 + len(rows)


def test_a_modern_block_checkpoint_is_benched_as_its_own_greedy_tokens(tmp_path: Path) -> None:
    """Issue 56 item 3 on the CPU (dev/gpu_check.sh serve-locust takes SERVE_EXP for the GPU's figures): the sweep on
    a trained modern-block run (its untied head, soft-cap, RoPE and QK-norm in the decode step) gives every stream the
    model's own greedy tokens, and the rows name the decode step's rate at their batch."""
    from tests.conftest import cli, write_experiment
    from tests.test_modern import MODERN_RUN

    exp = write_experiment(tmp_path, model=MODERN_RUN["model"], train={**MODERN_RUN["train"], "steps": 3})
    run = tmp_path / "run"
    assert cli("train", str(exp), "--out", str(run)).returncode == 0
    res = bench("--checkpoint", str(run), "--streams", "1", "2", "--prompts", "short", "--tokens", "6", "--chat", "0")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in json_lines(res.stdout) if "streams" in r]
    gen, tok, _ = load(str(run), 1)
    prompts = serve.Prompts(tok)
    assert [r["streams"] for r in rows] == [1, 2]
    for r in rows:
        assert r["same_as_alone"] == f"{r['streams']}/{r['streams']}" and r["decode_step_tokens_per_s"] > 0
        for k, text in enumerate(r["texts"]):
            ids = generate(gen, tok.encode(prompts.get("short", k)), 6, Sampling(), [k])[0]
            assert text == tok.decode(ids), (r["streams"], k)


def test_many_streams_are_read_from_several_client_processes() -> None:
    """40 streams: three client processes (16 streams each at most), released at one instant, all read to the end."""
    res = bench("--streams", "40", "--prompts", "short", "--tokens", "3", "--repeats", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = [r for r in json_lines(res.stdout) if "streams" in r]
    assert row["completion_tokens"] == 120 and row["same_as_alone"] == "8/8" and row["finish_reasons"] == ["length"]


FLEET = [(k, {}) for k in range(2 * serve_client.CLIENTS_PER_PROC)]  # two client processes


def test_the_client_processes_end_on_sigterm_whatever_the_bench_does_with_it(monkeypatch) -> None:
    """The bench turns SIGTERM into SystemExit; its client processes keep SIGTERM's default action (a forked process
    with the bench's handler, about to wait on a lock when the signal came, ran no handler and never ended)."""
    monkeypatch.setattr(serve_client, "threads", lambda *_, **__: [signal.getsignal(signal.SIGTERM)])
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        assert serve_client.fleet(0, FLEET, 60) == [signal.SIG_DFL, signal.SIG_DFL]
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not multiprocessing.active_children()


def test_a_client_process_that_dies_or_stalls_is_one_error_line_not_a_hang(monkeypatch) -> None:
    """A client process that exits without its runs, or neither reads nor reports for twice the timeout, ends the
    fleet with a BenchError naming it, and no client process is left behind."""
    monkeypatch.setattr(serve_client, "threads", lambda *_, **__: os._exit(3))
    with pytest.raises(serve_client.BenchError, match=r"^client process \d exited with status 3 before sending"):
        serve_client.fleet(0, FLEET, 60)
    assert not multiprocessing.active_children()
    monkeypatch.setattr(serve_client, "threads", lambda *_, **__: threading.Event().wait())
    with pytest.raises(serve_client.BenchError, match=r"^client process \d read nothing and sent no runs for 1 s$"):
        serve_client.fleet(0, FLEET, 0.5)
    assert not multiprocessing.active_children()


def test_a_server_that_never_answers_is_one_error_line_not_a_hang() -> None:
    """Connected (the kernel's backlog) but never answered: each stream gives up after the timeout, and the fleet's
    error names the stream and the wait."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(len(FLEET))
        port = sock.getsockname()[1]
        with pytest.raises(serve_client.BenchError, match=r"^stream \d+ \(POST /v1/completions\): the server sent no"):
            serve_client.fleet(port, FLEET, 0.5)
    assert not multiprocessing.active_children()


def test_the_chat_workload_reuses_prefixes_and_says_how_much(run_256: Path) -> None:
    res = bench(
        "--checkpoint",
        str(run_256),
        "--streams",
        "2",
        "--prompts",
        "short",
        "--chat",
        "2",
        "--turns",
        "2",
        "--system",
        "8",
        "--chat-tokens",
        "4",
        "--repeats",
        "1",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    on, off = (r["chat_row"] for r in json_lines(res.stdout) if "chat_row" in r)
    assert on["prefix_reuse"] and not off["prefix_reuse"]
    # a reused prefix is copied only when it lies in another cache row than the free one the turn takes, which
    # depends on when the turns arrive (tests/test_cache_rows.py covers the copy itself)
    assert on["reused_tokens"] > 0 and 0 <= on["copied_tokens"] <= on["reused_tokens"] and 0 < on["reused_share"] < 1
    assert off["reused_tokens"] == 0 and off["prefill_tokens"] == on["prefill_tokens"] + on["reused_tokens"]


def test_a_checkpoint_that_is_none_and_a_server_that_does_not_come_up_are_shown(tmp_path: Path, run_256) -> None:
    res = bench("--checkpoint", str(tmp_path / "nothing"), "--streams", "2")
    assert res.returncode == 1 and res.stdout == ""
    assert f"error: {tmp_path / 'nothing'}: no such run folder or checkpoint" in res.stderr
    res = bench("--checkpoint", str(run_256), "--streams", "2", "--prompts", "short", "--precision", "bf16")
    assert res.returncode == 1 and "error: serve exited with status 2 before answering" in res.stderr
    assert "error: --precision bf16: the numpy backend runs fp32" in res.stderr  # serve's own line, from its log


def test_a_terminated_bench_stops_its_server() -> None:
    """SIGTERM (what `timeout` sends) while the bench waits for serve: serve is stopped before the bench exits."""
    proc = subprocess.Popen(
        [sys.executable, "bench/serve.py", "--device", "cpu", "--streams", "2"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + 120
    while not children.read_text().split():
        assert time.monotonic() < deadline and proc.poll() is None, "the bench started no server"
        time.sleep(0.01)
    (server,) = map(int, children.read_text().split())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    try:
        os.kill(server, 0)
        raise AssertionError(f"serve (pid {server}) outlived the bench")
    except ProcessLookupError:
        pass


def test_a_random_checkpoint_past_the_bytes_gets_a_bpe_of_its_vocabulary(tmp_path: Path) -> None:
    """Every id of the tokenizer is one the model can draw, and text round-trips (the GPU run's 50304-id case)."""
    record = serve.tokenizer_record(400, tmp_path)
    tok = load_tokenizer(record)
    assert record["kind"] == "bpe" and tok.vocab_size == record["vocab_size"] <= 400 and tok.eot_id == 0
    assert tok.decode(tok.encode("def f(x):\n    return x")) == "def f(x):\n    return x"
    assert serve.tokenizer_record(256, tmp_path)["kind"] == "bytes"
