"""``nbaccel.runs`` and ``nbaccel.attach``: finding detached runs again after a restart.

The entry layer, beside ``launching.py``: it chooses how an attached run is shown (the
widget dashboard in a kernel, text elsewhere) and hands that to the launcher's
``AttachedRun``, which replays what happened and then follows the run live.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from nbaccel.config.resolve import resolve
from nbaccel.launcher.detached.attached import AttachedRun
from nbaccel.launcher.detached.run_listing import RunsTable, find_run, list_runs
from nbaccel.launcher.planned import shown
from nbaccel.launcher.run import Run
from nbaccel.sweeps.detached import AttachedSweep, find_sweep, show_attached
from nbaccel.ui.choose import choose_display


def runs(
    runs_dir: str | os.PathLike[str] | None = None,
    *,
    prune: int | datetime.timedelta | None = None,
) -> RunsTable:
    """The runs under ``runs_dir`` (the config's, by default), newest first: id, state,
    start, elapsed, world size and rank 0's last metrics; a table in Jupyter.

    ``prune=N`` removes all but the newest N finished runs' folders; a ``timedelta``
    removes finished runs started longer ago. A run still going is never removed.

    >>> import nbaccel, tempfile
    >>> nbaccel.runs(tempfile.mkdtemp())
    run  state  started  elapsed  world  last metrics
    """
    return list_runs(_runs_dir(runs_dir), prune)


def attach(
    run_id: str = "latest",
    *,
    runs_dir: str | os.PathLike[str] | None = None,
    dashboard: str | bool = "auto",
) -> Run | AttachedSweep:
    """Find a detached run (``launch(..., detach=True)``) again, from any kernel.

    The returned ``Run`` replays what happened (metrics, logs) into a new dashboard and then
    follows the run live; ``stop()``, ``wait()``, ``result()``, ``results()`` and ``logs()``
    work on it, also once it has ended. A sweep's id (``sweep-...``, from
    ``sweep(..., detach=True)``) gives the detached sweep: its ``table``, ``best``,
    ``wait()``, ``stop()``, and in a kernel its board, live.

    >>> import nbaccel, tempfile
    >>> nbaccel.attach(runs_dir=tempfile.mkdtemp())
    Traceback (most recent call last):
    ValueError: no detached run under ...: launch one with detach=True.
    """
    if run_id.startswith("sweep-"):
        choose_display(dashboard, blocking=False)  # a wrong choice fails before anything
        return show_attached(find_sweep(_runs_dir(runs_dir), run_id), dashboard)
    run = AttachedRun(find_run(_runs_dir(runs_dir), run_id))
    shown(choose_display(dashboard, blocking=False)(run, run.gpus))
    run.connect()
    return run


def _runs_dir(runs_dir: str | os.PathLike[str] | None) -> Path:
    if runs_dir is None:
        runs_dir = resolve({}, env=os.environ).config.runs_dir
    return Path(runs_dir).expanduser().resolve()
