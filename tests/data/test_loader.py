"""The shard loader: batches are a pure function of (seed, step, micro), even in a fresh process; every
window (so every token) of an epoch is visited exactly once; epochs reshuffle; masks become -1 targets."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from microgpt import config, data, runlock
from microgpt.data import shards

T, B, N_MICRO = 8, 3, 2
LENGTHS = [8 * 5 + 1, 8 * 7 + 4, 8 * 3 + 1]  # 5 + 7 + 3 = 15 windows; the odd tail of shard 2 is unused
W = 15


def write_corpus(folder: Path) -> Path:
    """Three train shards whose token at global position i is i (unique ids identify every window)."""
    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for k, n in enumerate(LENGTHS):
        toks = np.arange(start, start + n, dtype=np.uint16)
        shards.write_shard(folder / f"train_{k:06d}.bin", toks)
        shards.write_shard(shards.mask_path(folder / f"train_{k:06d}.bin"), (toks % 3 != 0).astype(np.uint8), "mask")
        start += n
    shards.write_shard(folder / "val_000000.bin", np.arange(100, dtype=np.uint16))
    shards.write_shard(shards.mask_path(folder / "val_000000.bin"), np.ones(100, dtype=np.uint8), "mask")
    return folder


def experiment(folder: Path, seed: int = 11, loss_mask: bool = False, **train: int) -> config.Experiment:
    return config.from_dict(
        {
            "model": {"vocab_size": 512, "d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": T},
            "train": {"micro_batch": B, "n_micro": N_MICRO, "seed": seed, **train},
            "data": {"source": "shards", "path": str(folder), "tokenizer": "bytes", "loss_mask": loss_mask},
        }
    )


def digest(loader: data.Loader, keys: list[tuple[int, int]]) -> str:
    h = hashlib.sha256()
    for step, micro in keys:
        for a in loader.batch(step, micro):
            h.update(a.tobytes())
    return h.hexdigest()


FRESH = """
import sys, json
from pathlib import Path
from tests.data.test_loader import experiment, digest
from microgpt import data
train, _ = data.make_loaders(experiment(Path(sys.argv[1])), {B})
print(digest(train, json.loads(sys.argv[2])))
"""


def test_same_batch_in_a_fresh_process(tmp_path: Path) -> None:
    folder = write_corpus(tmp_path / "c")
    keys = [(9, 1), (0, 0), (4, 1), (2, 0), (30, 1)]  # out of order, and across several epochs
    train, _ = data.make_loaders(experiment(folder), B)
    here = digest(train, keys)
    again, _ = data.make_loaders(experiment(folder), B)
    backwards = {k: digest(again, [k]) for k in keys[::-1]}  # the order of calls does not matter
    assert [backwards[k] for k in keys] == [digest(train, [k]) for k in keys]
    repo = Path(__file__).resolve().parents[2]
    code = FRESH.replace("{B}", str(B))
    r = subprocess.run(
        [sys.executable, "-c", code, str(folder), json.dumps(keys)],
        capture_output=True,
        text=True,
        cwd=repo,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == here
    other, _ = data.make_loaders(experiment(folder, seed=12), B)
    assert digest(other, keys) != here


def windows_of(loader: data.Loader, steps: range) -> list[int]:
    """The window index (first token // T) of every row, in visiting order; checks y is x shifted by one."""
    seen = []
    for step in steps:
        for micro in range(N_MICRO):
            x, y = loader.batch(step, micro)
            assert x.dtype == y.dtype == np.int32 and x.shape == y.shape == (B, T)
            assert np.array_equal(x[:, 1:], y[:, :-1]) and np.array_equal(y[:, -1], x[:, -1] + 1)
            seen += [int(row[0]) for row in x]
    return seen


def test_every_window_of_an_epoch_once_then_reshuffled(tmp_path: Path) -> None:
    train, _ = data.make_loaders(experiment(write_corpus(tmp_path / "c")), B)
    assert train.n_windows == W
    per_step = B * N_MICRO  # 6 rows a step; 5 steps = 30 rows = exactly two epochs of 15 windows
    firsts = windows_of(train, range(2 * W // per_step))
    starts = np.concatenate([[0], np.cumsum(LENGTHS)[:-1]])
    valid = sorted(int(s) + T * k for s, n in zip(starts, LENGTHS) for k in range((n - 1) // T))
    epoch1, epoch2 = firsts[:W], firsts[W:]
    assert sorted(epoch1) == valid and sorted(epoch2) == valid  # every window once per epoch
    assert epoch1 != epoch2  # reshuffled
    covered = np.concatenate([np.arange(f, f + T) for f in epoch1])  # x rows: every token of the epoch once
    assert np.array_equal(np.sort(covered), np.concatenate([np.arange(f, f + T) for f in valid]))


def window_starts() -> np.ndarray:
    """The first token of each of the W windows, in global window order (the corpus's token i is id i)."""
    starts = np.concatenate([[0], np.cumsum(LENGTHS)[:-1]])
    return np.array([int(s) + T * k for s, n in zip(starts, LENGTHS) for k in range((n - 1) // T)])


def test_without_a_batch_warmup_the_old_positions_are_read(tmp_path: Path) -> None:
    """docs/ANDREA.md's formula as it stood before the batch warmup: row r of micro-batch m of step s is position
    p = (s * n_micro + m) * B + r, window perm_e[p mod W] of epoch e = p div W, perm_e from (seed, e, 0xDA7A)."""
    train, _ = data.make_loaders(experiment(write_corpus(tmp_path / "c")), B)
    firsts = window_starts()
    for s in (0, 1, 4, 9, 31):
        for m in range(N_MICRO):
            x, _ = train.batch(s, m)
            for r in range(B):
                e, i = divmod((s * N_MICRO + m) * B + r, W)
                assert x[r, 0] == firsts[np.random.default_rng([11, e, 0xDA7A]).permutation(W)[i]], (s, m, r)


@pytest.mark.parametrize("n_micro, start, steps", [(3, 1, 4), (4, 2, 3), (5, 1, 2), (3, 3, 5), (4, 1, 11)])
def test_micro_schedule_closed_form(n_micro: int, start: int, steps: int) -> None:
    """count(s) rises from batch_warmup_start to n_micro over batch_warmup_steps steps; before(s), the closed form, is
    the sum of the counts of the steps before s; counts(s) are the counts from step s on."""
    t = config.TrainConfig(n_micro=n_micro, batch_warmup_steps=steps, batch_warmup_start=start)
    sch = data.MicroSchedule.of(t)
    counts = [sch.count(s) for s in range(3 * steps + 5)]
    assert counts[0] == start and counts[steps:] == [n_micro] * (len(counts) - steps)
    assert counts == sorted(counts) and all(b - a <= n_micro for a, b in zip(counts, counts[1:]))
    assert all(c == start + s * (n_micro - start) // steps for s, c in enumerate(counts[:steps]))
    assert [sch.before(s) for s in range(len(counts))] == [sum(counts[:s]) for s in range(len(counts))]
    assert all(sch.counts(s) == sorted(set(counts[s:])) for s in range(len(counts)))
    off = data.MicroSchedule.of(config.TrainConfig(n_micro=n_micro, batch_warmup_start=start))
    assert [(off.count(s), off.before(s)) for s in range(9)] == [(n_micro, n_micro * s) for s in range(9)]
    assert off.counts(0) == [n_micro]


def test_a_batch_warmup_cuts_the_same_rows_into_smaller_first_steps(tmp_path: Path) -> None:
    """With a batch warmup step s reads count(s) micro-batches, row r of micro-batch m at position (before(s) + m) B
    + r: steps 0, 1, .. read the warmup-free run's rows in its order, fewer a step at first; data parallel ranks
    read their rows of the same global micro-batches."""
    folder = write_corpus(tmp_path / "c")
    warm = {"n_micro": 3, "batch_warmup_steps": 4, "batch_warmup_start": 1}
    plain, _ = data.make_loaders(experiment(folder, n_micro=3), B)
    train, _ = data.make_loaders(experiment(folder, **warm), B)
    got = [train.batch(s, m) for s in range(9) for m in range(train.micro.count(s))]
    assert [train.micro.count(s) for s in range(9)] == [1, 1, 2, 2, 3, 3, 3, 3, 3] and len(got) == 21
    want = [plain.batch(s, m) for s in range(7) for m in range(3)]
    for (gx, gy), (wx, wy) in zip(got, want, strict=True):
        assert np.array_equal(gx, wx) and np.array_equal(gy, wy)
    with pytest.raises(ValueError, match=r"batch\(step=2, micro=2\): need step >= 0 and 0 <= micro < 2"):
        train.batch(2, 2)
    for rank in range(2):  # two ranks of micro-batch 2 read the rows of one process with 4
        whole, _ = data.make_loaders(experiment(folder, **warm), 4)
        part, _ = data.make_loaders(experiment(folder, **warm), 2, shard=(rank, 2))
        for s, m in ((0, 0), (2, 1), (5, 2), (40, 0)):
            for a, b in zip(part.batch(s, m), whole.batch(s, m)):
                assert np.array_equal(a, b[rank * 2 : rank * 2 + 2]), (rank, s, m)


def test_loss_mask_and_val_batches(tmp_path: Path) -> None:
    folder = write_corpus(tmp_path / "c")
    train, val = data.make_loaders(experiment(folder, loss_mask=True), B)
    x, y = train.batch(3, 1)
    target = x + 1  # y before masking
    assert np.array_equal(y, np.where(target % 3 != 0, target, -1))
    assert list(val.sources) == ["all"] and val.weights == {"all": 1.0}  # one shard set: one validation source
    vx, vy = val.sources["all"].val_batch(0)
    assert np.array_equal(vx[:, 0], [0, 8, 16]) and (vy >= 0).all()
    assert np.array_equal(val.sources["all"].val_batch(4)[0][:, 0], [0, 8, 16])  # 12 val windows: batch 4 wraps around
    with pytest.raises(ValueError, match="micro < 2"):
        train.batch(0, 2)


def test_missing_mask_and_vocab_errors(tmp_path: Path) -> None:
    folder = write_corpus(tmp_path / "c")
    shards.mask_path(folder / "train_000001.bin").unlink()
    with pytest.raises(config.ConfigError, match="train_000001.mask.bin is missing"):
        data.make_loaders(experiment(folder, loss_mask=True), B)
    exp = experiment(folder)
    exp.model.vocab_size = 100  # the corpus holds ids up to 130
    with pytest.raises(shards.ShardError, match="field 'tokens' holds id"):
        data.make_loaders(exp, B)


def test_builtin_bpe_cache_built_on_first_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MICROGPT_DATA_DIR", str(tmp_path))
    exp = config.from_dict(
        {
            "model": {"vocab_size": 384, "d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": 16},
            "train": {"micro_batch": 2, "seed": 3},
            "data": {"source": "builtin", "max_bytes": 40000},
        }
    )
    folder = data.shard_dir(exp)
    assert folder.parent == tmp_path / "builtin" and not folder.exists()
    train, val = data.make_loaders(exp, 2)
    manifest = (folder / "manifest.json").read_bytes()
    x, y = train.batch(0, 0)
    assert x.max() < 384 and val.sources["all"].val_batch(0)[0].shape == (2, 16)
    data.make_loaders(exp, 2)  # second use: the cache is reused, not rebuilt
    assert (folder / "manifest.json").read_bytes() == manifest
    info = data.tokenizer_info(exp, tmp_path / "run")
    assert info["kind"] == "bpe" and Path(info["path"]) == (tmp_path / "run" / "tokenizer.json").resolve()
    assert info["vocab_size"] == 384
    run, moved = tmp_path / "locked", tmp_path / "moved"
    with runlock.acquire(run) as lock:  # the run folder moved aside before the copy: the copy follows the lock
        run.rename(moved)
        run.mkdir()
        data.tokenizer_info(exp, run, lock.anchor)
    assert (
        not any(run.iterdir()) and (moved / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    )


BUILD = """
import sys
from microgpt import config, data, runlock
exp = config.from_dict({"model": {"vocab_size": 300, "d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": 16},
                        "data": {"source": "builtin", "max_bytes": 30000}})
train, _ = data.make_loaders(exp, 2)
print(train.batch(1, 0)[0].sum())
"""


def test_two_processes_build_the_cache_once(tmp_path: Path) -> None:
    env = {**os.environ, "MICROGPT_DATA_DIR": str(tmp_path)}
    repo = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD], cwd=repo, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0] == outs[1][0]  # the same batch
    assert sum(err.count("building the built-in corpus") for _, err in outs) == 1
    assert [p.name for p in (tmp_path / "builtin").iterdir() if p.name.startswith(".")] == []  # no lock file left
