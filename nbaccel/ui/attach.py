"""Attach the live dashboard to a run: what ``nbaccel.launch`` does in a Jupyter kernel.

``attach_dashboard(run, ...)`` builds the model (labelled with the run's strategy and
precision), the memory sampler for the run's devices, and the widgets; subscribes them to
the run, shows them in the calling cell and starts their threads. On XLA the workers read
their device memory themselves; a subscriber hands their ``DeviceMemory`` events to the
sampler's source. ``dashboard_for(run)`` finds that dashboard again (notebook tests read
its widgets; ``Dashboard.model_ids`` names them in a saved notebook's widget state).
``ShownDashboards`` closes dashboards whose cell has moved on (their summaries stay), so a
long-lived kernel keeps a bounded number of widgets. Imported only when a dashboard is wanted.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from nbaccel.events import DeviceMemory, Event
from nbaccel.launcher.run import Run
from nbaccel.ui.dashboard.board import Dashboard
from nbaccel.ui.dashboard.clicks import request_save_stop
from nbaccel.ui.dashboard.memory import MemorySampler, ReportedMemory, memory_source
from nbaccel.ui.dashboard.model import TOGETHER, DashboardModel
from nbaccel.ui.dashboard.plot_pool import PlotPool
from nbaccel.ui.kernel import in_kernel

_dashboards: weakref.WeakKeyDictionary[Run, Dashboard] = weakref.WeakKeyDictionary()
MAX_LIVE_DASHBOARDS = 8  # beyond this many, the oldest dashboards close
# The kernel's dashboards hand their plots on, so a relaunch blits its frames (board.py).
_PLOTS = PlotPool()


def attach_dashboard(
    run: Run,
    *,
    blocking: bool,
    gpus: int,
    show: bool = True,
    subscribe: Callable[[Callable[[Event], None]], None] | None = None,
    rank: int | None = None,
    together: Sequence[int] = (),
) -> Dashboard:
    """Build a run's dashboard, subscribe it to the run, and show it in the calling cell.

    Its threads start with the run. ``gpus``: the GPUs the run uses (0 on CPU). Find the
    dashboard again with ``dashboard_for(run)``. ``subscribe``: what subscribes the
    dashboard's parts instead of ``run.subscribe`` (interactive workers: a dashboard per call
    of one long run, fed from its ``RunStarted`` to its ``RunEnded``). ``rank``: the rank
    shown first. ``together``: ranks whose lines the log shows together, rank-labelled as the
    text output does (``%%nbaccel --ranks all``), first and in the summary.
    """
    dashboard = subscribe_dashboard(
        run, blocking=blocking, gpus=gpus, subscribe=subscribe, rank=rank, together=together
    )
    show_dashboard(dashboard, show=show)
    return dashboard


def subscribe_dashboard(
    run: Run,
    *,
    blocking: bool,
    gpus: int,
    subscribe: Callable[[Callable[[Event], None]], None] | None = None,
    rank: int | None = None,
    together: Sequence[int] = (),
    stop: Callable[[], None] | None = None,
) -> Dashboard:
    """``attach_dashboard``'s first half: the dashboard, subscribed to the run, without its
    widgets yet. A launch calls it before the workers start (no event is missed) and
    ``show_dashboard`` once they are started: the widgets are built while the ranks start.
    ``stop``: what the Stop button does (``workers.launch``, a call of interactive workers
    that does not block: interrupt the call); else a launch without blocking stops its run."""
    add = subscribe if subscribe is not None else run.subscribe
    # Closures hold the run weakly: the registry's value must not keep its key alive.
    ref = weakref.ref(run)
    shown = run.shown_ranks()
    first = rank if rank is not None else (min(shown) if shown else run.ranks[0])
    source = memory_source(
        world_size=run.world_size,
        gpus=gpus,
        strategy=run.config.strategy,
        pids=lambda: _pids(ref),
        env=os.environ,
        xla_device=run.xla_device,
        remote=bool(run.config.hosts),  # the workers there report their own memory
        gpu_ids=run.config.gpu_ids,  # the GPUs the workers see among the kernel's
    )
    # The sampler's callback finds the dashboard when it first runs (after the run starts).
    sampler = MemorySampler(source, lambda readings: dashboard.post_memory(readings))
    if isinstance(source, ReportedMemory):
        add(_reports_to(source, sampler))
    model = DashboardModel.for_config(run.config, run.world_size, run.ranks, together=together)
    if together:  # labelled by host at once: a call's dashboard sees no worker start
        model.hosts.update({r: host for r in together if (host := run.host_of(r))})
    dashboard = Dashboard(
        model,
        stop=stop if (blocking or stop is not None) else lambda: _request_stop(ref),
        # a call's Stop (workers.launch) interrupts it; its run, the workers, saves nothing
        save_stop=None if (blocking or stop is not None) else lambda: request_save_stop(ref),
        stacks=None if blocking else lambda: _stacks_now(ref),
        blocking=blocking,
        rank=TOGETHER if together else (first if first in run.ranks else run.ranks[0]),
        sampler=sampler,
        plots=_PLOTS,
        build=False,
        # A blocking call's short run shows only its summary (board.py: why); a run
        # launched without blocking shows its widgets at once (the cell ends meanwhile).
        live_after=run.config.dashboard_after if blocking else 0.0,
    )
    _dashboards[run] = dashboard
    add(dashboard)
    if not blocking:  # nothing can reach its widgets once the Run is gone
        weakref.finalize(run, dashboard.close)
    return dashboard


def show_dashboard(dashboard: Dashboard, *, show: bool = True) -> None:
    """Show a subscribed dashboard in the calling cell (in a kernel, unless ``show`` is
    False): its widgets now, or ``live_after`` s into the run (their place is kept); from
    then on its UI thread writes them. Outside a kernel the widgets are built at once."""
    shown = show and in_kernel()  # outside a kernel there is no frontend to show it in
    later = shown and dashboard.live_after > 0
    if not later:
        dashboard.build_widgets()
    if shown:
        _SHOWN.add(dashboard, _cell_key())
        dashboard.show(later=later)
    dashboard.ready()


class ShownDashboards:
    """The dashboards shown in this kernel, so that their widgets do not pile up.

    ipywidgets keeps every widget (and each widget's layout and style) until it is closed:
    21 launches left 777 of them. A dashboard is closed, leaving its static summary in its
    cell, when a newer one is shown from the same cell (the cell ran again, or a loop in it
    launched again), or when more than ``limit`` newer ones exist. Weak references: a closed
    dashboard is freed with its run.
    """

    def __init__(self, limit: int = MAX_LIVE_DASHBOARDS) -> None:
        self.limit = limit
        self._shown: list[tuple[str | None, weakref.ref[Dashboard]]] = []  # oldest first

    def add(self, dashboard: Dashboard, cell: str | None) -> None:
        live: list[tuple[str | None, weakref.ref[Dashboard]]] = []
        for shown_cell, ref in self._shown:
            older = ref()
            if older is None or older.closed:
                continue
            if cell is not None and shown_cell == cell:
                older.close()  # the cell moved on: its newer dashboard replaces this one
            else:
                live.append((shown_cell, ref))
        live.append((cell, weakref.ref(dashboard)))
        for _, ref in live[: -self.limit]:
            older = ref()
            if older is not None:
                older.close()
        self._shown = live[-self.limit :]


_SHOWN = ShownDashboards()


def _cell_key() -> str | None:
    """What identifies the cell a launch runs in: JupyterLab's and VS Code's cell id, else
    the execute request (so a loop in one cell still counts as one cell)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    kernel = getattr(shell, "kernel", None)
    try:
        parent: dict[str, Any] = kernel.get_parent() if kernel is not None else {}
    except Exception:  # noqa: BLE001 - an unusual kernel: no cell rule, the limit remains
        return None
    cell = (parent.get("metadata") or {}).get("cellId")
    message = (parent.get("header") or {}).get("msg_id")
    return str(cell or message) if (cell or message) else None


def dashboard_for(run: Run) -> Dashboard | None:
    """The dashboard that a launch attached to ``run`` (None when it printed text)."""
    return _dashboards.get(run)


def _reports_to(source: ReportedMemory, sampler: MemorySampler) -> Callable[[Event], None]:
    """A run subscriber that hands workers' memory reports to ``source``."""

    def on_event(event: Event) -> None:
        if isinstance(event, DeviceMemory) and source.post(event):
            sampler.wake()  # a rank's first report: show it now, not at the next interval

    return on_event


def _pids(ref: weakref.ref[Run]) -> dict[int, int]:
    run = ref()
    return run.worker_pids if run is not None else {}


def _stacks_now(ref: weakref.ref[Run]) -> dict[int, str]:
    """Every rank's stack now (the Stacks button's, on a thread of its own)."""
    run = ref()
    if run is None:
        raise RuntimeError("the run is gone")
    return run.stacks()


def _request_stop(ref: weakref.ref[Run]) -> None:
    # Runs on the kernel's main thread (a click): ask for the stop, do not wait for it.
    run = ref()
    if run is None:
        return
    try:
        run.stop(timeout=0.0)
    except TimeoutError:
        pass  # the run ends on its pump thread; the dashboard shows it
