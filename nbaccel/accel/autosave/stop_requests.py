"""A stop request reaching one rank: SIGTERM or SIGUSR1 (Slurm's ``--signal``, a spot
notice, a k8s preStop hook, the launcher's "save and stop"), kept as a flag that the next
agreement spreads to every rank.

Installed only once the loop can answer (its first step boundary): before that a SIGTERM
ends the rank as it always did, so a function that never reaches a boundary is not left
running until the grace runs out. The handlers are the previous ones again afterwards.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

from nbaccel.events import SAVE_AND_STOP_SIGNALS

SIGNALS = SAVE_AND_STOP_SIGNALS


class StopRequests:
    """Whether this rank was asked to stop.

    >>> requests = StopRequests()
    >>> requests.requested
    False
    >>> requests.request("run.stop(save=True)"); requests.requested, requests.why
    (True, 'run.stop(save=True)')
    """

    def __init__(self) -> None:
        self.requested = False
        self.why = ""
        self._previous: dict[int, Any] = {}

    def request(self, why: str) -> None:
        if not self.requested:
            self.requested, self.why = True, why

    def install(self, restartable: bool = False) -> None:
        """Catch SIGTERM and SIGUSR1 from now on (main thread only: Python's rule).
        ``restartable`` (``max_restarts``): SIGUSR1 only, since torch elastic ends the ranks
        of a failed attempt with SIGTERM and starts them again."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum in SIGNALS:
            if restartable and signum == signal.SIGTERM:
                continue
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not self.requested:
            # One line in the rank's log: where the stop came from, when a run ends early.
            print(
                f"nbaccel: {name}: saving at the next step every rank agrees on, then stopping",
                file=sys.stderr,
                flush=True,
            )
        self.request(name)
