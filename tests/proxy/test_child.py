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
