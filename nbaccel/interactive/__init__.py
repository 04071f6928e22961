"""``nbaccel.Workers``: interactive workers, with each call shown as a launch is.

An entry point above the launcher (as ``launching.py`` is): the launcher's ``WorkerGroup``
keeps the processes and runs the calls; this adds the display, chosen as a launch chooses
it (``nbaccel.ui.choose``): in a Jupyter kernel with ipywidgets, every call (a
``%%nbaccel`` cell, ``workers.run``...) gets its own dashboard in its cell (log, loss curve,
memory with each rank's peak, step breakdown), which leaves its summary when the call ends;
elsewhere, rank-labelled text. A call that ends within ``dashboard_after`` having printed,
logged and raised nothing shows nothing (``call_display.py``).
"""

from __future__ import annotations

import signal
from typing import Any

from nbaccel.config.resolve import ConfigSource
from nbaccel.events import Event
from nbaccel.launcher.interactive import workers as _workers
from nbaccel.launcher.interactive.workers import WorkerGroup
from nbaccel.launcher.planned import KeptEnd
from nbaccel.launcher.pump import Subscriber
from nbaccel.launcher.run import Run
from nbaccel.ui.choose import wants_widgets


class Workers(WorkerGroup):
    """Persistent workers: ``run`` functions and cells on every rank, keeping their state.

    Takes what ``nbaccel.launch`` takes but the function, ``hosts=`` included (``detach=``,
    ``max_restarts=`` and ``num_machines=`` are refused); ``dashboard`` as in
    ``launch``: a dashboard per call in a kernel ("auto"), or text. torch.distributed is
    initialised on every rank, each on its device. See docs/interactive.md.

    >>> import nbaccel
    >>> def where():
    ...     import os, torch.distributed as dist
    ...     return dist.get_rank(), os.getpid()
    >>> with nbaccel.Workers(num_processes=2) as workers:
    ...     first = workers.run(where)
    ...     workers.push(step=3)
    ...     same = workers.run(where) == first
    ...     steps = workers.pull("step")
    >>> sorted(first), same, steps
    ([0, 1], True, {0: 3, 1: 3})
    """

    def __init__(
        self,
        num_processes: int | None = None,
        *,
        config: ConfigSource = None,
        dashboard: str | bool = "auto",
        **overrides: Any,
    ) -> None:
        from nbaccel.ui.choose import choose_display

        choose_display(dashboard, blocking=True)  # a wrong choice fails before anything starts
        self._widgets = wants_widgets(dashboard)
        super().__init__(num_processes, config=config, **overrides)

    @classmethod
    def take_over_shown(cls, run: Run, keep: KeptEnd, *, widgets: bool) -> Workers:
        """The group of a ``keep_workers`` launch's ranks (``WorkerGroup.take_over``), each
        call shown as ``Workers``' are (``widgets``: a dashboard per call)."""
        group = cls.__new__(cls)
        group._widgets = widgets
        group._adopt(run, keep)
        return group

    def _display(
        self, run: Run, gpus: int, show_ranks: frozenset[int] | None, stoppable: bool = False
    ) -> Subscriber:
        if not self._widgets:
            return super()._display(run, gpus, show_ranks, stoppable)
        from nbaccel.interactive.call_display import CallDisplay, Made

        # The ranks whose output this call shows, as the text output shows them: one rank's
        # log, or several ranks' lines together, labelled.
        visible = self._shown(run, show_ranks)
        shown = sorted(visible) if visible is not None else list(run.ranks)

        def make() -> Made:  # only for a call with something to show (call_display.py)
            from nbaccel.ui.attach import show_dashboard, subscribe_dashboard

            parts: list[Subscriber] = []  # the dashboard, and on several machines its memory
            dashboard = subscribe_dashboard(
                run,
                blocking=True,
                gpus=gpus,
                subscribe=parts.append,
                rank=shown[0],
                together=shown if len(shown) > 1 else (),
                # workers.launch: Stop interrupts the call, as the kernel's interrupt does
                stop=(lambda: run.signal_workers(signal.SIGINT)) if stoppable else None,
            )

            def to_every_part(event: Event) -> None:
                for part in parts:
                    part(event)

            def show(live: bool) -> None:
                if live:  # the call went on past dashboard_after: its widgets now
                    dashboard.live_after = 0.0
                show_dashboard(dashboard)

            return to_every_part, show

        return CallDisplay(make, run.config.dashboard_after, visible)


def last_workers() -> WorkerGroup | None:
    """The last ``nbaccel.Workers`` group made in this kernel: by ``nbaccel.Workers(...)``,
    or by a launch with ``keep_workers=True`` once its function returned on every rank
    (``run.workers`` waits for that). None when there is none, or it was dropped.

    >>> import nbaccel
    >>> nbaccel.notebook_launcher(lambda: 7, num_processes=1, keep_workers=True)
    nbaccel: the worker of run ... kept: run.workers or nbaccel.last_workers() (...) ...
    7
    >>> workers = nbaccel.last_workers()
    >>> workers.pull("result"), workers.close()
    ({0: 7}, None)
    """
    group: WorkerGroup | None = _workers.last_workers()
    return group
