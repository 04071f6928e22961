"""What keeps a launch's widget dashboard cheap: widgets built while the ranks start, no
frame before the first interval, plots handed from one dashboard to the next, a summary
made of the final frames, and widgets sharing their layout and style models.

Each test fails if its saving is undone; docs/benchmarks.md has what each one saved.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from ipywidgets.widgets import widget as widget_module
from PIL import Image

from nbaccel.events import LogLine, Metric, RunEnded, RunStarted, RunState
from nbaccel.ui.dashboard import plots
from nbaccel.ui.dashboard.board import Dashboard
from nbaccel.ui.dashboard.model import DashboardModel, MemoryReading
from nbaccel.ui.dashboard.plot_pool import PlotPool
from nbaccel.ui.dashboard.widgets import DashboardWidgets

MiB = 2**20
PNG = b"\x89PNG\r\n\x1a\n"
READINGS = [MemoryReading(f"rank {r} (cpu)", 300 * MiB, 310 * MiB, 2**34) for r in range(2)]


def started(dash: Dashboard) -> None:
    dash(RunStarted("run-1", 2, "", 0.0))


def ended(dash: Dashboard, state: RunState = RunState.SUCCEEDED) -> None:
    dash(RunEnded(state, None, 1.0, 1.0))


def size_of(png: bytes) -> tuple[int, int]:
    width, height = Image.open(io.BytesIO(png)).size
    return width, height


# ----- widgets built while the ranks start ----------------------------------------------------
def test_events_before_the_widgets_are_built_are_shown_once_they_are() -> None:
    dash = Dashboard(DashboardModel(world_size=2), build=False)
    started(dash)  # the run started: the UI thread waits for the widgets
    assert dash._thread is None and not hasattr(dash, "header")
    dash(LogLine(0, "before the widgets", False, False, 0.0))
    dash.build_widgets()
    dash.ready()
    assert dash._thread is not None  # now it writes them
    dash.flush()
    assert dash.visible_log == ["before the widgets"]
    ending = threading.Thread(target=ended, args=(dash,))
    ending.start()  # as the run's pump thread: it waits for the summary
    ending.join(timeout=30)
    assert not ending.is_alive() and dash.wait_finished(timeout=0)
    assert "succeeded" in dash.header.value


def test_a_run_that_ended_before_its_widgets_were_built_has_its_summary_when_ready_returns() -> (
    None
):
    dash = Dashboard(DashboardModel(world_size=2), build=False)
    started(dash)
    dash.post_memory(READINGS)
    ended(dash, RunState.FAILED)  # no UI thread yet: the pump thread does not wait
    assert not dash.wait_finished(timeout=0)
    dash.build_widgets()
    dash.ready()  # the launch's main thread waits here instead
    assert dash.wait_finished(timeout=0) and "failed" in dash.header.value
    assert dash.summary_png is not None and dash.summary_text.startswith("nbaccel run run-1")


def test_a_dashboard_closed_before_its_widgets_were_built_closes_without_them() -> None:
    dash = Dashboard(DashboardModel(world_size=2), build=False)
    dash.close()
    assert dash.closed and dash.wait_finished(timeout=0)


# ----- no frame before the first interval -----------------------------------------------------
def test_the_first_frame_is_due_one_interval_after_the_start() -> None:
    now = [100.0]
    dash = Dashboard(DashboardModel(world_size=2), threaded=False, clock=lambda: now[0])
    dash.start()
    dash.post_memory(READINGS)
    dash(Metric(0, 1, {"loss": 0.5}, 0.0))
    dash.tick()
    assert dash._plots is None and bytes(dash.memory.value) == b""  # not drawn
    assert "0.5" in dash.metric_value.value  # the text is not held back
    now[0] += 0.5
    dash.tick()
    assert bytes(dash.memory.value).startswith(PNG) and bytes(dash.curve.value).startswith(PNG)


# ----- plots handed on ------------------------------------------------------------------------
def one_short_run(pool: PlotPool, metric: bool) -> Dashboard:
    dash = Dashboard(DashboardModel(world_size=2), threaded=False, plots=pool)
    dash.post_memory(READINGS)
    if metric:
        dash(Metric(0, 1, {"loss": 0.5}, 0.0))
    ended(dash)
    dash.tick()
    return dash


def test_a_relaunch_like_the_last_one_blits_its_memory_bars() -> None:
    pool = PlotPool()
    one_short_run(pool, metric=False)
    [(_, bars)] = pool._free
    assert bars.full_draws == 1
    second = one_short_run(pool, metric=False)
    assert pool._free == [(_, bars)] and bars.full_draws == 1  # blitted, not drawn again
    assert second.summary_png == second._frames["memory"]  # bars alone: the frame itself


def test_the_end_of_a_run_blits_its_memory_bars_with_their_peak_texts() -> None:
    pool = PlotPool()
    dash = Dashboard(DashboardModel(world_size=2), threaded=False, plots=pool)
    dash.post_memory(READINGS)
    dash.tick(force=True)  # a live frame: the axes drawn once
    ended(dash)
    dash.tick()
    [(_, bars)] = pool._free
    assert bars.full_draws == 1  # the end added texts over a blit, not a whole new draw
    assert bars.texts == ["peak 310.0 MiB"] * 2


def test_two_dashboards_drawing_at_once_each_have_their_own_plots() -> None:
    pool = PlotPool()
    first, second = (Dashboard(DashboardModel(world_size=2), threaded=False, plots=pool)
                     for _ in range(2))  # fmt: skip
    for dash in (first, second):
        dash.post_memory(READINGS)
        dash.tick(force=True)
    assert first._plots[2] is not second._plots[2]
    for dash in (first, second):
        ended(dash)
        dash.tick()
    assert len(pool._free) == 2


# ----- the summary picture --------------------------------------------------------------------
def test_the_summary_of_one_metric_is_its_final_frames_stacked() -> None:
    dash = one_short_run(PlotPool(), metric=True)
    assert dash.summary_png is not None
    # The curve frame (640 x 240) above the memory bars (640 x 140): no new drawing.
    assert size_of(dash.summary_png) == (640, 380)
    assert dash._frames["memory"] == bytes(dash.memory.value)


def test_the_summary_of_several_metrics_draws_every_one() -> None:
    dash = Dashboard(DashboardModel(world_size=2), threaded=False)
    dash(Metric(0, 1, {"loss": 0.5, "accuracy": 0.7}, 0.0))
    ended(dash)
    dash.tick()
    assert dash.summary_png is not None
    assert size_of(dash.summary_png)[0] == 600  # two panels of 300 px: render_summary's


def test_the_summary_picture_draws_no_text_layout() -> None:
    calls: list[Any] = []
    original = plots.Figure.tight_layout
    plots.Figure.tight_layout = lambda self, *a, **k: calls.append(a)  # type: ignore[method-assign]
    try:
        plots.render_summary({"loss": ([0, 1], [1.0, 0.5])}, READINGS, "run")
    finally:
        plots.Figure.tight_layout = original  # type: ignore[method-assign]
    assert calls == []  # fixed margins: tight_layout measured every text (~20 ms)


# ----- fewer widget models ----------------------------------------------------------------------
def test_parts_with_default_layouts_share_one_layout_and_one_html_style() -> None:
    before = set(widget_module._instances)
    parts = DashboardWidgets([("rank 0", 0), ("rank 1", 1)], 0, blocking=True, can_stop=False)
    made = set(widget_module._instances) - before
    assert len(made) <= 33, len(made)  # 52 when each part had its own
    assert parts.header.layout is parts.log.layout is parts.widget.layout
    assert parts.header.style is parts.steps.style
    assert parts.curve.layout is not parts.memory.layout  # shown and hidden on their own
    parts.close_widgets()
    assert not (made & set(widget_module._instances))  # shared ones closed once, all closed
