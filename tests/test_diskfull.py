"""A full disk during a checkpoint write (issue 14, class 6), on a real small tmpfs: the engine ends with one
`error:` line and exit code 4 (errors.EXIT_WRITE, which the proxy does not retry: tests/proxy), no temp file is
left, and the previous checkpoint is intact and resumable.

Mounting needs root (CAP_SYS_ADMIN); where the mount fails the test is skipped and says why."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from microgpt import checkpoint, memory
from microgpt.config import from_dict
from microgpt.errors import EXIT_WRITE
from tests.conftest import TINY, cli, write_experiment
from tests.proxy._helpers import ENV

CKPT_BYTES = 8 + 12 * memory.n_params(from_dict(TINY).model)  # about 400 KB


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with room for two checkpoints of the tiny model and their sidecars, not three."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    size = 2 * CKPT_BYTES + 160 * 1024
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                         text=True)  # fmt: skip
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({(res.stderr or res.stdout).strip() or res.returncode})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_during_a_checkpoint(tmp_path: Path, small_disk: Path) -> None:
    exp = write_experiment(tmp_path, train={"steps": 6, "ckpt_every": 1})
    out = small_disk / "run"
    res = cli("train", str(exp), "--out", str(out), env=ENV)
    assert res.returncode == EXIT_WRITE, (res.returncode, res.stderr)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "cannot write the checkpoint" in errors[0] and "No space left" in errors[0], errors
    ckpt = out / "ckpt"
    names = sorted(p.name for p in ckpt.iterdir())
    assert not [n for n in names if checkpoint.TEMP_RE.match(n)], names
    good = checkpoint.list_checkpoints(ckpt)
    assert len(good) == 2, names  # steps 1 and 2 fit; step 3 did not, and left nothing behind
    assert str(ckpt / checkpoint.ckpt_name(3)) in errors[0]
    ck, side = checkpoint.load(good[0], memory.n_params(from_dict(TINY).model))
    assert ck.step == 2 and side["step"] == 2
    # The folder is usable as it is: the run resumes from the intact checkpoint (to step 2: already complete).
    again = cli("train", str(exp), "--out", str(out), "--resume", "latest", "--steps", "2", env=ENV)
    assert again.returncode == 0 and "already complete" in again.stderr, again.stderr
