"""What a ``keep_workers`` launch leaves in its cell under its dashboard: the kept workers,
each rank's memory, and a Release button that ends them (their processes, and with them
the device memory they hold). Text elsewhere: one line saying how to reach them.

Made on the thread that takes the workers over, once the function returned on every rank
(``launcher.outcome.kept``), in the launching cell's context, so that it lands in that cell.
Updated after each call of the workers and when they end (``workers.watch``).
"""

from __future__ import annotations

import html
import sys
from typing import Any

from nbaccel.launcher.interactive.workers import WorkerGroup
from nbaccel.ui.panel.config_widgets import format_bytes

RELEASE_TOOLTIP = "End the kept workers: their processes and the device memory they hold"


def kept_text(workers: WorkerGroup, run_id: str) -> str:
    """The line text mode prints once the workers are kept."""
    who = "the worker" if workers.world_size == 1 else f"the {workers.world_size} workers"
    return (
        f"nbaccel: {who} of run {run_id} kept: run.workers or nbaccel.last_workers() "
        "(%%nbaccel cells, workers.run, workers.state_dict, workers.map); workers.close() "
        "ends them\n"
    )


def memory_text(memory: dict[int, dict[str, int]]) -> str:
    """Each rank's memory, in a line.

    >>> memory_text({0: {"rss": 2 << 30, "cuda_allocated": 1 << 30}, 1: {"rss": 1 << 30}})
    'rank 0: 2.00 GiB RAM, 1.00 GiB GPU · rank 1: 1.00 GiB RAM'
    """
    parts = []
    for rank, values in sorted(memory.items()):
        held = values.get("pss", values.get("rss"))  # shared pages counted once when known
        text = f"rank {rank}: " + (format_bytes(held) + " RAM" if held is not None else "?")
        if "cuda_allocated" in values:
            text += f", {format_bytes(values['cuda_allocated'])} GPU"
        parts.append(text)
    return " · ".join(parts)


class KeptPanel:
    """The kept workers' line and Release button (ipywidgets)."""

    def __init__(self, workers: WorkerGroup, run_id: str) -> None:
        import ipywidgets as widgets

        self._workers, self._run_id = workers, run_id
        self.label = widgets.HTML()
        self.button = widgets.Button(
            description="Release", icon="power-off", tooltip=RELEASE_TOOLTIP
        )
        self.button.on_click(self._release)
        self.box = widgets.HBox([self.button, self.label])
        self.box.add_class("nbaccel-kept-workers")
        workers.watch(self.update)
        self.update(workers)

    def update(self, workers: WorkerGroup) -> None:
        if not workers.alive:
            self.label.value = (
                f"<small>the workers of run {html.escape(self._run_id)} are released</small>"
            )
            self.button.disabled = True
            return
        memory = html.escape(memory_text(workers.memory))
        self.label.value = (
            f"<small><b>{workers.world_size} workers kept</b> (run {html.escape(self._run_id)}"
            f"; run.workers, nbaccel.last_workers()): {memory}</small>"
        )

    def _release(self, _button: Any) -> None:
        self.button.disabled = True
        try:
            self._workers.close(why="the Release button")
        except Exception as error:  # noqa: BLE001 - said in the panel; the click must return
            self.label.value = f"<small>release failed: {html.escape(str(error))}</small>"
            return
        self.update(self._workers)  # said by the click itself, not only by the group's watchers


def show_kept(workers: WorkerGroup, run_id: str, widgets: bool) -> None:
    """Show the kept workers in the calling cell: the panel, or the line in text."""
    if not widgets:
        sys.stdout.write(kept_text(workers, run_id))
        sys.stdout.flush()
        return
    from IPython import display as ipython_display

    workers.read_memory()  # the devices' counters too, read once now
    show: Any = ipython_display.display  # untyped
    show(KeptPanel(workers, run_id).box)
