"""microgpt sample: top-p, and batched sampling (--num-samples N: N rows of one plan, sample i seeded seed + i)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from microgpt.config import ConfigError
from microgpt.engine.backend import numpy_backend
from microgpt.engine.trained import load_trained
from microgpt.use import sample
from microgpt.use.sample import Sampling, generate, pick
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
    plain = [
        int(rng.choice(5, p=np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum())) for _ in range(50)
    ]
    assert off == plain and len(set(off)) > 2
    assert pick(logits, Sampling(0.0, 0, 0.5), np.random.default_rng(0)) == 1


def test_a_batch_draws_each_row_as_its_seed_alone(run_256: Path) -> None:
    """N sequences decoded together (one plan of B = N) give, row by row, what each seed gives alone: greedy, and
    sampled with temperature, top-k and top-p."""
    ld = load_trained(run_256)
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
    many = cli(
        "sample",
        str(run_256),
        *PROMPT,
        "--tokens",
        "20",
        "--num-samples",
        "3",
        "--seed",
        "4",
        "--json",
        "--temperature",
        "0.8",
        "--top-p",
        "0.95",
    )
    assert many.returncode == 0, many.stderr
    recs = [json.loads(line) for line in many.stdout.splitlines()]
    assert [(r["sample"], r["seed"]) for r in recs] == [(0, 4), (1, 5), (2, 6)]
    one = cli(
        "sample",
        str(run_256),
        *PROMPT,
        "--tokens",
        "20",
        "--seed",
        "6",
        "--json",
        "--temperature",
        "0.8",
        "--top-p",
        "0.95",
    )
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


def choice_pick(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    """pick as it was written before it drew without rng.choice's checks and sorted only the nucleus (the
    reference: the tokens of a seed must not change)."""
    if s.temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64)
    with np.errstate(over="ignore"):
        z = (z - z.max()) / s.temperature
    if 0 < s.top_k < z.size:
        z[z < np.partition(z, -s.top_k)[-s.top_k]] = -np.inf
    p = np.exp(z - z.max())
    p /= p.sum()
    if s.top_p < 1:
        order = np.argsort(-p, kind="stable")
        likelier = np.cumsum(p[order]) - p[order]
        drop = likelier >= s.top_p
        drop[0] = False
        p[order[drop]] = 0
        p /= p.sum()
    return int(rng.choice(z.size, p=p))


def test_pick_draws_what_rng_choice_drew() -> None:
    """Random logits (bf16-rounded, so with ties; some -inf; one vocabulary of ANDREA's size), every kind of sampling
    (a subnormal temperature, top-k up to the vocabulary, top-p at 0, tiny, broad, and exactly at a running sum of
    the sorted probabilities): the same token as the reference and the generator left in the same state."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        V = 50304 if trial % 50 == 0 else int(rng.integers(1, 3000))
        logits = (rng.standard_normal(V) * rng.choice([0.1, 1, 4, 30])).astype(np.float32)
        logits = np.round(logits * 8) / 8  # ties
        if trial % 7 == 0:
            logits[rng.integers(0, V, V // 3)] = -np.inf
            logits[rng.integers(0, V)] = 0
        temperature = float(rng.choice([1e-310, 0.3, 0.7, 1.0, 2.0]))
        top_k = int(rng.choice([0, 0, 1, 40, V - 1, V, V + 1]))
        top_p = float(rng.choice([1.0, 1.0, 0.0, 1e-9, 0.5, 0.9, 0.999999]))
        if trial % 5 == 0:  # exactly where the nucleus ends: the sum of the likeliest tokens' probabilities
            z = np.exp(logits.astype(np.float64) - logits.max())
            p = np.sort(z / z.sum())[::-1]
            top_p = float(np.cumsum(p)[int(rng.integers(0, min(V, 50)))])
        s, seed = Sampling(temperature, top_k, top_p), int(rng.integers(1 << 30))
        a, b = np.random.default_rng(seed), np.random.default_rng(seed)
        assert pick(logits, s, a) == choice_pick(logits, s, b), (trial, s)
        assert a.bit_generator.state == b.bit_generator.state
    nan = np.array([0.0, np.nan, 1.0], np.float32)
    for draw in (pick, choice_pick):
        with pytest.raises(ValueError, match="^Probabilities contain NaN$"):
            draw(nan, Sampling(1.0), np.random.default_rng(0))
