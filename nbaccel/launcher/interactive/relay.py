"""``CellRelay``: the one subscriber of an interactive run, handing its events to the
display of the call in progress (a cell's printer), and noting each rank's end-of-command
mark (``wire.done_mark``, an ``OutputMark`` event: never in a log) so a call returns only
once its output has been shown.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from nbaccel.events import Event, OutputMark
from nbaccel.launcher.interactive.wire import done_seq
from nbaccel.launcher.pump import Subscriber


class CellRelay:
    """Forwards every event to ``target`` (set per call) but the marks."""

    def __init__(self) -> None:
        self.target: Subscriber | None = None
        self._done: dict[int, int] = {}  # rank -> the last command whose output has ended
        self._changed = threading.Condition()

    def __call__(self, event: Event) -> None:
        if isinstance(event, OutputMark):
            seq = done_seq(event.text)
            if seq is not None:
                with self._changed:
                    self._done[event.rank] = seq
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
