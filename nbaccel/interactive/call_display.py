"""A call's widget display that shows nothing until the call has something to show.

The rule (docs/interactive.md): a call of ``nbaccel.Workers`` that ends within
``dashboard_after`` (0.25 s by default) having printed nothing (on the ranks it shows),
logged no metric, stalled nowhere and raised nothing adds nothing to its cell; a loop of
``workers.run`` shows its values only, at the cost of the text display. Any other call is
shown as before: one that goes on past ``dashboard_after`` gets its live widgets (then its
summary), one that ends sooner with something to show gets its summary alone.

Until one of those happens the call's events are held here, and no dashboard exists: making
one (its model, memory sampler, UI thread, and three outputs reserved in the cell) cost a
quiet call ~4 ms, four times its round trip. The events come from the kernel's main thread
(``RunStarted``, ``RunEnded``), the run's pump thread (output, metrics) and a timer (the call
went on); one lock keeps them in order. The dashboard is made and shown in the calling
cell's context (``contextvars``), so a display from the timer's thread lands in that cell.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable

from nbaccel.events import (
    Event,
    LogLine,
    Metric,
    RunEnded,
    RunStarted,
    RunState,
    StallWarning,
    StepBreakdown,
    WorkerFailed,
)
from nbaccel.launcher.pump import Subscriber

# What ``make`` gives: the dashboard's subscriber, and what shows it (``live``: its widgets
# at once, the call having gone on; else the summary alone, the call having ended).
Made = tuple[Subscriber, Callable[[bool], None]]


class CallDisplay:
    """One call's display (a run subscriber from ``RunStarted`` to ``RunEnded``).

    ``make`` builds the dashboard, subscribed but not shown; ``live_after``: the config's
    ``dashboard_after``; ``shown``: the ranks whose output the call shows (None: all).

    >>> from nbaccel.events import RunEnded, RunStarted, RunState
    >>> made = []
    >>> display = CallDisplay(lambda: made.append(1) or (print, print), 60.0, None)
    >>> display(RunStarted("r", 2, "/tmp/r", 0.0))
    >>> display(RunEnded(RunState.SUCCEEDED, None, 0.01, 0.0))
    >>> made  # a short quiet call: no dashboard was made
    []
    """

    def __init__(
        self, make: Callable[[], Made], live_after: float, shown: frozenset[int] | None
    ) -> None:
        self._make, self._live_after, self._shown = make, live_after, shown
        self._context = contextvars.copy_context()  # the calling cell's (its parent message)
        self._lock = threading.Lock()
        self._held: list[Event] = []
        self._worth = False  # the call has shown something: its summary is kept
        self._target: Subscriber | None = None
        self._ended = False
        self._timer: threading.Timer | None = None

    def __call__(self, event: Event) -> None:
        with self._lock:
            if self._ended:
                return  # the call's display is done: nothing after its end
            if not isinstance(event, RunEnded):
                if self._target is not None:
                    self._target(event)  # in order with the others: under the lock
                else:
                    self._hold(event)
                return
            self._ended = True
            if self._timer is not None:
                self._timer.cancel()
            target, held = self._target, [*self._held, event]
            worth = self._worth or self._worth_showing(event)
            self._held = []
        # The end, outside the lock (nothing else gets in now): it waits for the summary.
        if target is not None:
            target(event)
        elif worth:  # ended within dashboard_after, with something to show: the summary
            target, show = self._context.run(self._make)
            for each in held:
                target(each)
            self._context.run(show, False)

    def _hold(self, event: Event) -> None:
        """Under the lock, before any dashboard: hold ``event`` until the call goes on or
        ends."""
        self._held.append(event)
        self._worth = self._worth or self._worth_showing(event)
        if isinstance(event, RunStarted):
            if self._live_after <= 0:  # dashboard_after=0: the widgets at once, as before
                self._go_live_now()
            else:
                self._timer = threading.Timer(self._live_after, self._go_live)
                self._timer.daemon = True
                self._timer.start()

    def _worth_showing(self, event: Event) -> bool:
        if isinstance(event, LogLine):
            return self._shown is None or event.rank in self._shown
        if isinstance(event, RunEnded):
            return event.state is not RunState.SUCCEEDED  # its failure or interrupt
        return isinstance(event, (Metric, StepBreakdown, StallWarning, WorkerFailed))

    def _go_live(self) -> None:
        """The timer's thread: the call went on past ``dashboard_after``."""
        with self._lock:
            if self._target is None and not self._ended:
                self._go_live_now()

    def _go_live_now(self) -> None:
        """Under the lock: make the dashboard, give it the events held, show its widgets in
        the calling cell."""
        target, show = self._context.run(self._make)
        held, self._held = self._held, []
        for event in held:
            target(event)
        self._context.run(show, True)
        self._target = target
