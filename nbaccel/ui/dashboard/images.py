"""The dashboard's images: the curve and memory frames while a run goes, and the picture
its cell keeps. The image half of ``board.Dashboard`` (its state is set up there); runs on
its UI thread only. matplotlib is imported on the first frame, never on the launch path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbaccel.ui.dashboard.compare import EarlierRuns
from nbaccel.ui.dashboard.model import DashboardModel
from nbaccel.ui.dashboard.plot_pool import PlotPool
from nbaccel.ui.dashboard.text import memory_html


class DashboardImages:
    """``_write_images`` and ``_summary_picture`` of ``board.Dashboard``."""

    model: DashboardModel
    metric_value: Any
    curve: Any
    curve_legend: Any
    memory: Any
    memory_text: Any
    earlier: EarlierRuns | None
    _metric: str
    _written: dict[str, Any]
    _dirty_images: bool
    _plots: Any
    _pool: PlotPool
    _frames: dict[str, bytes]
    _curve_xlim: tuple[float, float] | None
    built: bool
    _set: Callable[[str, Any, str, Any], bool]
    _pick_metric: Callable[[], None]

    def _write_images(self) -> None:
        """Draw the frames that changed, and show them once the widgets are built. A run
        that ended before its widgets draws only its curve, for the summary: its memory
        bars would say no more than the summary's text (peak and last of each device)."""
        self._dirty_images = False
        shown = self.built
        self._pick_metric()
        if not shown and not self.model.series(self._metric)[0]:
            return
        if self._plots is None:
            try:
                from nbaccel.ui.dashboard import (
                    plots,  # matplotlib: loaded here, off the launch path
                )
            except ImportError:
                if shown:
                    self._set("metric_value", self.metric_value, "value", "matplotlib is missing")
                return
            self._plots = (plots, *self._pool.take(plots))
        plots, curve, bars = self._plots
        model, done = self.model, self.model.state.done
        steps, values = model.series(self._metric)
        picked = self.earlier.picked if self.earlier is not None else ()
        key = (self._metric, model.metrics_version, done, picked)
        if steps and self._written.get("curve_key") != key:
            self._written["curve_key"] = key
            overlays = self.earlier.overlays(self._metric) if self.earlier is not None else []
            png = curve.render(
                self._metric, steps, values, model.expected_last_step, final=done,
                overlays=overlays,
            )  # fmt: skip
            self._frames["curve"], self._curve_xlim = png, curve.xlim
            if shown:
                self._set("curve", self.curve, "value", png)
                self._set("curve_shown", self.curve.layout, "display", None)
                earlier = self.earlier
                legend = earlier.legend_html(self._metric, model.run_id) if earlier else ""
                self._set("curve_legend", self.curve_legend, "value", legend)
        if not shown:
            return
        readings = model.memory
        if readings and self._written.get("memory_key") != (model.memory_version, done):
            self._written["memory_key"] = (model.memory_version, done)
            self._frames["memory"] = bars.render(readings, ended=done)
            self._set("memory", self.memory, "value", self._frames["memory"])
            self._set("memory_shown", self.memory.layout, "display", None)
            text = memory_html(readings, ended=done, estimate=model.estimate)
            self._set("memory_text", self.memory_text, "value", text)

    def _leave_pictures_to_summary(self) -> None:
        """Hide the widgets' curve and memory bars once the summary's picture, just below,
        shows them (a finished run drew them twice). The saved notebook keeps the summary;
        a metric or a run picked after the end shows the widgets' curve again, drawn anew
        (``_write_images`` sets ``curve_shown`` back)."""
        self._set("curve_shown", self.curve.layout, "display", "none")
        self._set("curve_legend", self.curve_legend, "value", "")  # it names the curve's lines
        self._set("memory_shown", self.memory.layout, "display", "none")

    def _summary_picture(self, plots: Any) -> bytes | None:
        """The picture the cell keeps: the final frames as shown (one metric at most: its
        curve, then the memory bars, ~3 ms), or every metric drawn anew (~40-100 ms); a run
        that ended before its widgets: its curves alone, or none."""
        model = self.model
        logged = [name for name in model.metric_names if model.series(name)[0]]
        if len(logged) > 1:
            series = {name: model.series(name) for name in logged}
            title = f"nbaccel run {model.run_id}: {model.state.value}"
            memory = model.memory if self.built else []  # as the frames: said in the text
            return bytes(plots.render_summary(series, memory, title))
        frames = [self._frames[part] for part in ("curve", "memory") if part in self._frames]
        return bytes(plots.stack_frames(frames)) if frames else None
