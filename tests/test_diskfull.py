"""A full disk during a checkpoint write (issue 14, class 6), on a real small tmpfs: the engine ends with one
`error:` line and exit code 4 (errors.EXIT_WRITE, which the proxy does not retry: tests/proxy), no temp file is
left, and the previous checkpoint is intact and resumable.

Mounting needs root (CAP_SYS_ADMIN); where the mount fails the test is skipped and says why."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from microgpt import checkpoint
from microgpt.config import from_dict
from microgpt.engine import params
from microgpt.errors import EXIT_WRITE
from tests.conftest import TINY, cli, tmpfs, write_experiment
from tests.proxy._helpers import ENV
from tests.test_hostile_input import snapshot
from tests.test_hostile_output import failed_write

CKPT_BYTES = 8 + 12 * params.n_params(from_dict(TINY).model)  # about 400 KB


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with room for two checkpoints of the tiny model and their sidecars, not three."""
    with tmpfs(tmp_path / "disk", 2 * CKPT_BYTES + 160 * 1024) as mnt:
        yield mnt


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
    ck, side = checkpoint.load(good[0], params.n_params(from_dict(TINY).model))
    assert ck.step == 2 and side["step"] == 2
    # The folder is usable as it is: the run resumes from the intact checkpoint (to step 2: already complete).
    again = cli("train", str(exp), "--out", str(out), "--resume", "latest", "--steps", "2", env=ENV)
    assert again.returncode == 0 and "already complete" in again.stderr, again.stderr


def test_disk_full_under_the_proxy(tmp_path: Path, small_disk: Path) -> None:
    """The disk fills while `microgpt run` trains: the proxy's next run-file write fails; it stops the engine and
    ends with exit 4 and, as its last word, one `error:` line naming the file; no traceback; the run files keep
    their last complete version."""
    from tests.proxy._helpers import write_exp

    exp = write_exp(tmp_path, train={"steps": 100000, "ckpt_every": 100000, "eval_every": 100000})
    out = small_disk / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "microgpt.cli", "run", str(exp), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        loss = out / "proxy-test.loss.json"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
            loss.exists() and len(json.loads(loss.read_bytes() or b"{}").get("train", [])) >= 5
        ):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        with open(small_disk / "filler", "wb") as f:  # take every byte that is left
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_WRITE, (proc.returncode, err)
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "cannot write the run file" in last and "No space left" in last, err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [last], err  # the engine's is demoted
    history = json.loads(loss.read_text())  # the last complete version, not a torn one
    assert len(history["train"]) >= 5


PAGE = resource.getpagesize()  # tmpfs counts whole pages


def pages(n: int) -> int:
    return -(-n // PAGE)


def fill(disk: Path, leave: int) -> None:
    """Take every byte of the tmpfs at disk but `leave` (a filler file written to ENOSPC, then cut back)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * PAGE):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    os.truncate(filler, filler.stat().st_size - leave)


def test_a_disk_with_room_for_the_checkpoint_but_not_the_report_card(tmp_path: Path) -> None:
    """The resumed run's checkpoint fits and its report card does not: one `error:` line naming report.json and exit
    4 (the README's word for a full disk), the checkpoint whole and resumable, the previous card intact, no temp
    file left. The run folder's path is long, so the card (which lists it) is larger than the disk's slack."""
    exp = write_experiment(tmp_path, train={"steps": 3, "ckpt_every": 100})
    with tmpfs(tmp_path / "disk", 4 * CKPT_BYTES) as disk:
        out = disk.joinpath(*["d" * 250] * 14, "run")
        assert cli("train", str(exp), "--out", str(out), "--steps", "2", env=ENV).returncode == 0
        before = snapshot(out)
        log = pages((out / "train.jsonl").stat().st_size + 16384) - pages((out / "train.jsonl").stat().st_size)
        fill(disk, (pages(CKPT_BYTES) + 1 + log) * PAGE)  # the checkpoint, its sidecar, the log's new records
        res = cli("train", str(exp), "--out", str(out), "--resume", "latest", env=ENV)
        failed_write(res, f"{out / 'report.json'}: cannot write the report card", "No space left")
        after = snapshot(out)
        assert {k: v for k, v in after.items() if "report" in k} == {k: v for k, v in before.items() if "report" in k}
        assert not [p for p in out.rglob("*") if ".tmp" in p.name]
        ck, side = checkpoint.load(out / "ckpt" / checkpoint.ckpt_name(3), params.n_params(from_dict(TINY).model))
        assert ck.step == 3 and side["reason"] == "final"
