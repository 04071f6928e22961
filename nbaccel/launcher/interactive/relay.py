"""``CellRelay``: the one subscriber of an interactive run, handing its events to the
display of the call in progress (a cell's printer), and noting each rank's end-of-command
marker (``serve.DONE_MARK``) so a call returns only once its output has been shown.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from nbaccel.events import Event, LogLine
from nbaccel.launcher.interactive.wire import DONE_MARK
from nbaccel.launcher.pump import Subscriber


class CellRelay:
    """Forwards every event to ``target`` (set per call); swallows the markers."""

    def __init__(self) -> None:
        self.target: Subscriber | None = None
        self._done: dict[int, int] = {}  # rank -> the last command whose output has ended
        self._changed = threading.Condition()

    def __call__(self, event: Event) -> None:
        if isinstance(event, LogLine) and event.text.startswith(DONE_MARK):
            with self._changed:
                self._done[event.rank] = int(event.text[len(DONE_MARK) :].strip())
                self._changed.notify_all()
            return
        target = self.target
        if target is not None:
            target(event)

    def wait_output(self, seq: int, ranks: Iterable[int], timeout: float) -> bool:
        """Wait until ``ranks`` have sent all their output of command ``seq``; False when
        ``timeout`` passed first (the output still shows, after the call returned)."""
        deadline = time.monotonic() + timeout
        wanted = tuple(ranks)
        with self._changed:
            while any(self._done.get(rank, -1) < seq for rank in wanted):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True
