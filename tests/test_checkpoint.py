"""The seed's checkpoint format: exact bytes, atomic writes, validation on read."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from microgpt import checkpoint, fileio
from microgpt.checkpoint import CheckpointError
from microgpt.engine.trained import load_trained


def arrays(n: int, seed: int = 0) -> list[np.ndarray]:
    """Weights, Adam m, Adam v (a mean of squares: never negative)."""
    rng = np.random.default_rng(seed)
    w, m, v = (rng.normal(size=n).astype(np.float32) for _ in range(3))
    return [w, m, np.abs(v)]


def test_layout_is_the_seed_format(tmp_path) -> None:
    w, m, v = arrays(37)
    path = checkpoint.write_checkpoint(tmp_path / "step-00000012.bin", 12, w, m, v, {"seed": 5})
    data = path.read_bytes()
    assert len(data) == 8 + 12 * 37
    assert struct.unpack("<ii", data[:8]) == (12, 37)
    assert np.array_equal(np.frombuffer(data[8 : 8 + 4 * 37], "<f4"), w)
    assert np.array_equal(np.frombuffer(data[8 + 4 * 37 : 8 + 8 * 37], "<f4"), m)
    assert np.array_equal(np.frombuffer(data[8 + 8 * 37 :], "<f4"), v)
    ck = checkpoint.read_checkpoint(path, 37)
    assert ck.step == 12 and all(np.array_equal(a, b) for a, b in zip((ck.weights, ck.m, ck.v), (w, m, v)))
    side = json.loads(checkpoint.sidecar_path(path).read_text())
    assert side["seed"] == 5 and side["n_params"] == 37 and checkpoint.verify_sha(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000012.bin", "step-00000012.state.json"]


def test_overwrite_is_all_or_nothing(tmp_path, monkeypatch) -> None:
    """A write that fails before its rename leaves the old file whole and no temp file behind."""
    path = checkpoint.write_checkpoint(tmp_path / "step-00000001.bin", 1, *arrays(10))
    before = path.read_bytes()

    def no_rename(src, dst, **_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fileio.os, "replace", no_rename)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.write_checkpoint(path, 2, *arrays(10, seed=1))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001.bin", "step-00000001.state.json"]


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d[:5], "shorter than the 8-byte header"),
        (lambda d: d[:-4], "truncated checkpoint"),
        (lambda d: d + b"\0" * 4, "oversized checkpoint"),
        (lambda d: struct.pack("<ii", 3, -1) + d[8:], "corrupt header"),
    ],
)
def test_bad_files_are_one_sentence(tmp_path, mutate, needle) -> None:
    good = checkpoint.write_checkpoint(tmp_path / "good.bin", 3, *arrays(16)).read_bytes()
    bad = tmp_path / "bad.bin"
    bad.write_bytes(mutate(good))
    with pytest.raises(CheckpointError) as err:
        checkpoint.read_checkpoint(bad)
    msg = str(err.value)
    assert needle in msg and str(bad) in msg and "\n" not in msg


def test_wrong_model_size_and_nan(tmp_path) -> None:
    path = checkpoint.write_checkpoint(tmp_path / "a.bin", 3, *arrays(16))
    with pytest.raises(CheckpointError, match="holds 16 parameters but the model has 17"):
        checkpoint.read_checkpoint(path, 17)
    w, m, v = arrays(16)
    w[3] = np.nan
    nan = checkpoint.write_checkpoint(tmp_path / "nan.bin", 3, w, m, v)
    with pytest.raises(CheckpointError, match="NaN"):
        checkpoint.read_checkpoint(nan)


@pytest.mark.parametrize(
    "which, index, value, needle",
    [
        (0, 0, np.inf, "weights contain"),
        (0, 15, -np.inf, "weights contain"),
        (1, 7, np.nan, "Adam m contains"),
        (1, 0, np.inf, "Adam m contains"),
        (2, 9, -1e-30, "Adam v contains"),
        (2, 15, np.nan, "Adam v contains"),
        (2, 3, -0.0, None),
    ],
)
def test_every_value_is_checked(tmp_path, which: int, index: int, value: float, needle: str | None) -> None:
    """A NaN, an infinity (either sign) anywhere in any of the three arrays, or a negative Adam v, is one sentence
    naming the array; -0.0 in v is a square's mean and passes."""
    arrs = arrays(16)
    arrs[which][index] = value
    path = checkpoint.write_checkpoint(tmp_path / "a.bin", 3, *arrs)
    if needle is None:
        assert checkpoint.read_checkpoint(path).v[index] == 0
        return
    with pytest.raises(CheckpointError, match=needle):
        checkpoint.read_checkpoint(path)


def test_a_file_read_in_many_chunks_hashes_as_one(tmp_path, monkeypatch) -> None:
    """The body is read in chunks while a thread hashes them: the digest is the file's, the arrays its bytes (a
    last chunk shorter than the rest included), and a folder is one sentence."""
    monkeypatch.setattr(checkpoint, "READ_CHUNK", 100)
    w, m, v = arrays(1001, seed=3)
    path = checkpoint.write_checkpoint(tmp_path / "a.bin", 9, w, m, v)
    ck = checkpoint.read_checkpoint(path, 1001)
    assert ck.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() and checkpoint.load(path)[0].step == 9
    assert all(np.array_equal(a, b) for a, b in zip((ck.weights, ck.m, ck.v), (w, m, v)))
    assert ck.weights.flags.writeable  # the triton runtime's copy_in wraps it without a copy
    with pytest.raises(CheckpointError, match=r"checkpoint must be a regular file, not a folder$"):
        checkpoint.read_checkpoint(tmp_path)


@pytest.mark.parametrize("kind", ["a named pipe", "a character device"])
def test_a_special_file_is_refused_without_a_read(tmp_path, kind: str) -> None:
    """A named pipe (whose plain open would wait for a writer forever) or /dev/zero (endless): one sentence, at once."""
    path = tmp_path / "p.bin"
    if kind == "a named pipe":
        os.mkfifo(path)
    else:
        path = Path("/dev/zero")
    with pytest.raises(CheckpointError, match=f"checkpoint must be a regular file, not {kind}$"):
        checkpoint.read_checkpoint(path)
    assert checkpoint.read_step(path) is None
    with pytest.raises(CheckpointError, match=f"--resume {path}: checkpoint must be a regular file, not {kind}$"):
        checkpoint.check_flag_path(path, "--resume")


def test_latest_valid_skips_corrupt_and_keeps_it(tmp_path) -> None:
    for step in (100, 200, 300):
        checkpoint.write_checkpoint(tmp_path / checkpoint.ckpt_name(step), step, *arrays(8, step))
    newest = tmp_path / checkpoint.ckpt_name(300)
    newest.write_bytes(newest.read_bytes()[:-1])  # truncated: fails the size check
    middle = tmp_path / checkpoint.ckpt_name(200)
    data = bytearray(middle.read_bytes())
    data[20] ^= 0xFF  # right size, wrong bytes: fails the sidecar's sha256
    middle.write_bytes(bytes(data))
    assert checkpoint.latest_valid_checkpoint(tmp_path, 8) == tmp_path / checkpoint.ckpt_name(100)
    assert newest.exists() and middle.exists()
    assert checkpoint.latest_valid_checkpoint(tmp_path / "missing") is None


def test_a_run_folder_is_read_once(tmp_path, monkeypatch) -> None:
    """load_trained on a run folder reads its newest valid checkpoint once: the read that validates it is the one
    the model is built from (a 1.5 GB ANDREA-120M checkpoint was read twice)."""
    from microgpt import config
    from microgpt.engine import params

    m = config.ModelConfig(vocab_size=20, d_model=8, n_layer=1, n_head=2, seq_len=4)
    exp = config.Experiment(model=m)
    n = params.n_params(m)
    meta = {"config": exp.to_dict(), "params": [[k, list(s)] for k, s in params.param_shapes(m)]}
    for step in (1, 2):
        checkpoint.write_checkpoint(tmp_path / "ckpt" / checkpoint.ckpt_name(step), step, *arrays(n, step), meta)
    reads = []
    real = checkpoint.read_checkpoint
    monkeypatch.setattr(checkpoint, "read_checkpoint", lambda path, n=None: reads.append(path) or real(path, n))
    ld = load_trained(tmp_path)
    assert ld.step == 2 and reads == [tmp_path / "ckpt" / checkpoint.ckpt_name(2)]
    np.testing.assert_array_equal(ld.weights, arrays(n, 2)[0])
