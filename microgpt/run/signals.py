"""Signals during a run: SIGTERM and SIGINT (checkpoint, then stop), SIGUSR1 (checkpoint, keep training).

Weights, Adam m and v change only inside the step, so at any other moment they are the state after the last
completed step: a signal may be acted on at once. One that lands inside the critical section (a step until its
record is out, a checkpoint write) waits until the section is left. Under data parallel every signal waits: the
ranks agree on the signals received at the step boundary (dp.agree, dp.to_act) and act on them together.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Terminate(Exception):
    """Raised from the SIGTERM/SIGINT action after the checkpoint is written."""


def reason_of(signum: int) -> str:
    """The reason a signal's checkpoint records: SIGUSR1, or SIGTERM (for SIGINT too)."""
    return "SIGUSR1" if signum == signal.SIGUSR1 else "SIGTERM"


class Signals:
    """The run's signal handling: `act(reason)` now, or once the critical section is left (`leave_critical`);
    deferred (data parallel): never at once, the signals are handed to the group (`take_pending`)."""

    def __init__(self, act: Callable[[str], None], deferred: bool):
        self.act, self.deferred = act, deferred
        self.critical = False  # from the start of a step until it is reported, or in a checkpoint write
        self.pending: list[str] = []

    def install(self) -> None:
        for sig in HANDLED:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        reason = reason_of(signum)
        if self.critical or self.deferred:  # dp: handled after the step the ranks agree on (dp.act)
            self.pending.append(reason)
            return
        self.act(reason)

    def take_pending(self) -> list[str]:
        """The signals received during the step, handed to the data-parallel group to agree on."""
        taken, self.pending = self.pending, []
        return taken

    def leave_critical(self) -> None:
        self.critical = False
        while self.pending and not self.deferred:
            self.act(self.pending.pop(0))


def quiet_signals() -> None:
    """After the run: SIGUSR1 has nothing left to checkpoint (ignored); SIGTERM and Ctrl-C end the process at once,
    the last checkpoint being written already (the report card, if cut short, keeps its previous version)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
