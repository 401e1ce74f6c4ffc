"""Every path a user gives is opened the one checked way (microgpt/fileio.py: open_input, input_kind, read_input),
issue 49 class 3: a named pipe (whose plain open waits for a writer forever) or /dev/zero (endless) anywhere a file
is read is one `error:` line at once, exit 2, and nothing is written; a file read whole has a size bound; a text
file that is not UTF-8 is named by its first bad byte and line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from microgpt import fileio
from microgpt.errors import InputError
from tests.conftest import cli
from tests.test_hostile_input import refused, snapshot

LIMIT_S = 60  # a hang fails the test here, long before the suite's own limit
SPECIAL = ["a named pipe", "a character device"]


def special(tmp_path: Path, kind: str) -> Path:
    """A named pipe in tmp_path (no writer ever opens it), or /dev/zero."""
    if kind == "a character device":
        return Path("/dev/zero")
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder trained 2 steps (its checkpoint for --init and eval)."""
    from tests.conftest import write_experiment

    root = tmp_path_factory.mktemp("special")
    exp = write_experiment(root, train={"steps": 2, "ckpt_every": 2})
    assert cli("train", str(exp), "--out", str(root / "run")).returncode == 0
    return root


@pytest.mark.parametrize("kind", SPECIAL)
def test_training_inputs(trained: Path, tmp_path: Path, kind: str) -> None:
    """The experiment file, --init and --resume: one line naming the flag or the file, before the run folder is
    made."""
    path, exp, out = special(tmp_path, kind), trained / "exp.json", tmp_path / "out"
    before = snapshot(trained)
    refused(
        cli("train", str(path), "--out", str(out), timeout=LIMIT_S),
        f"{path}: experiment file must be a regular file, not {kind}",
    )
    refused(cli("run", str(path), "--out", str(out), timeout=LIMIT_S), f"{path}: experiment file", kind)
    refused(
        cli("train", str(exp), "--out", str(out), "--init", str(path), timeout=LIMIT_S),
        f"--init {path}: run folder or checkpoint must be a regular file or a folder, not {kind}",
    )
    refused(
        cli("train", str(exp), "--out", str(out), "--resume", str(path), timeout=LIMIT_S),
        f"--resume {path}: checkpoint must be a regular file, not {kind}",
    )
    refused(
        cli("run", str(exp), "--out", str(out), "--init", str(path), timeout=LIMIT_S),
        f"--init {path}: run folder or checkpoint must be a regular file or a folder, not {kind}",
    )
    assert snapshot(trained) == before and not out.exists()  # refused before the run folder is made


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_run_folder_whose_log_is_special(trained: Path, tmp_path: Path, kind: str) -> None:
    """train.jsonl found as a named pipe or a device in the run folder: refused before anything is trained."""
    out = tmp_path / "run"
    out.mkdir()
    log = out / "train.jsonl"
    if kind == "a named pipe":
        os.mkfifo(log)
    else:
        log.symlink_to("/dev/zero")
    what = kind if kind == "a named pipe" else "a symbolic link"
    refused(
        cli("train", str(trained / "exp.json"), "--out", str(out), timeout=LIMIT_S),
        f"{log} is {what}, not a regular file; the run's log is written there",
    )
    assert sorted(p.name for p in out.iterdir()) == ["train.jsonl"]


@pytest.mark.parametrize("kind", SPECIAL)
def test_use_inputs(trained: Path, tmp_path: Path, kind: str) -> None:
    path, run = special(tmp_path, kind), trained / "run"
    refused(
        cli("eval", str(run), "--hellaswag", str(path), timeout=LIMIT_S),
        f"--hellaswag {path}: HellaSwag file must be a regular file, not {kind}",
    )
    refused(
        cli("eval", str(run), "--text", str(path), timeout=LIMIT_S),
        f"--text {path}: text file must be a regular file, not {kind}",
    )
    refused(cli("sample", str(path), timeout=LIMIT_S), f"{path}: run folder or checkpoint must be", kind)
    refused(cli("export", str(path), "--out", str(tmp_path / "hf"), timeout=LIMIT_S), str(path), kind)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("kind", SPECIAL)
def test_prep_inputs(tmp_path: Path, kind: str) -> None:
    """--source and --tokenizer; a special file inside a source folder is passed over (it is no document)."""
    path, out = special(tmp_path, kind), tmp_path / "corpus"
    refused(
        cli("prep", "--source", str(path), "--out", str(out), "--tokenizer", "bytes", timeout=LIMIT_S),
        f"{path}: source must be a regular file or a folder, not {kind}",
    )
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"{i}.txt").write_text(f"document {i} " * 40)
    refused(
        cli("prep", "--source", str(texts), "--out", str(out), "--tokenizer", str(path), timeout=LIMIT_S),
        f"{path}: tokenizer must be a regular file, not {kind}",
    )
    assert not out.exists()
    os.mkfifo(texts / "pipe.txt")
    r = cli("prep", "--source", str(texts), "--out", str(out), "--tokenizer", "bytes", "--quiet", timeout=LIMIT_S)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert (out / "manifest.json").is_file()


def test_a_file_too_large_to_read_whole_is_refused_unread(tmp_path: Path) -> None:
    """A sparse experiment file beyond fileio.MAX_JSON_BYTES: its size is refused before a byte is read."""
    exp = tmp_path / "exp.json"
    with open(exp, "wb") as f:
        f.truncate(fileio.MAX_JSON_BYTES + 1)
    refused(
        cli("train", str(exp), "--out", str(tmp_path / "run"), timeout=LIMIT_S),
        f"{exp}: experiment file is {fileio.MAX_JSON_BYTES + 1:,} bytes, more than the "
        f"{fileio.MAX_JSON_BYTES:,} it may have",
    )
    assert not (tmp_path / "run").exists()


def test_text_that_is_not_utf8_is_named_by_its_first_bad_byte(tmp_path: Path) -> None:
    exp = tmp_path / "exp.json"
    data = b'{\n "name": "a",\n "description": "caf\xe9"\n}\n'
    exp.write_bytes(data)
    refused(
        cli("train", str(exp), "--out", str(tmp_path / "run"), timeout=LIMIT_S),
        f"{exp}: not UTF-8 text (byte {data.index(0xE9)}, line 3): the experiment file must be UTF-8",
    )


def test_the_checked_opener(tmp_path: Path) -> None:
    """fileio's own contract: a regular file opens; a folder, a named pipe, a device are one error naming what they
    are; a missing file is the caller's (FileNotFoundError); the size bound holds for a file read whole."""
    (tmp_path / "f.txt").write_bytes(b"abc")
    with fileio.open_input(tmp_path / "f.txt", "text") as f:
        assert f.read() == b"abc"
    os.mkfifo(tmp_path / "p")
    for path, kind in (
        (tmp_path, "a folder"),
        (tmp_path / "p", "a named pipe"),
        (Path("/dev/null"), "a character device"),
    ):
        with pytest.raises(InputError, match=f"^{path}: text must be a regular file, not {kind}$"):
            fileio.open_input(path, "text")
    assert fileio.input_kind(tmp_path, "source") == "folder"
    assert fileio.input_kind(tmp_path / "f.txt", "source", folder=False) == "file"
    with pytest.raises(InputError, match="source must be a regular file, not a folder"):
        fileio.input_kind(tmp_path, "source", folder=False)
    with pytest.raises(FileNotFoundError):
        fileio.open_input(tmp_path / "missing", "text")
    with pytest.raises(InputError, match="text is 3 bytes, more than the 2 it may have"):
        fileio.read_input(tmp_path / "f.txt", "text", limit=2)
    assert fileio.read_input_text(tmp_path / "f.txt", "text", limit=3) == "abc"
