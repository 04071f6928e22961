"""``nbaccel.launch`` and ``nbaccel.notebook_launcher``, the calls users make.

An entry point above the launcher: it chooses how the run is shown (the widget dashboard
in a kernel, text elsewhere: ``nbaccel.ui.choose``) and hands that to the launcher's
``start``, which checks everything and starts the workers. The launcher itself never
imports the UI (DESIGN.md §2; ``tests/unit/test_import_layers.py``).
"""

from __future__ import annotations

import contextvars
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from nbaccel.config.accelerate.launcher_keywords import given_arguments
from nbaccel.config.resolve import ConfigSource
from nbaccel.errors import hidden_frames
from nbaccel.launcher.api import start
from nbaccel.launcher.interactive.on_rank import serve_kept
from nbaccel.launcher.planned import Keeper, KeptEnd
from nbaccel.launcher.run import Run
from nbaccel.ui.choose import choose_display, wants_widgets


def launch(
    function: Callable[..., Any],
    args: tuple[Any, ...] | list[Any] = (),
    num_processes: int | None = None,
    mixed_precision: str | None = None,
    use_port: str | int | None = None,
    master_addr: str | None = None,
    node_rank: int | None = None,
    num_nodes: int | None = None,
    rdzv_backend: str | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_conf: Mapping[str, Any] | None = None,
    rdzv_id: str | None = None,
    max_restarts: int | None = None,
    monitor_interval: float | None = None,
    log_line_prefix_template: str | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    config: ConfigSource = None,
    dashboard: str | bool = "auto",
    **overrides: Any,
) -> Run:
    """Start ``function(*args, **kwargs)`` on every worker and return at once with a ``Run``.

    Takes ``notebook_launcher``'s arguments, positional ones included. Any Config field can
    be given as a keyword (``mixed_precision="bf16"``); ``config`` is a Config, a mapping or
    a YAML path.

    >>> import nbaccel
    >>> def add(a, b):
    ...     return a + b
    >>> run = nbaccel.launch(add, args=(2, 3), num_processes=2)
    >>> run.results()
    {0: 5, 1: 5}
    """
    # Accelerate's parameters that were given (None: not given, so files and env count).
    given = given_arguments(locals())
    with hidden_frames():  # an error says what is wrong: nbaccel's frames would not
        show = choose_display(dashboard, blocking=False)
        keep = kept_workers_maker(dashboard)
        return start(
            function, args, num_processes, kwargs, config, given | overrides, show=show, keep=keep
        )


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] | list[Any] = (),
    num_processes: int | None = None,
    mixed_precision: str | None = None,
    use_port: str | int | None = None,
    master_addr: str | None = None,
    node_rank: int | None = None,
    num_nodes: int | None = None,
    rdzv_backend: str | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_conf: Mapping[str, Any] | None = None,
    rdzv_id: str | None = None,
    max_restarts: int | None = None,
    monitor_interval: float | None = None,
    log_line_prefix_template: str | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    config: ConfigSource = None,
    dashboard: str | bool = "auto",
    **overrides: Any,
) -> Any:
    """Run ``function(*args)`` on every worker, stream their output, return rank 0's value.

    A drop-in for ``accelerate.notebook_launcher``: its parameters in its order, so
    ``notebook_launcher(train, args, 2, "bf16")`` means ``mixed_precision="bf16"`` here too.
    Each is mapped onto the config or refused with the reason
    (``nbaccel.config.accelerate.launcher_keywords``); one left out (None) takes its value
    from the config file and env, else nbaccel's default. Any Config field is a keyword too.
    A failing rank raises its own exception type (or ``nbaccel.WorkerError``), naming the
    rank, with the worker's traceback chained. An interrupt stops every worker and re-raises.
    Every launch leaves a folder ``runs_dir/<run id>/`` (``./nbaccel_runs/`` by default: the
    config, every rank's log, the metrics, the results). Where nbaccel differs from
    Accelerate: docs/coming-from-accelerate.md.

    >>> import nbaccel
    >>> def world(scale):
    ...     import torch.distributed as dist
    ...     return dist.get_world_size() * scale
    >>> nbaccel.notebook_launcher(world, args=(10,), num_processes=2)
    20
    """
    # Accelerate's parameters that were given (None: not given, so files and env count).
    given = given_arguments(locals())
    with hidden_frames():  # an error says what is wrong: nbaccel's frames would not
        show = choose_display(dashboard, blocking=True)
        keep = kept_workers_maker(dashboard)
        run = start(
            function, args, num_processes, kwargs, config, given | overrides, show=show, keep=keep
        )
        try:
            run.wait()
        except KeyboardInterrupt:
            interrupted = time.monotonic()
            run.stop()
            raise stopped(run, time.monotonic() - interrupted) from None
        value = run.result()
        if run.config.keep_workers:
            run.workers  # noqa: B018 - kept before the cell ends: nbaccel.last_workers() has them
        return value


def kept_workers_maker(dashboard: str | bool) -> Keeper:
    """What keeps a ``keep_workers`` launch's workers: each rank serves the kernel once its
    function returned, and the kernel makes their ``nbaccel.Workers`` group (on the run's
    own thread), shown as the launch was: a dashboard per call and the kept workers' panel
    with its Release button in this cell, or text."""
    widgets = wants_widgets(dashboard)
    cell = contextvars.copy_context()  # the panel lands in the launching cell

    def make(run: Run, keep: KeptEnd) -> Any:
        from nbaccel.interactive import Workers
        from nbaccel.ui.kept_panel import show_kept

        group = Workers.take_over_shown(run, keep, widgets=widgets)
        try:
            cell.run(show_kept, group, run.run_id, widgets)
        except Exception as error:  # noqa: BLE001 - the workers are kept all the same
            print(f"nbaccel: the kept workers' panel failed: {error!r}", file=sys.__stderr__)
        return group

    return Keeper(serve=serve_kept, make=make)


def debug_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] | list[Any] = (),
    num_processes: int = 2,
) -> Any:
    """Run ``function(*args)`` on ``num_processes`` CPU processes, for debugging and tests.

    Accelerate's ``debug_launcher``, with its meaning: distributed over gloo on the CPU even
    where GPUs exist, and without mixed precision; everything else comes from the config as
    in ``notebook_launcher`` (which this is, with ``use_cpu=True, mixed_precision="no"``).
    Unlike Accelerate's (which returns ``None``), it returns rank 0's value.

    >>> import nbaccel
    >>> def where():
    ...     import torch, torch.distributed as dist
    ...     return dist.get_world_size(), str(torch.tensor(0).device)
    >>> nbaccel.debug_launcher(where)
    (2, 'cpu')
    """
    with hidden_frames():
        return notebook_launcher(function, args, num_processes, use_cpu=True, mixed_precision="no")


def stopped(run: Run, seconds: float) -> KeyboardInterrupt:
    """The interrupt ``notebook_launcher`` re-raises once it has stopped the run's workers:
    it says so (in text mode nothing else does), with how many and how long it took, and
    carries ``run_dir`` (the run's folder: each rank's output up to the stop).

    >>> from pathlib import Path
    >>> from nbaccel.config.schema import Config
    >>> print(stopped(Run("r1", Path("/runs/r1"), Config(), 2), 0.314))
    ... # doctest: +NORMALIZE_WHITESPACE
    interrupted: nbaccel stopped the 2 workers of run r1 (and what they started) in 0.31 s;
    their output is in /runs/r1
    """
    workers = len(run.ranks)
    who = f"the {workers} workers" if workers != 1 else "the worker"
    interrupt = KeyboardInterrupt(
        f"interrupted: nbaccel stopped {who} of run {run.run_id} (and what they started) in "
        f"{seconds:.2f} s; their output is in {run.run_dir}"
    )
    interrupt.run_dir = run.run_dir  # type: ignore[attr-defined]
    return interrupt
