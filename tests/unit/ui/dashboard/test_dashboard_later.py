"""A blocking call's widgets come ``dashboard_after`` s into its run: a shorter run shows only
its summary, and builds no widget at all; a longer one fills the place kept for them.

Each test fails if the widgets are built for a run that ended first, if a run that goes on
never gets them, or if the summary of a short run loses what its widgets would have said.
"""

from __future__ import annotations

import io
import sys
import threading
import time
from typing import Any

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from ipywidgets.widgets import widget as widget_module
from PIL import Image

from nbaccel.config.resolve import resolve
from nbaccel.config.schema import Config
from nbaccel.errors import ConfigError
from nbaccel.events import LogLine, Metric, RunEnded, RunStarted, RunState
from nbaccel.ui.dashboard.board import Dashboard
from nbaccel.ui.dashboard.model import DashboardModel, MemoryReading

MiB = 2**20
READINGS = [MemoryReading(f"rank {r} (cpu)", 300 * MiB, 310 * MiB, 2**34) for r in range(2)]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class FakeHandle:
    """What ``IPython.display.display(..., display_id=True)`` returns: its updates kept."""

    def __init__(self, shown: dict[str, Any]) -> None:
        self.shown = [shown]

    def update(self, data: dict[str, Any], raw: bool = False) -> None:
        assert raw
        self.shown.append(data)


@pytest.fixture
def outputs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The cell's outputs, in order: a dict shown without an id, or a FakeHandle."""
    from IPython import display as ipython_display

    shown: list[Any] = []

    def display(data: dict[str, Any], raw: bool = False, display_id: bool = False) -> Any:
        assert raw
        shown.append(FakeHandle(data) if display_id else data)
        return shown[-1] if display_id else None

    monkeypatch.setattr(ipython_display, "display", display)
    return shown


def shown_later(now: list[float], live_after: float = 0.25) -> Dashboard:
    """A blocking call's dashboard as a launch in a kernel shows it, on a test clock: the run
    starts (its workers are asked for), then the dashboard is shown while they start."""
    dash = Dashboard(
        DashboardModel(world_size=2), threaded=False, build=False, live_after=live_after,
        clock=lambda: now[0], blocking=True,
    )  # fmt: skip
    dash(RunStarted("run-1", 2, "", 0.0))
    dash.start()  # what RunStarted starts when threaded (here the test ticks)
    dash.show(later=True)
    dash.ready()
    return dash


def test_a_run_that_ends_before_dashboard_after_builds_no_widget_and_keeps_its_summary(
    outputs: list[Any],
) -> None:
    now, before = [100.0], set(widget_module._instances)
    dash = shown_later(now)
    dash(LogLine(0, "data shape (8, 2)", False, False, 0.0))
    dash.post_memory(READINGS)
    now[0] += 0.2
    dash.tick()
    dash(RunEnded(RunState.SUCCEEDED, None, 0.2, 0.0))
    dash.tick()
    assert dash.wait_finished(timeout=0) and not dash.built
    assert set(widget_module._instances) == before  # not one widget model
    place, text, image = outputs
    assert place.shown == [{"text/plain": ""}]  # kept empty: nothing was live to see
    summary = text.shown[-1]["text/plain"]
    assert "succeeded" in summary and "data shape (8, 2)" in summary  # the log's tail
    assert "memory rank 1 (cpu): 310.0 MiB peak" in summary
    # Two bars would say what those lines say: no picture (and matplotlib not asked).
    assert dash.summary_png is None and image.shown == [{"text/plain": ""}]
    assert dash._plots is None
    dash.close()  # nothing to close: no error


def test_a_short_run_that_logged_a_metric_keeps_its_curve_as_the_picture(
    outputs: list[Any],
) -> None:
    now = [100.0]
    dash = shown_later(now)
    dash.post_memory(READINGS)
    dash(Metric(0, 1, {"loss": 0.5}, 0.0))
    dash(Metric(0, 2, {"loss": 0.25}, 0.0))
    dash(RunEnded(RunState.SUCCEEDED, None, 0.1, 0.0))
    dash.tick()
    assert not dash.built and dash.summary_png is not None
    assert Image.open(io.BytesIO(dash.summary_png)).size == (640, 240)  # the curve alone
    assert outputs[2].shown[-1]["image/png"]


def test_a_run_that_goes_on_gets_its_widgets_in_their_kept_place(outputs: list[Any]) -> None:
    now = [100.0]
    dash = shown_later(now)
    dash(LogLine(0, "epoch 1", False, False, 0.0))
    dash.tick()
    assert not dash.built  # not due yet
    now[0] += 0.25
    dash.tick()
    assert dash.built and dash.visible_log == ["epoch 1"]  # what came before is shown
    assert "running" in dash.header.value
    place = outputs[0]
    assert place.shown[-1][WIDGET_VIEW]["model_id"] == dash.widget.model_id
    assert len(outputs) == 3  # filled in place, not shown below the summary's outputs
    dash.post_memory(READINGS)
    dash(RunEnded(RunState.SUCCEEDED, None, 0.3, 0.0))
    dash.tick()
    # Shown: the picture is the bars the widgets showed, as for any run.
    assert dash.summary_png == dash._frames["memory"] == bytes(dash.memory.value)
    dash.close()


def test_the_ui_thread_builds_them_when_due() -> None:
    dash = Dashboard(DashboardModel(world_size=2), build=False, live_after=0.05, blocking=True)
    dash(RunStarted("run-1", 2, "", 0.0))
    dash._shown_later = True  # as show(later=True), without a cell to show them in
    dash.ready()
    deadline = time.monotonic() + 30
    while not dash.built and time.monotonic() < deadline:
        dash.wait_finished(timeout=0.01)  # a bounded wait on the dashboard's own event
    assert dash.built
    ending = threading.Thread(target=dash, args=(RunEnded(RunState.SUCCEEDED, None, 1, 0),))
    ending.start()
    ending.join(timeout=30)
    assert not ending.is_alive() and "succeeded" in dash.header.value
    dash.close()


def test_launches_wait_dashboard_after_only_when_they_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nbaccel.ui import attach
    from tests.unit.ui.dashboard.test_dashboard import FakeRun

    monkeypatch.setattr(attach, "in_kernel", lambda: True)
    monkeypatch.setattr(attach, "_SHOWN", attach.ShownDashboards(limit=8))
    monkeypatch.setattr(Dashboard, "show", lambda self, later=False: None)
    run = FakeRun()
    run.config = Config(dashboard_after=2.0)
    blocking = attach.attach_dashboard(run, blocking=True, gpus=0)  # type: ignore[arg-type]
    assert blocking.live_after == 2.0 and not blocking.built
    other = FakeRun()
    launched = attach.attach_dashboard(other, blocking=False, gpus=0)  # type: ignore[arg-type]
    assert launched.live_after == 0.0 and launched.built  # the cell ends at once
    at_once = FakeRun()
    at_once.config = Config(dashboard_after=0)
    assert attach.attach_dashboard(at_once, blocking=True, gpus=0).built  # type: ignore[arg-type]
    for dash in (blocking, launched):
        dash.close()
    with pytest.raises(ConfigError, match="dashboard_after"):
        resolve({"dashboard_after": -1}, env={}, use_default_file=False)


def test_after_a_run_that_drew_nothing_the_ui_thread_imports_matplotlib(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Else the first run of a kernel that goes on pays the import (~0.3 s) while it is timed.
    import nbaccel.ui.dashboard

    monkeypatch.delitem(sys.modules, "nbaccel.ui.dashboard.plots")
    monkeypatch.delattr(nbaccel.ui.dashboard, "plots")
    dash = Dashboard(DashboardModel(world_size=2), build=False, live_after=60, blocking=True)
    dash(RunStarted("run-1", 2, "", 0.0))
    dash._shown_later = True
    dash.ready()
    ending = threading.Thread(target=dash, args=(RunEnded(RunState.SUCCEEDED, None, 1, 0),))
    ending.start()
    ending.join(timeout=30)
    assert dash._thread is not None
    dash._thread.join(timeout=30)
    assert not dash.built and dash._plots is None  # it drew nothing, and then:
    assert "nbaccel.ui.dashboard.plots" in sys.modules
