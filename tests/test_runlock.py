"""One writer per run folder (microgpt/runlock.py), with real processes: a second trainer is refused with the
holder's pid; after kill -9 of the holder a new one starts and resumes; the proxy's engine works under the proxy's
lock while a stray `train` and a second `run` are refused; stale checkpoint temp files go at the next start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from microgpt import checkpoint, runlock
from microgpt.fileio import atomic_write_json, remove
from microgpt.proxy.runfiles import write_run_file
from microgpt.runlog import RunLog, read_log
from tests.conftest import REPO, cli, json_lines, one_error, write_experiment
from tests.proxy._helpers import ENV, ProxyRun, write_exp
from tests.test_hostile_input import refused


def start_train(exp: Path, out: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "microgpt", "train", str(exp), "--out", str(out), "--json", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_checkpoint(proc: subprocess.Popen) -> int:
    """Read the trainer's JSON lines until its first checkpoint; that step."""
    for line in proc.stdout:
        rec = json.loads(line)
        if rec["event"] == "checkpoint":
            return rec["step"]
    raise AssertionError(f"the trainer ended before a checkpoint: {proc.stderr.read()}")


def test_second_trainer_is_refused_and_a_killed_one_leaves_no_lock(tmp_path: Path) -> None:
    exp = write_experiment(tmp_path, train={"steps": 100_000, "ckpt_every": 5})
    out = tmp_path / "run"
    first = start_train(exp, out)
    try:
        step = wait_for_checkpoint(first)
        stale = out / "ckpt" / ".step-00000099.bin.tmp999999"  # as a writer killed mid-checkpoint leaves it
        stale.write_bytes(b"\0" * 4096)
        second = cli("train", str(exp), "--out", str(out), "--resume", "latest", env=ENV)
        refused(second, f"--out {out}", f"pid {first.pid}")
        assert stale.exists()  # only the lock's holder may remove it
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    ckpts = checkpoint.list_checkpoints(out / "ckpt")
    newest = int(checkpoint.CKPT_RE.match(ckpts[0].name).group(1))
    assert newest >= step
    third = cli(
        "train", str(exp), "--out", str(out), "--resume", "latest", "--steps", str(newest + 2), "--json", env=ENV
    )
    assert third.returncode == 0, third.stderr
    records = json_lines(third.stdout)
    assert records[0]["event"] == "start" and records[0]["step"] == newest
    assert [(r["event"], r["step"]) for r in records[-2:]] == [("done", newest + 2), ("report", newest + 2)]
    assert not stale.exists() and f"removed {stale}" in third.stderr
    assert not (out / runlock.NAME).exists()  # taking the lock writes nothing: the flock is on the folder


def test_the_proxy_engine_works_under_the_proxy_lock(tmp_path: Path) -> None:
    exp = write_exp(tmp_path, train={"steps": 100_000})
    out = tmp_path / "run"
    proxy = ProxyRun(exp, out)
    try:
        engine = proxy.engine_pid()
        proxy.wait_for(lambda: len(proxy.steps()) >= 3, "three steps")
        refused(cli("train", str(exp), "--out", str(out), "--resume", "latest", env=ENV), f"pid {proxy.proc.pid}")
        refused(cli("run", str(exp), "--out", str(out), env=ENV), f"pid {proxy.proc.pid}")
        done = len(proxy.steps())
        proxy.wait_for(lambda: len(proxy.steps()) > done, "the engine to go on after the refusals")
        assert proxy.file("state")["engine_pid"] == engine and proxy.proc.poll() is None
        proxy.signal(signal.SIGTERM)
        assert proxy.wait() == 0
    finally:
        proxy.kill()
    state = proxy.file("state")
    assert state["status"] == "stopped" and state["restarts"] == 0, state


def test_lock_is_inherited_only_through_the_passed_descriptor(tmp_path: Path) -> None:
    """MICROGPT_RUN_LOCK naming a descriptor of another file (or none) gives nothing: the folder stays locked."""
    folder = tmp_path / "run"
    with runlock.acquire(folder) as held:
        other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT)
        try:
            for value in (str(other), "999", "x"):
                res = cli("train", str(write_experiment(tmp_path)), "--out", str(folder), env={runlock.ENV: value})
                refused(res, f"pid {os.getpid()}")
        finally:
            os.close(other)
        assert held.fd >= 0
    with runlock.acquire(folder):  # released: free again
        pass


def test_a_replaced_lock_file_lets_no_second_trainer_in(tmp_path: Path) -> None:
    """The lock is the folder itself: deleting or replacing a `.lock` in it (an older version's lock file, or one a
    person made) while a trainer holds the folder changes nothing; a second trainer is still refused."""
    exp = write_experiment(tmp_path, train={"steps": 100_000, "ckpt_every": 5})
    out = tmp_path / "run"
    first = start_train(exp, out)
    try:
        wait_for_checkpoint(first)
        for replace in ("create", "replace", "delete"):
            lock = out / runlock.NAME
            if replace == "create":
                lock.write_bytes(b"")
            elif replace == "replace":
                (tmp_path / "new").write_bytes(b"")
                os.replace(tmp_path / "new", lock)
            else:
                lock.unlink()
            second = cli("train", str(exp), "--out", str(out), "--resume", "latest", env=ENV)
            refused(second, f"--out {out}", f"pid {first.pid}")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()


def test_a_dangling_lock_link_creates_nothing_outside(tmp_path: Path) -> None:
    out, target = tmp_path / "run", tmp_path / "elsewhere" / "made-by-the-lock"
    out.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (out / runlock.NAME).symlink_to(target)
    res = cli("train", str(write_experiment(tmp_path, train={"steps": 1})), "--out", str(out), env=ENV)
    assert res.returncode == 0, res.stderr
    assert not target.exists() and list((tmp_path / "elsewhere").iterdir()) == []


def test_the_lock_file_of_a_folder_that_cannot_be_locked(tmp_path: Path) -> None:
    """The fallback for filesystems that cannot flock a folder (NFS), run here on a real folder: it opens
    <out>/.lock without following a link, and it is checked to be the file at that path."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / runlock.NAME).symlink_to(tmp_path / "nowhere")
    with pytest.raises(runlock.LockError, match="is a symbolic link"):
        runlock._lock_file(folder, "--out")
    assert not (tmp_path / "nowhere").exists()
    (folder / runlock.NAME).unlink()
    with runlock._lock_file(folder, "--out") as held:
        assert held.path == folder / runlock.NAME
        with pytest.raises(runlock.LockError, match=f"pid {os.getpid()}"):
            runlock._lock_file(folder, "--out")


def first_step(proc: subprocess.Popen) -> None:
    """Read the trainer's JSON lines until its first step record."""
    for line in proc.stdout:
        if json.loads(line)["event"] == "step":
            return
    raise AssertionError(f"the trainer ended before its first step: {proc.stderr.read()}")


def test_a_writer_whose_folder_was_moved_aside_writes_nowhere(tmp_path: Path) -> None:
    """Issue 49 class 6: the live run folder moved aside and made again, a second trainer takes the new one (its lock
    is free), then the first gets SIGTERM. The first compares its folder's identity before each write: it says so in
    one line and stops (exit 2), its SIGTERM checkpoint written nowhere, neither in the new folder nor the moved one;
    the second trains on."""
    exp = write_experiment(tmp_path, train={"steps": 100_000, "ckpt_every": 100_000, "eval_every": 100_000})
    out, moved = tmp_path / "run", tmp_path / "moved"
    first = start_train(exp, out)
    second = None
    try:
        first_step(first)
        out.rename(moved)
        out.mkdir()
        second = start_train(exp, out)
        first_step(second)
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
        res = subprocess.CompletedProcess(first.args, first.returncode, "", err)
        one_error(
            res, 2, f"{out}: the run folder was moved or replaced while this process wrote it", after_progress=True
        )
        assert not (moved / "ckpt").exists() and not (out / "ckpt").exists()  # the SIGTERM checkpoint: nowhere
        second.send_signal(signal.SIGTERM)
        _, err2 = second.communicate(timeout=120)
        assert second.returncode == 0, err2
        assert [r["event"] for r in read_log(out / "train.jsonl")][0] == "start"
        assert checkpoint.list_checkpoints(out / "ckpt")  # the second's own SIGTERM checkpoint
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_proxy_whose_folder_was_moved_aside_stops_with_one_line(tmp_path: Path) -> None:
    """`microgpt run` and its engine share the lock: the folder moved aside, the proxy's next write finds it is no
    longer the folder it locked and stops the engine, whose own checkpoint write finds the same (its line demoted):
    one `error:` line, exit 2, nothing written into the folder made again."""
    exp = write_exp(tmp_path, train={"steps": 100_000, "ckpt_every": 100_000, "eval_every": 100_000})
    out, moved = tmp_path / "run", tmp_path / "moved"
    run = ProxyRun(exp, out)
    try:
        run.wait_for(run.steps, "a step in the loss history", 120)
        out.rename(moved)
        out.mkdir()
        rc = run.wait(120)
    finally:
        run.kill()
    err = run.log.read_text(errors="replace")
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert f"{out}: the run folder was moved or replaced" in errors[0]
    assert list(out.iterdir()) == []


def test_the_lock_knows_its_folder_by_identity(tmp_path: Path) -> None:
    """RunLock.check: passes while the path names the locked folder; a LockError naming it once the folder was
    moved aside, and still when a folder of the same name is made again."""
    out = tmp_path / "run"
    with runlock.acquire(out) as lock:
        lock.check()
        out.rename(tmp_path / "moved")
        with pytest.raises(runlock.LockError, match=f"^{out}: the run folder was moved or replaced"):
            lock.check()
        out.mkdir()
        with pytest.raises(runlock.LockError):
            lock.check()


@pytest.mark.parametrize("kind", ["folder", "lock file"])
def test_a_write_after_the_check_lands_in_the_folder_that_was_locked(tmp_path: Path, kind: str) -> None:
    """A check and its write are two steps (the CI failure of the twenty-first session: the proxy's state file
    appeared in the folder made again). The folder moved aside and made again between them, every anchored write
    (a run file, a checkpoint and its sidecar, a removal) goes where the locked folder went, never into the new one;
    the same with the lock file of a filesystem that cannot lock a folder."""
    out, moved = tmp_path / "run", tmp_path / "moved"
    out.mkdir()
    lock = runlock.acquire(out) if kind == "folder" else runlock._lock_file(out, "--out")
    with lock:
        lock.check()
        out.rename(moved)
        out.mkdir()
        write_run_file(out / "r.state.json", {"status": "running"}, None)  # unguarded: the path decides
        atomic_write_json(out / "r.loss.json", {"train": []}, anchor=lock.anchor)
        n = 4
        path = checkpoint.write_checkpoint(
            out / "ckpt" / checkpoint.ckpt_name(7), 7, *(np.ones(n, np.float32),) * 3, anchor=lock.anchor
        )
        remove(out / "r.loss.json", lock.anchor)
        remove(out / "ckpt" / "absent.bin", lock.anchor)  # nothing there: nothing to do
        log = RunLog(out / "train.jsonl", lock=lock)
        log.open()  # opened in the locked folder; its first record is then refused (the folder moved)
        with pytest.raises(runlock.LockError):
            log.emit({"event": "start", "run": "r", "step": 0})
        log.close()
    assert sorted(p.name for p in out.iterdir()) == ["r.state.json"]
    assert (moved / "train.jsonl").read_bytes() == b""
    assert not (moved / "r.loss.json").exists()
    assert sorted(p.name for p in (moved / "ckpt").iterdir()) == [path.name, checkpoint.sidecar_path(path).name]
    assert checkpoint.read_step(moved / "ckpt" / path.name) == 7 and checkpoint.verify_sha(moved / "ckpt" / path.name)
