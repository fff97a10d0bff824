"""SIGTERM and Ctrl-C during training: finish the step under way, checkpoint, and say where the run
resumes.

Schedulers (Slurm, Kubernetes) send SIGTERM before they kill a job; a user presses Ctrl-C. The
first such signal asks the loop to stop after its current step; the loop checkpoints that
step and raises :class:`opd.errors.RunInterrupted`. Further SIGTERMs change nothing (under
torchrun every worker gets one from the scheduler and one forwarded by torchrun; the
scheduler's own deadline ends with SIGKILL anyway). A second Ctrl-C pressed a moment later
(``SECOND_PRESS_S``) stops at once (KeyboardInterrupt), abandoning the step: the run then
resumes from its last checkpoint. With several processes, every process stops at the same
step (the request is all-reduced once per step).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from opd.distributed import all_reduce, world

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SECOND_PRESS_S = 1.0
"""A Ctrl-C this soon after the first is the same press delivered twice (by the terminal to the
process group and again by torchrun), not a second press."""


class StopOnSignal:
    """While installed (from the main thread), a SIGTERM / SIGINT is remembered, not acted on."""

    def __init__(self, describe_resume: Callable[[], str]):
        self.describe_resume = describe_resume
        self.received: int | None = None
        self._received_at = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Take over the stop signals (signal handlers can only be set from the main thread)."""
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)

    def uninstall(self) -> None:
        """Give the stop signals back their previous handlers."""
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()

    def _handle(self, number: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.received is not None:
            if number == signal.SIGINT and now - self._received_at > SECOND_PRESS_S:
                raise KeyboardInterrupt
            return
        self.received, self._received_at = number, now
        after = (
            "press Ctrl-C again to stop at once"
            if number == signal.SIGINT
            else "SIGKILL stops at once"
        )
        print(
            f"opd: {signal.Signals(number).name} received: finishing the current step and saving a "
            f"checkpoint ({after}; {self.describe_resume()})",
            file=sys.stderr,
            flush=True,
        )

    def requested(self) -> int | None:
        """The signal that asked to stop (on any process), or None; every process gets the same
        answer."""
        number = self.received or 0
        if world().size > 1:
            number = int(all_reduce([float(number)], "max")[0])
        return number or None
