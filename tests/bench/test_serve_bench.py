"""bench/serve.py on the CPU (its smoke check): the real `microgpt serve` on the tiny random model, two streamed
completions at once. Each stream's text must be the model's own continuation of its prompt for its seed, as many
tokens as its usage says; the totals and rates must add up. Also: a server that does not come up is reported with
its output, and a terminated bench leaves no server behind. No timing is asserted."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import serve
from bench.decode import random_checkpoint
from microgpt.data.tokenizer import load_tokenizer
from microgpt.use.sample import Sampling, generate, load
from tests.conftest import REPO, json_lines

FIELDS = {"streams", "max_batch", "backend", "precision", "model", "completion_tokens", "total_tokens", "wall_s",
          "tokens_per_s", "stream_tokens_per_s", "ttft_s", "alone", "batching_gain", "ended_early", "finish_reasons",
          "same_as_alone", "server_rc"}  # fmt: skip


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/serve.py", "--device", "cpu", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)  # fmt: skip


def test_two_streams_get_the_models_tokens_and_the_rates_add_up(tmp_path: Path) -> None:
    """Temperature 1 with a seed per stream: the streams' texts differ, so a row mixed up with another shows."""
    res = bench("--streams", "2", "--tokens", "6", "--temperature", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = json_lines(res.stdout)
    assert FIELDS <= row.keys() and row["server_rc"] == 0
    assert (row["streams"], row["max_batch"], row["backend"], row["precision"]) == (2, 2, "numpy", "fp32")
    gen, tok, _ = load(str(random_checkpoint("tiny", tmp_path)[2]), 1)
    streams = zip(row["prompts"], row["seeds"], row["texts"], row["completion_tokens"], row["finish_reasons"])
    for i, (prompt, seed, text, n, finish) in enumerate(streams):
        ids = generate(gen, tok.encode(prompt), n, Sampling(1.0), [seed])[0]
        if finish == "stop":  # the end of document: counted in usage, not in the text
            assert ids[-1] == tok.eot_id and {"stream": i, "tokens": n, "finish_reason": "stop"} in row["ended_early"]
            ids = ids[:-1]
        else:
            assert (finish, n) == ("length", 6)
        assert text == tok.decode(ids) and tok.eot_id not in ids
    assert len(set(row["texts"])) == 2 and row["same_as_alone"] == 2
    assert row["total_tokens"] == sum(row["completion_tokens"]) == sum(row["alone"]["completion_tokens"])
    assert [e["stream"] for e in row["ended_early"]] == [i for i, n in enumerate(row["completion_tokens"]) if n < 6]
    assert math.isclose(row["tokens_per_s"], row["total_tokens"] / row["wall_s"])
    rates = [row["tokens_per_s"], row["batching_gain"], row["alone"]["tokens_per_s"]]
    rates += row["stream_tokens_per_s"].values()
    assert all(math.isfinite(r) and r > 0 for r in rates)
    assert 0 < row["ttft_s"]["median"] <= row["ttft_s"]["max"] < row["wall_s"]


def test_a_server_that_does_not_come_up_is_shown(tmp_path: Path) -> None:
    res = bench("--checkpoint", str(tmp_path / "nothing"), "--streams", "2")
    assert res.returncode == 1 and res.stdout == ""
    assert "error: serve exited with status 2 before answering" in res.stderr
    assert f"error: {tmp_path / 'nothing'}: no such run folder or checkpoint" in res.stderr


def test_a_terminated_bench_stops_its_server() -> None:
    """SIGTERM (what `timeout` sends) while the bench waits for serve: serve is stopped before the bench exits."""
    proc = subprocess.Popen([sys.executable, "bench/serve.py", "--device", "cpu", "--streams", "2"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + 60
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
