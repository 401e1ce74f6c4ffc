"""One writer per run folder: an exclusive flock on the folder itself, held for the writer's whole life.

`microgpt train` and `microgpt run` take the lock before they look at the folder's checkpoints, so two of them on
one `--out` can no longer both pass the "already holds checkpoints" check and overwrite each other: the second
gets one `error:` line naming the holder's pid (read from /proc/locks, so taking the lock writes nothing), exit 2.
The kernel drops a flock when the last descriptor of its open file closes, so a writer killed with SIGKILL leaves
no stale lock.

The lock is on the folder's own inode (a descriptor opened with O_DIRECTORY), not on a file in it: a lock file can
be deleted or replaced while it is held (a second writer then locks the new file and gets in), a folder cannot be
replaced under the paths the writer uses. After the flock, the descriptor is checked to be the folder the path
names now. Where the filesystem cannot lock a folder (NFS emulates flock with byte-range locks, which need a file
open for writing), the lock falls back to `<out>/.lock`, opened without following a symbolic link (a dangling
`.lock` link must not create a file elsewhere) and checked, after the flock, to be the file at that path.

The lock guards the folder the path named when it was taken; a writer checks before each write that the path still
names it (RunLock.check: the descriptor's device and inode against the path's). A live run folder moved aside and
made again (where a second writer may now hold a lock of its own) stops the first writer with one LockError line:
what it would have written (a record, a SIGTERM checkpoint, the report card) is written nowhere. A check and the
write after it are two steps; a move between them must not send the write into the folder made again, so writes
go through the lock's anchor (RunLock.anchor, fileio.Anchor): relative to a descriptor of the locked folder, they
land where that folder went.

Children that write the same folder hold the same lock: `microgpt run` starts `microgpt train` on its folder, and
`train --procs N` starts N ranks. The parent passes its lock's descriptor to the child (pass_fds) and names it in
MICROGPT_RUN_LOCK; a flock belongs to the open file, not the process, so the child's flock on that descriptor
succeeds and the folder stays locked while the child lives, even if its parent is killed first (an orphaned
engine still writing keeps a new supervisor out). Anyone else, a second `run` or a stray `train`, opens the
folder anew and is refused while any of them lives.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from microgpt.errors import InputError
from microgpt.fileio import Anchor

NAME = ".lock"
ENV = "MICROGPT_RUN_LOCK"  # the inherited descriptor of the parent's lock on this folder
PID_MAX = 2**31 - 1  # pid_t: a larger "pid" names no process (and os.kill would overflow on it)


class LockError(InputError):
    """The run folder is locked by another process, or cannot hold a lock file."""


class RunLock:
    """The held lock; closing it (or the process ending) releases it unless a child still holds it too."""

    def __init__(self, fd: int, path: Path, folder: Path):
        self.fd, self.path, self.folder = fd, path, folder  # path: the folder, or its .lock file (the fallback)
        self.folder_fd = fd if path == folder else _folder_holding(fd, folder)

    @property
    def anchor(self) -> Anchor:
        """Where this process's writes into the folder go (fileio.Anchor): the folder it locked, by descriptor."""
        return Anchor(self.folder_fd, self.folder)

    def check(self) -> None:
        """Before each write into the run folder: its path still names what this process locked (compared by
        identity, device and inode). A folder moved aside (and perhaps made again, and locked by another writer)
        is a LockError: the writer stops, writing nowhere else."""
        try:
            same = _same(self.fd, (os.stat if self.path == self.folder else os.lstat)(self.path))
        except OSError:
            same = False
        if not same:
            raise LockError(
                f"{self.folder}: the run folder was moved or replaced while this process wrote it; "
                "stopping without writing there (what was written is where the folder went)"
            )

    def child_env(self) -> dict[str, str]:
        """Environment for a child that writes the same folder: with pass_fds=(self.fd,) it holds this lock."""
        return {ENV: str(self.fd)}

    def close(self) -> None:
        if self.folder_fd not in (-1, self.fd):
            os.close(self.folder_fd)
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = self.folder_fd = -1

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
    """Whether process `pid` (an int) exists: another user's counts; anything but an int in [1, PID_MAX] does not."""
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid <= PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: another user's process
    return True


def _same(fd: int, st: os.stat_result) -> bool:
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino)


def _folder_holding(lock_fd: int, folder: Path) -> int:
    """The fallback's folder descriptor: `folder` opened, and checked to hold the .lock file that lock_fd locks."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        os.close(lock_fd)
        raise LockError(f"{folder}: cannot open the run folder ({e.strerror or e})") from None
    try:
        held = _same(lock_fd, os.stat(NAME, dir_fd=fd, follow_symlinks=False))
    except OSError:
        held = False
    if not held:
        os.close(fd)
        os.close(lock_fd)
        raise LockError(f"{folder}: the run folder was replaced while it was being locked; try again")
    return fd


def _inherited(folder: Path) -> RunLock | None:
    """The lock our parent passed down for this folder, if MICROGPT_RUN_LOCK names a descriptor of this folder (or
    of its .lock file) and we hold the flock through it (a descriptor of another open file of it would fail)."""
    value = os.environ.get(ENV, "")
    if not value.isdigit():
        return None
    fd = int(value)
    for path, stat in ((folder, os.stat), (folder / NAME, os.lstat)):
        try:
            if not _same(fd, stat(path)):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue
        return RunLock(fd, path, folder)
    return None


# errnos of a flock on a folder that the filesystem does not support (NFS: EBADF without write access)
NO_FOLDER_LOCKS = {errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL}


class _NoFolderLock(Exception):
    """This filesystem cannot flock a folder: use the lock file."""


def acquire(folder: Path, flag: str = "--out") -> RunLock:
    """Lock run folder `folder` (created if missing) for this process; LockError naming `flag`, the folder and the
    holder's pid when another process has it."""
    folder = Path(folder)
    inherited = _inherited(folder)
    if inherited is not None:
        return inherited
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise LockError(f"{flag} {folder}: cannot use it as a run folder ({e.strerror or e})") from None
    try:
        return _take(fd, folder, folder, flag, os.stat)
    except _NoFolderLock:
        return _lock_file(folder, flag)


def _lock_file(folder: Path, flag: str) -> RunLock:
    """The fallback where a folder cannot be locked: <folder>/.lock, never through a symbolic link."""
    path = folder / NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        why = "is a symbolic link; remove it" if e.errno == errno.ELOOP else e.strerror or str(e)
        raise LockError(f"{flag} {folder}: cannot use {path} as the run folder's lock ({why})") from None
    return _take(fd, folder, path, flag, os.lstat)


def _take(fd: int, folder: Path, path: Path, flag: str, stat: Callable[[Path], os.stat_result]) -> RunLock:
    """The flock on fd (opened on `path`: the folder, or its .lock), then fd checked to be what `path` names now
    (`stat(path)`); LockError naming the holder otherwise; _NoFolderLock where the filesystem cannot flock it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not _same(fd, stat(path)):  # replaced between our open and our flock: what we hold guards nothing
            raise LockError(f"{flag} {folder}: {path} was replaced while it was being locked; try again")
    except BlockingIOError:
        pid = holder_pid(fd)
        os.close(fd)
        exited = pid.isdigit() and not pid_alive(int(pid))  # an unknown pid ("?"): say nothing about it
        who = f"a process started by pid {pid}, which has exited" if exited else f"pid {pid}"
        raise LockError(
            f"{flag} {folder}: the run folder is in use by another microgpt process ({who}); "
            "wait for it to end or stop it"
        ) from None
    except LockError:
        os.close(fd)
        raise
    except OSError as e:
        os.close(fd)
        if e.errno in NO_FOLDER_LOCKS and path == folder:
            raise _NoFolderLock from None
        raise LockError(f"{flag} {folder}: cannot lock the run folder ({e.strerror or e})") from None
    return RunLock(fd, path, folder)
