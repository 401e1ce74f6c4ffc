"""The output side under hostile conditions (issue 35): every OS error on an output path is one `error:` line, exit 4
for a disk that refuses the write (full, read-only) and exit 2 for a path that cannot be one (a parent that is a
file, a symbolic link), with nothing left behind and every file that was there before unchanged (sha256).

Full and read-only disks are real small tmpfs mounts (root: CAP_SYS_ADMIN); where mounting fails the test is
skipped and says why, except the read-only case, which a non-root user gets from a folder's permissions."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from microgpt.errors import EXIT_WRITE
from tests.conftest import cli, one_error, tmpfs, write_experiment
from tests.test_hostile_input import refused, snapshot


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A folder nothing can be written into: a read-only tmpfs as root, a folder without write permission else."""
    if os.geteuid() != 0:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    with tmpfs(tmp_path / "ro", 1 << 20, read_only=True) as folder:
        yield folder


def failed_write(res: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 4, no traceback, and exactly one `error:` line on stderr, its last (prep's progress lines may come
    before it), holding every needle."""
    return one_error(res, EXIT_WRITE, *needles, after_progress=True)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    exp = write_experiment(root, train={"steps": 2, "ckpt_every": 2})
    assert cli("train", str(exp), "--out", str(root / "run")).returncode == 0
    return root / "run"


# --- export -----------------------------------------------------------------------------------------------------
def test_export_to_a_read_only_folder(run_dir: Path, read_only: Path) -> None:
    before = snapshot(run_dir)
    failed_write(cli("export", str(run_dir), "--out", str(read_only / "hf")), f"--out {read_only / 'hf'}")
    assert list(read_only.iterdir()) == [] and snapshot(run_dir) == before


def test_export_to_a_full_disk_leaves_nothing(run_dir: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", 64 * 1024) as disk:  # the tiny model's safetensors alone is about 140 KB
        (disk / "keep.txt").write_text("mine")
        before = snapshot(disk)
        failed_write(cli("export", str(run_dir), "--out", str(disk / "hf")), "No space left")
        assert snapshot(disk) == before and sorted(p.name for p in disk.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("kind", ["a parent that is a file", "a link to a folder", "a dangling link"])
def test_export_to_a_path_that_cannot_be_a_folder(run_dir: Path, tmp_path: Path, kind: str) -> None:
    (tmp_path / "file.txt").write_text("mine")
    (tmp_path / "empty").mkdir()
    out = {
        "a parent that is a file": tmp_path / "file.txt" / "hf",
        "a link to a folder": tmp_path / "link",
        "a dangling link": tmp_path / "dangling",
    }[kind]
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    before = snapshot(tmp_path)
    needle = "is not a folder" if kind == "a parent that is a file" else "is a symbolic link"
    refused(cli("export", str(run_dir), "--out", str(out)), f"--out {out}", needle)
    assert snapshot(tmp_path) == before and list((tmp_path / "empty").iterdir()) == []
    assert not (tmp_path / "nowhere").exists()


# --- prep and pull-hermes3 ------------------------------------------------------------------------------------------
@pytest.fixture
def texts(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"{i}.txt").write_text(f"document {i} " * 2000)  # about 1 MB of text
    return src


def test_prep_on_a_full_disk_keeps_the_corpus_there(tmp_path: Path, texts: Path) -> None:
    with tmpfs(tmp_path / "disk", 1536 * 1024) as disk:  # room for one corpus of a tenth of the texts, not two
        small = tmp_path / "small"
        small.mkdir()
        for p in sorted(texts.iterdir())[:4]:
            (small / p.name).write_bytes(p.read_bytes())
        out = disk / "corpus"
        assert cli("prep", "--source", str(small), "--out", str(out), "--tokenizer", "bytes").returncode == 0
        before = snapshot(disk)
        failed_write(
            cli("prep", "--source", str(texts), "--out", str(out), "--tokenizer", "bytes"),
            f"--out {out}: cannot write the corpus",
            "No space left",
        )
        assert snapshot(disk) == before  # the old corpus whole, no temp folder left


def test_pull_on_a_full_disk_keeps_the_old_output(tmp_path: Path) -> None:
    turn = [{"from": "human", "value": "hi " * 200}, {"from": "gpt", "value": "yo " * 200}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"conversations": turn}) + "\n" for _ in range(200)))  # about 250 KB
    with tmpfs(tmp_path / "disk", 128 * 1024) as disk:
        out = disk / "hermes3.jsonl"
        one = tmp_path / "one.jsonl"
        one.write_text(json.dumps({"conversations": turn}) + "\n")
        assert cli("pull-hermes3", "--from", str(one), "--out", str(out)).returncode == 0
        before = snapshot(disk)
        failed_write(cli("pull-hermes3", "--from", str(src), "--out", str(out)), f"--out {out}", "No space left")
        assert snapshot(disk) == before


# --- train ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ckpt", ["a file", "a dangling link"])
def test_resume_latest_with_ckpt_not_a_folder_is_refused_before_training(tmp_path: Path, ckpt: str) -> None:
    exp, out = write_experiment(tmp_path), tmp_path / "run"
    out.mkdir()
    if ckpt == "a file":
        (out / "ckpt").write_text("mine")
    else:
        (out / "ckpt").symlink_to(tmp_path / "nowhere")
    before = snapshot(tmp_path)
    res = cli("train", str(exp), "--out", str(out), "--resume", "latest")
    refused(res, f"{out / 'ckpt'} is", "checkpoints are written there")
    assert res.stdout == "" and snapshot(tmp_path) == before and not (tmp_path / "nowhere").exists()
