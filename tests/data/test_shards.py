"""Shard format: llm.c compatibility, and every header error is one clear line and a non-zero exit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from microgpt.data import prep, shards
from tests.conftest import cli, write_experiment


def llmc_write_datafile(filename: Path, toks: list[int]) -> None:
    """llm.c dev/data/data_common.py write_datafile (model_desc "gpt-2"), verbatim in substance."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(toks)
    toks_np = np.array(toks, dtype=np.uint16)
    with open(filename, "wb") as f:
        f.write(header.tobytes())
        f.write(toks_np.tobytes())


def test_roundtrip_and_llmc_byte_identity(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 65536, size=1001).astype(np.uint16)
    shards.write_shard(tmp_path / "train_000000.bin", toks)
    llmc_write_datafile(tmp_path / "x_train_000001.bin", toks.tolist())
    assert (tmp_path / "train_000000.bin").read_bytes() == (tmp_path / "x_train_000001.bin").read_bytes()
    found = shards.list_shards(tmp_path, "train")
    assert [p.name for p in found] == ["train_000000.bin", "x_train_000001.bin"]
    assert np.array_equal(shards.read_tokens(found), np.concatenate([toks, toks]))
    mask = (toks % 2).astype(np.uint8)
    shards.write_shard(shards.mask_path(found[0]), mask, kind="mask")
    assert shards.list_shards(tmp_path, "train") == found  # masks are not token shards
    assert np.array_equal(shards.open_shard(shards.mask_path(found[0]), "mask"), mask)


def corrupt(path: Path, case: str) -> str:
    """Break one thing in a valid shard; return the field the error must name."""
    raw = bytearray(path.read_bytes())
    if case == "magic":
        raw[0:4] = np.int32(12345).tobytes()
    elif case == "version":
        raw[4:8] = np.int32(7).tobytes()
    elif case == "count":
        raw = raw[:-6]  # truncated: 3 tokens short of the header's count
    elif case == "tokens":
        raw[-2:] = np.uint16(999).tobytes()  # an id >= vocab_size
    path.write_bytes(bytes(raw))
    return case


@pytest.fixture
def shard_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for split in ("train", "val"):
        shards.write_shard(folder / f"{split}_000000.bin", np.arange(300, dtype=np.uint16) % 256)
    return folder


@pytest.mark.parametrize("case", ["magic", "version", "count", "tokens"])
def test_header_errors_via_prep_check(shard_dir: Path, case: str) -> None:
    field = corrupt(shard_dir / "train_000000.bin", case)
    r = cli("prep", "--check", str(shard_dir), "--vocab-size", "512")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {shard_dir / 'train_000000.bin'}: field '{field}'")


def test_check_passes_on_good_shards(shard_dir: Path) -> None:
    assert prep.main(["--check", str(shard_dir), "--vocab-size", "256", "--quiet"]) == 0
    with pytest.raises(shards.ShardError, match="field 'tokens' holds id 255 >= vocab_size 200"):
        prep.main(["--check", str(shard_dir), "--vocab-size", "200"])


def test_train_rejects_a_bad_shard_in_one_line(shard_dir: Path, tmp_path: Path) -> None:
    corrupt(shard_dir / "val_000000.bin", "magic")
    exp = write_experiment(tmp_path, data={"source": "shards", "path": str(shard_dir), "tokenizer": "bytes"})
    r = cli("train", str(exp), "--out", str(tmp_path / "run"))
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [
        f"error: {shard_dir / 'val_000000.bin'}: field 'magic' is 12345, expected 20240520 "
        "(not a microgpt/llm.c tokens shard)"
    ]
    assert not (tmp_path / "run" / "ckpt").exists()


def test_llmc_shard_names_are_found(tmp_path: Path) -> None:
    """llm.c names its shards <set>_train.bin (TinyStories, tinyshakespeare) or <set>_train_000001.bin (FineWeb);
    both are shards of their split, and a mask or another split's file is not."""
    names = [
        "TinyStories_train.bin",
        "TinyStories_val.bin",
        "fineweb_train_000001.bin",
        "fineweb_val_000000.bin",
        "train_000000.bin",
        "train_000000.mask.bin",
        "notes_trainer.bin",
        "training.bin",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in shards.list_shards(tmp_path, "train")] == [
        "TinyStories_train.bin",
        "fineweb_train_000001.bin",
        "train_000000.bin",
    ]
    assert [p.name for p in shards.list_shards(tmp_path, "val")] == ["TinyStories_val.bin", "fineweb_val_000000.bin"]


def test_train_on_llmc_tinystories_named_shards(tmp_path: Path) -> None:
    """A folder as llm.c's dev/data/tinystories.py leaves it (TinyStories_train.bin, TinyStories_val.bin, written by
    llm.c's own writer) trains as data.source "shards", and its validation reads the _val file."""
    folder = tmp_path / "tinystories"
    folder.mkdir()
    rng = np.random.default_rng(3)
    llmc_write_datafile(folder / "TinyStories_train.bin", rng.integers(0, 256, size=3000).tolist())
    llmc_write_datafile(folder / "TinyStories_val.bin", rng.integers(0, 256, size=700).tolist())
    exp = write_experiment(
        tmp_path,
        data={"source": "shards", "path": str(folder), "tokenizer": "bytes"},
        train={"steps": 2, "eval_every": 2},
    )
    r = cli("train", str(exp), "--out", str(tmp_path / "run"), "--json")
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2]
    (val,) = [e for e in events if e["event"] == "eval"]
    assert 4.0 < val["val_loss"] < 7.0  # about ln 256 = 5.55 for uniform random bytes
    assert (tmp_path / "run" / "ckpt" / "step-00000002.bin").exists()
