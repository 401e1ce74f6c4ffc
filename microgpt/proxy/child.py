"""The engine as the proxy sees it: a child process, its JSON lines, its exit.

The child runs in its own session (process group), so a terminal's Ctrl-C reaches only the proxy, which
decides what the engine gets (SIGTERM: checkpoint and exit). Its stdout lines go onto a queue read by the
proxy's main thread (which also has to notice signals and hangs, so it never blocks on the pipe); its
stderr (the memory plan, progress, errors) passes through to the proxy's stderr, and the last lines are
kept to explain a crash. Its `error:` lines are held until it exits (release): passed on as they are, or as
`engine: ...` lines when the proxy ends with an error line of its own, so a run says one `error:` line.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections import deque

ERROR = b"error: "


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


class Engine:
    """One `microgpt train` child: stdout lines arrive on a queue (None at EOF); stderr is passed through."""

    def __init__(self, cmd: list[str], env_extra: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()):
        """env_extra and pass_fds: what the child needs beyond our environment (the run folder's lock)."""
        env = {**os.environ, **(env_extra or {})}
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=env,
            pass_fds=pass_fds,
        )
        self.lines: queue.Queue = queue.Queue()
        self.tail: deque[str] = deque(maxlen=5)
        self.held: list[bytes] = []  # its `error:` lines, until release
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.err_thread = threading.Thread(target=self._read_stderr, daemon=True)
        self.err_thread.start()

    def _read_stdout(self) -> None:
        for raw in self.proc.stdout:
            self.lines.put(raw)
        self.lines.put(None)

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            if raw.startswith(ERROR):
                self.held.append(raw)
            else:
                sys.stderr.buffer.write(raw)
                sys.stderr.buffer.flush()
            text = raw.decode(errors="replace").strip()
            if text:
                self.tail.append(text)

    def release(self, demote: bool) -> bool:
        """After the engine exited (wait): its held `error:` lines onto the proxy's stderr, as they are, or with
        demote as `engine: ...` lines (the proxy's own error line will be the run's); whether an `error:` line went
        out."""
        held, self.held = self.held, []
        for raw in held:
            sys.stderr.buffer.write(b"engine: " + raw[len(ERROR) :] if demote else raw)
        sys.stderr.buffer.flush()
        return bool(held) and not demote

    def signal(self, sig: int) -> None:
        """SIGTERM/SIGUSR1 go to the engine alone (a data-parallel launcher relays them to its ranks in step);
        SIGKILL goes to its whole process group, so no rank of a killed engine is left behind."""
        try:
            if sig == signal.SIGKILL:
                os.killpg(self.proc.pid, sig)
            else:
                os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code; None if the engine is still running after `timeout` seconds."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self.err_thread.join(timeout=2)
        return rc
