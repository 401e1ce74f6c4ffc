"""microgpt sample: top-p, and batched sampling (--num-samples N: N rows of one plan, sample i seeded seed + i)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from microgpt import checkpoint, sample
from microgpt.backend import numpy_backend
from microgpt.config import ConfigError
from microgpt.sample import Sampling, generate, pick
from tests.conftest import cli, one_error

PROMPT = ["--prompt", "def "]


def test_top_p_keeps_the_nucleus_and_is_off_at_one() -> None:
    """top_p keeps the likeliest tokens until their probability reaches p (the likeliest always); at 1 the draws are
    exactly those without it (one draw of the same stream each), at 0 the likeliest token alone."""
    logits = np.log(np.array([0.05, 0.4, 0.3, 0.2, 0.05], np.float32))
    for p, allowed in ((0.3, {1}), (0.41, {1, 2}), (0.69, {1, 2}), (0.71, {1, 2, 3}), (0.0, {1}), (1e-9, {1})):
        rng = np.random.default_rng(0)
        got = {pick(logits, Sampling(1.0, 0, p), rng) for _ in range(300)}
        assert got == allowed, (p, got)
    rng = np.random.default_rng(4)
    off = [pick(logits, Sampling(1.0, 0, 1.0), rng) for _ in range(50)]
    rng = np.random.default_rng(4)
    plain = [int(rng.choice(5, p=np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()))
             for _ in range(50)]  # fmt: skip
    assert off == plain and len(set(off)) > 2
    assert pick(logits, Sampling(0.0, 0, 0.5), np.random.default_rng(0)) == 1


def test_a_batch_draws_each_row_as_its_seed_alone(run_256: Path) -> None:
    """N sequences decoded together (one plan of B = N) give, row by row, what each seed gives alone: greedy, and
    sampled with temperature, top-k and top-p."""
    ld = checkpoint.load_trained(run_256)
    gen1, tok = sample.open_trained(ld, 1)
    gen4, _ = sample.open_trained(ld, 4)
    prompt = tok.encode("def ")
    for s in (Sampling(), Sampling(0.9, 20, 0.9)):
        batch = generate(gen4, prompt, 30, s, [5, 6, 7, 8])
        alone = [generate(gen1, prompt, 30, s, [seed])[0] for seed in (5, 6, 7, 8)]
        assert batch == alone, s
    assert len({tuple(b) for b in batch}) > 1  # sampled: the rows differ


def test_num_samples_from_the_cli(run_256: Path) -> None:
    """--num-samples 3 --json: one line per sample, sample i = `--seed S+i` alone; at temperature 0 each is the
    single greedy sample; N = 1 prints what it always did (one object, no sample index)."""
    many = cli("sample", str(run_256), *PROMPT, "--tokens", "20", "--num-samples", "3", "--seed", "4", "--json",
               "--temperature", "0.8", "--top-p", "0.95")  # fmt: skip
    assert many.returncode == 0, many.stderr
    recs = [json.loads(line) for line in many.stdout.splitlines()]
    assert [(r["sample"], r["seed"]) for r in recs] == [(0, 4), (1, 5), (2, 6)]
    one = cli("sample", str(run_256), *PROMPT, "--tokens", "20", "--seed", "6", "--json", "--temperature", "0.8",
              "--top-p", "0.95")  # fmt: skip
    assert json.loads(one.stdout) == {k: v for k, v in recs[2].items() if k not in ("sample", "seed")}
    greedy = cli("sample", str(run_256), *PROMPT, "--tokens", "40", "--temperature", "0", "--num-samples", "3")
    single = cli("sample", str(run_256), *PROMPT, "--tokens", "40", "--temperature", "0")
    assert greedy.returncode == 0 and single.returncode == 0, greedy.stderr + single.stderr
    parts = greedy.stdout.split("--- sample ")[1:]
    assert len(parts) == 3 and all(p.split("\n", 1)[1] == single.stdout for p in parts)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--top-p", "1.5"], "--top-p (1: off) must be a finite number in [0, 1], got 1.5"),
        (["--top-p", "nan"], "--top-p"),
        (["--num-samples", "0"], "--num-samples must be an integer in [1, 4096], got 0"),
        (["--num-samples", "2", "--seed", str(2**63 - 1)], "--seed (with 2 samples) must be an integer in"),
        (["--chat", "--num-samples", "2"], "--num-samples: sample --chat draws one reply"),
    ],
)
def test_bad_sampling_flags_one_line_exit_2(run_256: Path, flags: list[str], needle: str) -> None:
    one_error(cli("sample", str(run_256), *PROMPT, *flags), 2, needle)


def test_load_takes_the_backend_by_name_or_object(run_256: Path) -> None:
    """sample.load's backend: a name (backend.get_backend, fp32) or a Backend; both give the same greedy tokens."""
    by_name, tok, _ = sample.load(str(run_256), 2, "numpy")
    by_object, _, _ = sample.load(str(run_256), 2, numpy_backend())
    assert by_name.S.B == 2 and by_name.S.K.precision.name == "fp32"
    prompt = tok.encode("def ")
    assert generate(by_name, prompt, 12, Sampling(), [0, 1]) == generate(by_object, prompt, 12, Sampling(), [0, 1])
    with pytest.raises(ConfigError, match="unknown backend 'vulkan'"):
        sample.load(str(run_256), 1, "vulkan")
