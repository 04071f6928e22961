"""The frames of each rank's pdb sessions, as the kernel's console reads them.

A rank numbers every stop it asks about (``session``); its session's frames ("prompt",
"resumed") carry that number. ``SessionFrames`` keeps them per rank until the console that
serves that session takes them (``take``): frames of another session are stale (a session
ended by an interrupt while nobody read it) and are dropped, never shown as the new
session's. Every wait is bounded and ends once the rank's channel or the run has closed.
Stdlib only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

# How often a wait for a frame looks again whether the run has closed (an interrupt lands
# in the waiting thread between looks: Condition.wait with a timeout can be interrupted).
LOOK_AGAIN_S = 0.25


class SessionFrames:
    """Per-rank session frames, guarded by the hub's condition ``lock``.

    >>> import threading
    >>> frames = SessionFrames(threading.Condition())
    >>> frames.put(0, {"op": "resumed", "session": 1})  # session 1 ended unread
    >>> frames.put(0, {"op": "prompt", "session": 2})
    >>> frames.take(0, 2, closed=lambda: False)["op"]
    'prompt'
    >>> frames.lost(0); frames.take(0, 2, closed=lambda: False) is None
    True
    """

    def __init__(self, lock: threading.Condition) -> None:
        self._lock = lock
        self._frames: dict[int, list[dict[str, Any]]] = {}
        self._lost: set[int] = set()

    def put(self, rank: int, frame: dict[str, Any]) -> None:
        with self._lock:
            self._frames.setdefault(rank, []).append(frame)
            self._lock.notify_all()

    def lost(self, rank: int) -> None:
        """The rank's channel closed: nothing more comes from it."""
        with self._lock:
            self._lost.add(rank)
            self._lock.notify_all()

    def take(
        self, rank: int, session: int | None, closed: Callable[[], bool]
    ) -> dict[str, Any] | None:
        """The next frame of ``rank``'s ``session``, dropping other sessions' frames; None
        once the rank's channel or the run (``closed()``) has closed."""
        with self._lock:
            while True:
                queued = self._frames.setdefault(rank, [])
                while queued:
                    frame = queued.pop(0)
                    if frame.get("session") == session:
                        return frame
                if rank in self._lost or closed():
                    return None
                self._lock.wait(LOOK_AGAIN_S)

    def over(self, rank: int, session: int | None, closed: bool) -> bool:
        """Whether ``session`` has ended on the rank's side (its "resumed" is queued, the
        rank is gone, the run closed): then no line typed for it would be read."""
        with self._lock:
            if closed or rank in self._lost:
                return True
            return any(
                f["op"] == "resumed" and f.get("session") == session
                for f in self._frames.get(rank, ())
            )
