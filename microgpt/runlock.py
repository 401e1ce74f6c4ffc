"""One writer per run folder: an exclusive flock on `<out>/.lock`, held for the writer's whole life.

`microgpt train` and `microgpt run` take the lock before they look at the folder's checkpoints, so two of them on
one `--out` can no longer both pass the "already holds checkpoints" check and overwrite each other: the second
gets one `error:` line naming the holder's pid (read from /proc/locks, so the lock file stays empty and taking
the lock writes nothing), exit 2. The kernel drops a flock when the last descriptor of its open file closes, so a
writer killed with SIGKILL leaves no stale lock.

Children that write the same folder hold the same lock: `microgpt run` starts `microgpt train` on its folder, and
`train --procs N` starts N ranks. The parent passes its lock's descriptor to the child (pass_fds) and names it in
MICROGPT_RUN_LOCK; a flock belongs to the open file, not the process, so the child's flock on that descriptor
succeeds and the folder stays locked while the child lives, even if its parent is killed first (an orphaned
engine still writing keeps a new supervisor out). Anyone else, a second `run` or a stray `train`, opens the file
anew and is refused while any of them lives.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from microgpt.errors import InputError

NAME = ".lock"
ENV = "MICROGPT_RUN_LOCK"  # the inherited descriptor of the parent's lock on this folder


class LockError(InputError):
    """The run folder is locked by another process, or cannot hold a lock file."""


class RunLock:
    """The held lock; closing it (or the process ending) releases it unless a child still holds it too."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    def child_env(self) -> dict[str, str]:
        """Environment for a child that writes the same folder: with pass_fds=(self.fd,) it holds this lock."""
        return {ENV: str(self.fd)}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, kind: type | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def holder_pid(fd: int) -> str:
    """The pid holding the flock on fd's file, from /proc/locks (Linux), or '?'. The lock file itself stays empty:
    taking the lock never writes to a file that was there before."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:  # "1: FLOCK  ADVISORY  WRITE 16584 fe:00:2162764 0 EOF"; waiters carry "->"
                parts = line.split()
                if "FLOCK" in parts and "->" not in parts and key in parts:
                    return parts[parts.index(key) - 1]
    except OSError:
        pass
    return "?"


def pid_alive(pid: object) -> bool:
    """Whether process `pid` (an int) exists: another user's counts; anything but a positive int does not."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: another user's process
    return True


def _inherited(folder: Path) -> RunLock | None:
    """The lock our parent passed down for this folder, if MICROGPT_RUN_LOCK names a descriptor of its lock file
    and we hold the flock through it (a descriptor of another open file of it would fail the flock)."""
    value = os.environ.get(ENV, "")
    if not value.isdigit():
        return None
    fd, path = int(value), folder / NAME
    try:
        mine, lock = os.fstat(fd), os.stat(path)
        if (mine.st_dev, mine.st_ino) != (lock.st_dev, lock.st_ino):
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return None
    return RunLock(fd, path)


def acquire(folder: Path, flag: str = "--out") -> RunLock:
    """Lock run folder `folder` (created if missing) for this process; LockError naming `flag`, the folder and the
    holder's pid when another process has it."""
    folder = Path(folder)
    inherited = _inherited(folder)
    if inherited is not None:
        return inherited
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise LockError(f"{flag} {folder}: cannot use it as a run folder ({e.strerror or e})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = holder_pid(fd)
        os.close(fd)
        exited = pid.isdigit() and not pid_alive(int(pid))  # an unknown pid ("?"): say nothing about it
        who = f"a process started by pid {pid}, which has exited" if exited else f"pid {pid}"
        raise LockError(f"{flag} {folder}: the run folder is in use by another microgpt process ({who}); "
                        "wait for it to end or stop it") from None  # fmt: skip
    except OSError as e:
        os.close(fd)
        raise LockError(f"{flag} {folder}: cannot lock the run folder ({e.strerror or e})") from None
    return RunLock(fd, folder / NAME)
