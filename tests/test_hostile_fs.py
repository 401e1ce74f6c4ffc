"""The file system refusing the data layer (issue 57): an unreadable --data folder, a built-in corpus cache that
cannot be written, a fresh run folder that is read-only at the tokenizer copy. Each is one `error:` line naming
the path (errors.os_error, in exit_on_input_error: the one place), exit 2 for what cannot be read and 4 for what
cannot be written, and nothing made. Also the built-in corpus's build: what can be checked is checked before it
says "building", and its lock file goes when the build ends.

Permissions are real: as root the command runs without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (setpriv), so a
folder's mode bits bind it as they bind any user."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from microgpt.errors import EXIT_WRITE, InputError, WriteError, os_error
from tests.conftest import REPO, cli, one_error, write_experiment
from tests.test_hostile_input import refused

NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]


def cli_bound(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m microgpt.cli ARGS` bound by file permissions, as root too (setpriv drops the two capabilities
    that bypass them); skipped where root has no setpriv."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: file permissions cannot bind the command")
        prefix = NO_DAC
    return subprocess.run(
        [*prefix, sys.executable, "-m", "microgpt.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        cwd=REPO,
        timeout=300,
    )


@pytest.fixture
def mode() -> Iterator[list[Path]]:
    """Folders a test chmods; given their write permission back after it, so pytest can remove them."""
    folders: list[Path] = []
    yield folders
    for folder in folders:
        folder.chmod(0o755)


def test_an_unreadable_data_folder(tmp_path: Path, mode: list[Path]) -> None:
    exp = write_experiment(tmp_path)
    data = tmp_path / "shards"
    data.mkdir()
    data.chmod(0)
    mode.append(data)
    res = cli_bound("train", str(exp), "--data", str(data), "--out", str(tmp_path / "run"))
    refused(res, f"{data}: cannot read (Permission denied)")
    assert not (tmp_path / "run").exists()


def test_a_cache_that_cannot_be_written(tmp_path: Path, mode: list[Path]) -> None:
    exp = write_experiment(tmp_path)
    cache = tmp_path / "cache"
    (cache / "builtin").mkdir(parents=True)
    (cache / "builtin").chmod(0o555)
    mode.append(cache / "builtin")
    res = cli_bound("train", str(exp), "--out", str(tmp_path / "run"), env={"MICROGPT_DATA_DIR": str(cache)})
    one_error(res, EXIT_WRITE, f"{cache / 'builtin'}: cannot write the built-in corpus cache", "MICROGPT_DATA_DIR")
    assert list((cache / "builtin").iterdir()) == [] and not (tmp_path / "run").exists()


def test_a_fresh_run_into_a_read_only_folder(tmp_path: Path, mode: list[Path]) -> None:
    """The run folder is there and cannot be written: the first write, the tokenizer's copy, says so in one line."""
    cache = tmp_path / "cache"
    exp = write_experiment(tmp_path, model={"vocab_size": 512})  # a BPE: its tokenizer.json is copied in
    assert cli("prep", "--experiment", str(exp), "--builtin", env={"MICROGPT_DATA_DIR": str(cache)}).returncode == 0
    out = tmp_path / "run"
    out.mkdir()
    out.chmod(0o555)
    mode.append(out)
    res = cli_bound("train", str(exp), "--out", str(out), env={"MICROGPT_DATA_DIR": str(cache)})
    one_error(res, EXIT_WRITE, f"{out / 'tokenizer.json'}: cannot write (Permission denied)")
    assert list(out.iterdir()) == []


def test_os_error_names_the_path_and_what_failed(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    missing = os_error(FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "gone")))
    full = os_error(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "file")))
    assert type(missing) is InputError and str(missing) == f"{tmp_path / 'gone'}: No such file or directory"
    assert type(full) is WriteError and str(full) == f"{tmp_path / 'file'}: cannot write (No space left on device)"


def test_the_builtin_build_checks_before_it_says_building(tmp_path: Path) -> None:
    """A data.tokenizer that is not there: the one error line alone, no "building ..." before it, and nothing made
    in the cache (the lock file included)."""
    cache = tmp_path / "cache"
    exp = write_experiment(tmp_path, model={"vocab_size": 512}, data={"tokenizer": str(tmp_path / "nope.json")})
    res = cli("train", str(exp), "--out", str(tmp_path / "run"), env={"MICROGPT_DATA_DIR": str(cache)})
    refused(res, f"{tmp_path / 'nope.json'}: cannot read tokenizer")
    assert not cache.exists() and not (tmp_path / "run").exists()


def test_the_builtin_build_leaves_no_lock_file(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    exp = write_experiment(tmp_path, train={"steps": 1})
    res = cli("train", str(exp), "--out", str(tmp_path / "run"), env={"MICROGPT_DATA_DIR": str(cache)})
    assert res.returncode == 0, res.stderr
    (built,) = (cache / "builtin").iterdir()
    assert not built.name.startswith(".") and (built / "manifest.json").is_file()
