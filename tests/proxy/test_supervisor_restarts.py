"""The proxy's restart policy, in-process, against stand-in engines that fail on purpose (the real engine's
crashes, hangs and signals are in test_supervisor.py): bounded retries with backoff, no retry of bad input,
hang detection before the first step, a stop request during the backoff."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from microgpt.proxy.phases import make_schedule
from microgpt.proxy.supervisor import Supervisor
from tests.proxy._helpers import EXP


@pytest.fixture(autouse=True)
def restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def supervisor(tmp_path: Path, script: str, **proxy) -> Supervisor:
    raw = json.loads(json.dumps(EXP))
    raw["proxy"].update({"backoff_s": 0.01, **proxy})
    sup = Supervisor(make_schedule(raw, "e.json"), tmp_path / "run", "e.json")
    sup.engine_cmd = lambda ph, ckpt: [sys.executable, "-c", script]  # type: ignore[method-assign]
    return sup


def test_gives_up_after_max_restarts_with_growing_backoff(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, "import sys; print('boom', file=sys.stderr); sys.exit(5)", max_restarts=2)
    assert sup.run() == 1
    st = sup.state.data
    assert st["status"] == "crashed" and st["restarts"] == 2 and st["last_error"] == "engine exit code 5: boom"
    assert [r["backoff_s"] for r in st["restart_log"]] == [0.01, 0.02]
    assert [m["kind"] for m in sup.loss.data["marks"]] == ["phase", "restart", "restart"]
    on_disk = json.loads((tmp_path / "run" / "proxy-test.state.json").read_text())
    assert on_disk["status"] == "crashed" and on_disk["engine_pid"] is None


def test_bad_input_exit_code_2_is_not_retried(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, "import sys; print('error: e.json: bad', file=sys.stderr); sys.exit(2)")
    assert sup.run() == 2
    assert sup.state.data["restarts"] == 0 and sup.state.data["last_error"] == "engine exit code 2: error: e.json: bad"


def test_a_checkpoint_the_engine_cannot_write_is_not_retried(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """Exit code 4 (errors.EXIT_WRITE: a full disk) is a failure a restart cannot fix: no restart, run crashed."""
    line = "error: run/ckpt/step-00000003.bin: cannot write the checkpoint (No space left on device)"
    sup = supervisor(tmp_path, f"import sys; print({line!r}, file=sys.stderr); sys.exit(4)", max_restarts=3)
    assert sup.run() == 4
    st = sup.state.data
    assert st["restarts"] == 0 and st["status"] == "crashed" and st["last_error"] == f"engine exit code 4: {line}"
    err = capfd.readouterr().err.splitlines()
    # the engine's error line once, and last: the proxy's line before it does not repeat it (issue 57)
    assert err[-2:] == ["proxy: engine failed in a way a restart cannot fix, not retrying (exit code 4)", line]
    assert sum(line in e for e in err) == 1


def test_silence_before_the_first_step_is_a_hang(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    start = json.dumps({"event": "start", "step": 0})
    script = f"import time; print('not json', flush=True); print({start!r}, flush=True); time.sleep(60)"
    sup = supervisor(tmp_path, script, startup_timeout_s=0.5, max_restarts=0)
    assert sup.run() == 1
    assert sup.state.data["last_error"] == "hung: no output for 0.5 s"
    assert "engine: not json" in capfd.readouterr().err


def test_a_stop_during_the_backoff_ends_the_run_as_stopped(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, "import sys; sys.exit(5)", backoff_s=30)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    assert sup.run() == 0
    assert sup.state.data["status"] == "stopped" and sup.state.data["restarts"] == 1


def test_an_engine_that_ignores_sigterm_is_killed_after_stop_timeout(tmp_path: Path) -> None:
    step = json.dumps({"event": "step", "step": 1, "loss": 1.0})
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)"
    script = f"{ignore}; print({step!r}, flush=True); time.sleep(60)"
    sup = supervisor(tmp_path, script, stop_timeout_s=0.3)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    t0 = time.monotonic()
    assert sup.run() == 0
    assert time.monotonic() - t0 < 10 and sup.state.data["status"] == "stopped"
    assert sup.loss.last_step == 1


BEAT = json.dumps({"event": "heartbeat", "uptime_s": 0.0})


def test_heartbeats_keep_a_long_warm_up_alive_but_are_no_progress(tmp_path: Path) -> None:
    """An engine that only beats (a warm-up longer than the silence limit) is not silent; one that beats and never
    steps is hung after startup_timeout_s: heartbeats reset the silence clock, never the progress one."""
    warm = f"import time, sys\nfor _ in range(15):\n    print({BEAT!r}, flush=True); time.sleep(0.1)\nsys.exit(5)"
    sup = supervisor(tmp_path / "a", warm, silence_timeout_s=0.5, max_restarts=0)
    assert sup.run() == 1 and sup.state.data["last_error"] == "engine exit code 5"  # 1.5 s of beats: alive
    forever = f"import time\nwhile True:\n    print({BEAT!r}, flush=True); time.sleep(0.05)"
    sup = supervisor(tmp_path / "b", forever, silence_timeout_s=0.5, startup_timeout_s=1.0, max_restarts=0)
    assert sup.run() == 1 and sup.state.data["last_error"] == "hung: no output for 1 s"


def test_no_line_at_all_is_silence_found_before_the_startup_limit(tmp_path: Path) -> None:
    script = f"import time; print({BEAT!r}, flush=True); time.sleep(60)"
    sup = supervisor(tmp_path, script, silence_timeout_s=0.5, startup_timeout_s=600, max_restarts=0)
    assert sup.run() == 1
    assert sup.state.data["last_error"] == "silent: not even a heartbeat for 0.5 s (stopped or frozen)"
