"""The engine child as the proxy sees it: its stdout lines on a queue, the tail of its stderr, its exit."""

from __future__ import annotations

import os
import signal
import sys

from microgpt.proxy.child import Engine, describe_exit
from microgpt.runlock import pid_alive

SCRIPT = "import sys; print('{\"event\": \"step\"}', flush=True); print('boom', file=sys.stderr); sys.exit(3)"


def test_lines_arrive_on_the_queue_and_the_stderr_tail_explains_the_exit(capfd) -> None:
    eng = Engine([sys.executable, "-c", SCRIPT])
    assert eng.lines.get(timeout=30) == b'{"event": "step"}\n' and eng.lines.get(timeout=30) is None
    assert eng.wait() == 3 and list(eng.tail) == ["boom"] and describe_exit(3) == "exit code 3"
    assert "boom" in capfd.readouterr().err  # passed through to the proxy's stderr


def test_sigkill_reaches_the_whole_group() -> None:
    eng = Engine([sys.executable, "-c", "import time; time.sleep(60)"])
    assert pid_alive(eng.proc.pid)
    eng.signal(signal.SIGKILL)
    assert eng.wait() == -signal.SIGKILL and describe_exit(-signal.SIGKILL) == "signal SIGKILL"
    assert not pid_alive(eng.proc.pid) and not pid_alive(None) and pid_alive(os.getpid())


ERRS = "import sys; print('plan', file=sys.stderr, flush=True); print('error: disk full', file=sys.stderr); sys.exit(4)"


def test_error_lines_are_held_until_the_exit_then_passed_on_or_demoted(capfd) -> None:
    """A run says one `error:` line: the engine's are held until it exits, then passed on as they are, or (the
    proxy ending with an error line of its own) as `engine: ...` lines; other lines pass through at once."""
    for demote, want in ((False, "error: disk full"), (True, "engine: disk full")):
        eng = Engine([sys.executable, "-c", ERRS])
        assert eng.wait() == 4 and list(eng.tail) == ["plan", "error: disk full"]
        assert capfd.readouterr().err == "plan\n"  # the error line is held
        assert eng.release(demote) is not demote
        assert capfd.readouterr().err == want + "\n" and eng.release(demote) is False  # released once
