"""Plots handed from one dashboard to the next (``board.Dashboard`` takes and gives back).

Kept apart from ``plots``, which imports matplotlib: a dashboard takes its plots on its
first frame, on its UI thread, never on the launch path; ``import_plots_ahead`` loads
matplotlib once a run is over, for the first frame of a later one.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any


class PlotPool:
    """Plots (a curve and memory bars) handed from one dashboard to the next.

    A plot keeps its axes drawn; a new one draws them whole first (~25 ms each) while the
    next launch like the last one finds them as they were and only blits (~2 ms). Taken
    at a dashboard's first frame, given back after its summary (two runs may draw at once:
    each holds its own); at most ``limit`` wait here (a figure is ~0.5 MB of pixels).

    >>> pool = PlotPool()
    >>> class Plots: CurvePlot = MemoryBars = object
    >>> pair = pool.take(Plots); pool.give(pair); pool.take(Plots) is pair
    True
    """

    def __init__(self, limit: int = 2) -> None:
        self.limit = limit
        self._free: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()

    def take(self, plots: Any) -> tuple[Any, Any]:
        """A free pair, else new ones (``plots``: the module, imported by the caller)."""
        with self._lock:
            if self._free:
                return self._free.pop()
        return plots.CurvePlot(), plots.MemoryBars()

    def give(self, pair: tuple[Any, Any]) -> None:
        with self._lock:
            if len(self._free) < self.limit:
                self._free.append(pair)


def import_plots_ahead() -> None:
    """Import matplotlib once a run's summary is out, while the kernel waits for its user: the
    first run that draws a frame (one that goes on, or logs a metric) would otherwise import it
    (0.3-0.4 s here) at its first frame or at its end, the call waiting for it. Runs that end
    before their widgets draw none, so a kernel of short runs would never have imported it."""
    with contextlib.suppress(ImportError):  # without matplotlib no frame is drawn: nothing to do
        from nbaccel.ui.dashboard import plots  # noqa: F401
