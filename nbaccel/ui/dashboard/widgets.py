"""The dashboard's widgets and their layout; ``Dashboard`` fills them from a run's events.

Every part carries a CSS class (``nbaccel-dashboard``, ``nbaccel-header``, ``nbaccel-log``,
``nbaccel-errors``, ``nbaccel-rank``, ``nbaccel-stop``, ``nbaccel-save-stop``,
``nbaccel-stop-note``, ``nbaccel-stacks-button``, ``nbaccel-stacks``,
``nbaccel-metric``, ``nbaccel-metric-value``, ``nbaccel-compare``, ``nbaccel-curve``,
``nbaccel-curve-legend``, ``nbaccel-memory-text``, ``nbaccel-memory``): a notebook's stored
widget state lists it in ``_dom_classes``, and a browser test selects by it.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets  # untyped: widgets are held as Any

from nbaccel.ui.dashboard.compare import EarlierRuns, earlier_runs
from nbaccel.ui.dashboard.model import TOGETHER, DashboardModel
from nbaccel.ui.dashboard.stacks_panel import BLOCKING_STACKS_NOTE, StacksPanel
from nbaccel.ui.dashboard.step_panel import StepPanel
from nbaccel.ui.dashboard.text import (
    BLOCKING_NOTE,
    SAVE_STOP_LABEL,
    SAVE_STOP_TOOLTIP,
    errors_html,
    header_html,
    log_html,
    whole_log,
)


class DashboardWidgets:
    """The widget tree (``.widget``) and its named parts, empty until a dashboard fills them;
    ``_write_text`` writes the text parts from the dashboard's model (``board.Dashboard``, on
    its UI thread, whose state this uses).

    ``choices``: the log selector's (label, rank) pairs, ``rank`` the one shown first.

    >>> parts = DashboardWidgets([("rank 0", 0), ("rank 1", 1)], 1, blocking=True, can_stop=False)
    >>> parts.rank_selector.value, parts.stop_button.disabled, sorted(parts.model_ids)[:3]
    (1, True, ['compare', 'curve', 'curve_legend'])
    """

    model: DashboardModel
    step_panel: StepPanel
    stacks_panel: StacksPanel
    earlier: EarlierRuns | None
    visible_log: list[str]
    _set: Callable[[str, Any, str, Any], bool]
    _written: dict[str, Any]
    _wall_clock: Callable[[], float]
    _rank: int
    _metric: str
    _metric_chosen: bool
    _stopping: bool
    _saving: bool  # the stop asked is Save & stop's
    _blocking: bool
    _stop: Callable[[], None] | None
    _save_stop: Callable[[], None] | None
    _stacks_of: Callable[[], dict[int, str]] | None
    _dirty_text: bool

    def __init__(
        self,
        choices: list[tuple[str, int]],
        rank: int,
        *,
        blocking: bool,
        can_stop: bool,
        can_save: bool | None = None,
    ) -> None:
        can_save = can_stop if can_save is None else can_save
        layout, button_style = widgets.Layout, widgets.ButtonStyle
        # Every widget made without a layout (and every HTML without a style) gets a model
        # of its own, one message each: the parts that keep the defaults share one, which
        # halves what a dashboard costs to build (52 models → 33; ~4 ms a launch in a kernel).
        plain, plain_html = layout(), widgets.widget_string.HTMLStyle()

        def html(value: str = "") -> Any:
            return widgets.HTML(value, layout=plain, style=plain_html)

        self.header = _tagged(html(), "nbaccel-header")
        self.rank_selector = _tagged(
            widgets.Dropdown(
                options=choices,
                value=rank,
                description="log",
                # The label's default width squeezed the choice to "rank (" in JupyterLab.
                style={"description_width": "initial"},
                layout=layout(width="160px"),
            ),
            "nbaccel-rank",
        )
        # The three buttons share one layout and one style (two models, not six).
        buttons = {"layout": layout(width="auto", min_width="100px"), "style": button_style()}
        self.stop_button = _tagged(
            widgets.Button(
                description="Stop", icon="stop", button_style="danger",
                disabled=blocking or not can_stop, **buttons,
                tooltip=BLOCKING_NOTE if blocking else "Stop every worker (graceful)",
            ),
            "nbaccel-stop",
        )  # fmt: skip
        # run.stop(save=True), where a click reaches the kernel (clicks.py): as Stop.
        self.save_stop_button = _tagged(
            widgets.Button(
                description=SAVE_STOP_LABEL, icon="save", button_style="warning",
                disabled=blocking or not can_save, **buttons,
                tooltip=BLOCKING_NOTE if blocking else SAVE_STOP_TOOLTIP,
            ),
            "nbaccel-save-stop",
        )  # fmt: skip
        # Every rank's stack now (Run.stacks), where a click reaches the kernel: as Stop.
        self.stacks_button = _tagged(
            widgets.Button(
                description="Stacks", icon="list", disabled=blocking or not can_stop, **buttons,
                tooltip=BLOCKING_STACKS_NOTE if blocking else "Show where every rank is now",
            ),
            "nbaccel-stacks-button",
        )  # fmt: skip
        self.stacks = _tagged(html(), "nbaccel-stacks")  # stacks_panel.StacksPanel's
        note = f"<small>{BLOCKING_NOTE}</small>" if blocking else ""
        self.stop_note = _tagged(html(note), "nbaccel-stop-note")
        self.log = _tagged(html(), "nbaccel-log")
        self.errors = _tagged(html(), "nbaccel-errors")
        self.metric_selector = _tagged(
            widgets.Dropdown(options=[], description="metric", layout=layout(width="220px")),
            "nbaccel-metric",
        )
        self.metric_value = _tagged(html(), "nbaccel-metric-value")
        # Earlier runs of the same runs_dir to overlay; hidden until there are some.
        self.compare = _tagged(
            widgets.SelectMultiple(
                options=[],
                description="compare with",
                rows=3,
                style={"description_width": "initial"},
                layout=layout(width="360px", display="none"),
            ),
            "nbaccel-compare",
        )
        self.curve_legend = _tagged(html(), "nbaccel-curve-legend")
        # Images stay hidden until their first frame: an empty one shows as a broken image.
        self.curve = _tagged(_hidden_image(), "nbaccel-curve")
        self.memory_text = _tagged(html(), "nbaccel-memory-text")
        self.memory = _tagged(_hidden_image(), "nbaccel-memory")
        self.steps = _tagged(html(), "nbaccel-steps")  # step_panel.StepPanel's HTML
        self.widget = _tagged(
            widgets.VBox(
                [
                    self.header,
                    widgets.HBox(
                        [
                            self.rank_selector,
                            self.stop_button,
                            self.save_stop_button,
                            self.stacks_button,
                            self.stop_note,
                        ],
                        layout=plain,
                    ),
                    self.log,
                    self.errors,
                    self.stacks,
                    widgets.HBox([self.metric_selector, self.metric_value], layout=plain),
                    self.compare,
                    self.curve,
                    self.curve_legend,
                    self.memory_text,
                    self.memory,
                    self.steps,
                ],
                layout=plain,
            ),
            "nbaccel-dashboard",
        )

    def close_widgets(self) -> None:
        """Close every widget of the tree: the parts, their containers, and the layout and
        style models each one holds (ipywidgets keeps all of them alive until closed)."""
        close_tree(self.widget)

    @property
    def model_ids(self) -> dict[str, str]:
        """Widget model ids by part, to find them in a notebook's stored widget state."""
        parts = "widget header rank_selector stop_button save_stop_button stacks_button stacks"
        parts += " log errors"
        parts += " metric_selector"
        parts += " metric_value compare curve curve_legend memory_text memory"
        return {part: getattr(self, part).model_id for part in parts.split()}

    def _write_text(self) -> None:
        """Write the text parts from the model (the UI thread's, once the widgets are built)."""
        model = self.model
        head = model.header(self._wall_clock())
        header = header_html(head, stopping=self._stopping, saving=self._saving)
        self._set("header", self.header, "value", header)
        self.visible_log = model.tail(self._rank)
        dropped = model.tail_state(self._rank)[1]
        where = whole_log(model, None if self._rank == TOGETHER else self._rank)
        log = log_html(self.visible_log, dropped, self._rank, where)
        self._set("log", self.log, "value", log)
        labels = tuple(model.log_choices())  # hosts, once known
        if self._set("rank_options", self.rank_selector, "options", labels):
            self._written.pop("rank", None)  # new options reset the value: put it back
            self._set("rank", self.rank_selector, "value", self._rank)
        self._set("errors", self.errors, "value", errors_html(model.errors))
        self._set("steps", self.steps, "value", self.step_panel.html())
        self._set("stacks", self.stacks, "value", self.stacks_panel.html())
        names = model.metric_names
        self._pick_metric()
        if self._set("metric_options", self.metric_selector, "options", tuple(names)):
            self._written.pop("metric", None)  # new options reset the selection: set it again
        if names:
            self._set("metric", self.metric_selector, "value", self._metric)
        steps, values = model.series(self._metric)
        shown = f"{self._metric} = {values[-1]:.6g} at step {steps[-1]}" if steps else ""
        self._set("metric_value", self.metric_value, "value", f"<code>{html.escape(shown)}</code>")
        if self.earlier is None and model.run_dir:  # listed once, when the run started
            self.earlier = EarlierRuns(model.run_dir)
            listed = earlier_runs(model.run_dir)
            self._set("compare_options", self.compare, "options", tuple(listed))
            self._set("compare_rows", self.compare, "rows", min(max(len(listed), 1), 5))
            self._set("compare_shown", self.compare.layout, "display", None if listed else "none")
        self._write_buttons(model.state.done)
        self._dirty_text = False

    def _write_buttons(self, done: bool) -> None:
        """Stop, Save & stop and Stacks: armed while the run goes on and no stop was asked
        (in a launch() dashboard); the asked one says so until the run ends, then "Ended"."""
        inert = done or self._stopping or self._blocking or self._stop is None
        self._set("stop_disabled", self.stop_button, "disabled", inert)
        save_inert = inert or self._save_stop is None
        self._set("save_disabled", self.save_stop_button, "disabled", save_inert)
        stacks_inert = inert or self._stacks_of is None
        self._set("stacks_disabled", self.stacks_button, "disabled", stacks_inert)
        if self._stopping and not done:
            if self._saving:  # every rank saves at one step, then ends: Stop stays as it was
                self._set("save_label", self.save_stop_button, "description", "Saving…")
            else:
                self._set("stop_label", self.stop_button, "description", "Stopping…")
        if done:  # nothing left to stop: the buttons no longer look armed, nor say how
            for part, button in (("stop", self.stop_button), ("save", self.save_stop_button)):
                self._set(f"{part}_label", button, "description", "Ended")
                self._set(f"{part}_style", button, "button_style", "")
            self._set("stop_note", self.stop_note, "value", "")

    def _pick_metric(self) -> None:
        """The metric shown: the user's choice, else "loss" once logged, else the first."""
        names = self.model.metric_names
        if not self._metric_chosen and names:
            self._metric = "loss" if "loss" in names else names[0]


def close_tree(widget: Any) -> None:
    """Close a widget, its children, and the layout and style models each one holds."""
    for child in getattr(widget, "children", ()):
        close_tree(child)
    for name in ("layout", "style"):
        part = getattr(widget, name, None)
        if isinstance(part, widgets.Widget):
            part.close()
    widget.close()


def _hidden_image() -> Any:
    return widgets.Image(format="png", layout=widgets.Layout(display="none"))


def _tagged(widget: Any, dom_class: str) -> Any:
    """Give a widget a CSS class: notebook and browser tests find the parts by it."""
    widget.add_class(dom_class)
    return widget
