"""bench/decode.py on the CPU (its smoke check): microgpt's NumPy decode step and transformers' generate() on the same
exported weights continue the same prompts with the same greedy tokens, for random weights and for a checkpoint's.
No timing is asserted: the rates only have to be there."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from microgpt import checkpoint
from microgpt.config import Experiment, ModelConfig
from microgpt.engine import params
from tests.conftest import REPO, json_lines

pytest.importorskip("transformers")


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "bench/decode.py", "--device", "cpu", "--repeats", "1", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def same_tokens(rows: list[dict], batches: list[int], new: int) -> None:
    assert [(r["impl"], r["batch"]) for r in rows] == [(i, b) for b in batches for i in ("microgpt", "hf")]
    for r in rows:
        assert "error" not in r, r["error"]
        assert len(r["tokens"]) == r["batch"] and all(len(t) == new for t in r["tokens"])
        assert all(math.isfinite(r[k]) for k in ("prefill_tokens_per_s", "decode_tokens_per_s"))
    for ours, theirs in zip(rows[::2], rows[1::2]):
        assert ours["tokens"] == theirs["tokens"], ours["batch"]


def test_random_weights_give_transformers_tokens() -> None:
    res = bench("--batches", "1", "3")
    assert res.returncode == 0, res.stderr[-3000:]
    same_tokens(json_lines(res.stdout), [1, 3], 8)


def test_a_checkpoints_weights_give_transformers_tokens(tmp_path) -> None:
    """A checkpoint of another shape (5 heads, vocab 300) and a prompt and continuation that fill its context."""
    m = ModelConfig(vocab_size=300, d_model=40, n_layer=1, n_head=5, seq_len=20)
    w = params.init_weights(m, 7)
    w += np.random.default_rng(7).standard_normal(w.shape).astype(np.float32) * 0.1
    meta = {"config": Experiment(name="ck", model=m).to_dict(), "tokenizer": {"kind": "bytes"}}
    ck = checkpoint.write_checkpoint(tmp_path / "step-3.bin", 3, w, np.zeros_like(w), np.zeros_like(w), meta)
    res = bench("--checkpoint", str(ck), "--batches", "2", "--prompt", "12", "--new", "8", "--impls", "microgpt", "hf")
    assert res.returncode == 0, res.stderr[-3000:]
    same_tokens(json_lines(res.stdout), [2], 8)


def test_a_prompt_past_the_context_is_refused() -> None:
    res = bench("--prompt", "60", "--new", "8")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines()[-1].startswith("error: --prompt + --new must be at most seq_len 64")
