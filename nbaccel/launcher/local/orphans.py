"""Descendants that a run's workers left behind, ended when their run ends (in the helper).

The helper is a child subreaper: when a worker exits, its children that are still alive
become the helper's children. Those in the worker's process group are killed with it, but
one that left it (``subprocess.Popen(..., start_new_session=True)``, a daemon) would live
on until the kernel exits. So when a worker is reaped, every new child of the helper that is
neither a worker nor a spare is *adopted* by that worker's run, and when the run's last
worker is gone its adopted processes get SIGTERM (to their whole process group, which
reaches what they started), then SIGKILL after a grace period. Their own children, when
they come back to the helper in turn, are adopted by the same run and ended the same way.

Used only by the single-threaded helper loop: ``due`` tells it when to call ``kill_due``.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Collection

import psutil

GRACE_SECONDS = 1.0  # between SIGTERM and SIGKILL for an orphan


class Orphans:
    """pid -> run id of adopted processes, and the SIGKILLs scheduled for them.

    >>> orphans = Orphans(signal_group=lambda pid, signum: None)
    >>> orphans.adopt("run-a", [101, 102], known=set())
    >>> orphans.end_run("run-a", now=10.0)
    [101, 102]
    >>> orphans.due()
    11.0
    >>> orphans.forget(101), orphans.kill_due(now=11.0)
    ('run-a', [102])
    """

    def __init__(self, signal_group: Callable[[int, int], None]) -> None:
        self._signal_group = signal_group
        self._runs: dict[int, str] = {}  # adopted pid -> run id
        self._kill_at: dict[int, float] = {}  # pid -> when SIGKILL is due (SIGTERM was sent)
        self._ended: set[str] = set()  # runs whose workers are all gone (a few bytes each)

    def adopt_new_children(self, run_id: str, known: Collection[int]) -> None:
        """Adopt the helper's children that are not ``known`` (workers, spares, adopted)."""
        try:
            children = [p.pid for p in psutil.Process().children()]
        except psutil.Error:
            return  # best effort: the helper's shutdown sweeps whatever is left
        self.adopt(run_id, children, known)

    def adopt(self, run_id: str, pids: Collection[int], known: Collection[int]) -> None:
        new = [pid for pid in pids if pid not in known and pid not in self._runs]
        for pid in new:
            self._runs[pid] = run_id
        if run_id in self._ended:  # a grandchild of an orphan we are already ending
            self._terminate(new, time.monotonic())

    def end_run(self, run_id: str, now: float) -> list[int]:
        """The run's last worker is gone: SIGTERM its orphans; returns their pids."""
        self._ended.add(run_id)
        pids = [pid for pid, run in self._runs.items() if run == run_id]
        self._terminate(pids, now)
        return pids

    def forget(self, pid: int) -> str | None:
        """An adopted process was reaped: its run id (None if it was not adopted)."""
        # The run stays in _ended: the children this process leaves come back to the helper
        # after it is reaped, and are ended as soon as they are adopted.
        self._kill_at.pop(pid, None)
        return self._runs.pop(pid, None)

    def due(self) -> float | None:
        """When the next SIGKILL is due, if any."""
        return min(self._kill_at.values(), default=None)

    def kill_due(self, now: float) -> list[int]:
        """SIGKILL the process groups whose grace period is over; returns their pids."""
        late = [pid for pid, when in self._kill_at.items() if when <= now]
        for pid in late:
            del self._kill_at[pid]
            self._signal_group(pid, signal.SIGKILL)
        return late

    def _terminate(self, pids: Collection[int], now: float) -> None:
        for pid in pids:
            if pid not in self._kill_at:
                self._signal_group(pid, signal.SIGTERM)
                self._kill_at[pid] = now + GRACE_SECONDS
