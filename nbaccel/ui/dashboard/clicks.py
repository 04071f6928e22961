"""What the user's clicks and choices on a dashboard do: the log's rank, the metric, the
runs to compare, Stop and Stacks. Each is queued for the UI thread (``board.Dashboard``,
whose part this is), which alone writes widgets; Stop and Stacks call the run (Stacks on a
thread of its own: the ranks may take seconds to answer). A click reaches the kernel only
while no cell runs: in a blocking call these buttons are disabled.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class DashboardClicks:
    """The input half of ``board.Dashboard`` (its state is set up there)."""

    rank_selector: Any
    metric_selector: Any
    stop_button: Any
    stacks_button: Any
    compare: Any
    _writing: bool
    _stop: Callable[[], None] | None
    _stop_clicked: bool
    _stacks_of: Callable[[], dict[int, str]] | None
    _thread: threading.Thread | None
    _finished: threading.Event
    _put: Callable[..., None]
    tick: Callable[..., None]

    def listen(self) -> None:
        """Take the widgets' events from now on."""
        self.rank_selector.observe(self._on_rank, names="value")
        self.metric_selector.observe(self._on_metric, names="value")
        self.stop_button.on_click(self._on_stop)
        self.stacks_button.on_click(self._on_stacks)
        self.compare.observe(self._on_compare, names="value")

    def _on_rank(self, change: dict[str, Any]) -> None:
        if not self._writing:
            self._put(("rank", change["new"]), urgent=True)

    def _on_metric(self, change: dict[str, Any]) -> None:
        if not self._writing and change["new"] is not None:
            self._put(("metric", change["new"]), urgent=True)

    def _on_compare(self, change: dict[str, Any]) -> None:
        if self._writing:
            return
        thread = self._thread
        self._put(("compare", tuple(change["new"])), urgent=True)
        if self._finished.is_set():  # the UI thread has ended with the run: draw it here
            if thread is not None:
                thread.join(1.0)
            self.tick(force=True)

    def _on_stop(self, _button: Any) -> None:
        if self._stop is not None and not self._stop_clicked:
            self._stop_clicked = True  # once: the button is disabled only when the UI catches up
            self._stop()
            self._put(("stop", True), urgent=True)

    def _on_stacks(self, _button: Any) -> None:
        stacks_of = self._stacks_of
        if stacks_of is None:
            return

        def ask() -> None:  # off the kernel's main thread: the ranks may take 2 s or more
            try:
                answer: dict[int, str] | str = stacks_of()
            except Exception as error:  # noqa: BLE001 - shown in the panel: the run ended
                answer = str(error)
            self._put(("stacks", answer), urgent=True)

        threading.Thread(target=ask, name="nbaccel-stacks", daemon=True).start()
