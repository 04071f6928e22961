"""A sweep's dashboard, shown as one thing in the calling cell (``nbaccel.sweep`` in a
Jupyter kernel): a row per trial, the sweep's metric of every trial overlaid in one plot,
and the buttons that stop the sweep or one trial.

``SweepBoard`` is the sweep's watcher (``sweeps.scheduler.Watcher``): the scheduler calls
it after every change, on its own thread (the kernel's main thread when the sweep blocks,
a background thread with ``wait=False``). A call only counts the change and wakes the
board's UI thread, which alone writes the widgets: at most every ``interval`` (0.5 s; the
trials' seconds tick once a second meanwhile), the curves only when a trial's values
changed, drawn off-screen with matplotlib's Agg (``render_curves``, imported on the UI
thread, never on the sweep's path). The scheduler never waits on matplotlib, except at the
very end: its last call (``sweep.done``) waits, at most ``END_WAIT`` s, for the final frame
and the static summary, so a blocking sweep returns only once they are out.

The summary replaces the live widgets in their place: the table as HTML (with a line
naming the best trial) and the curves as a PNG, written with ``update_display_data`` into
the outputs reserved when the board was shown, so a saved notebook keeps them; then the
widgets close (ipywidgets keeps every widget until closed). Those updates go out from the
UI thread under whatever cell the kernel runs by then, as the launch dashboard's do: a
frontend (JupyterLab, or nbclient saving the notebook) applies them to the outputs with
those ids wherever they are, where one sent under the calling cell's finished request is
dropped (a ``wait=False`` or detached sweep ends after its cell).

While a blocking sweep runs, the kernel handles no widget events: its buttons are disabled
and say that interrupting the kernel (■) stops the sweep; with ``wait=False`` "Stop all"
calls ``sweep.stop()`` and "Stop trial" ``sweep.stop_trial(n)`` for the trial picked among
the running ones. Each part carries a CSS class (``nbaccel-sweep-board``,
``nbaccel-sweep-header``, ``nbaccel-sweep-trial``, ``nbaccel-sweep-stop-trial``,
``nbaccel-sweep-stop-all``, ``nbaccel-sweep-stop-note``, ``nbaccel-sweep-table`` whose rows
are ``tr.nbaccel-sweep-row`` with ``data-trial`` and ``data-state``, the best one also
``nbaccel-sweep-best``, and ``nbaccel-sweep-curves``; the summary is
``nbaccel-sweep-summary``): a browser test selects by them. Never imports torch.
"""

from __future__ import annotations

import base64
import html
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets  # untyped: widgets are held as Any

from nbaccel.ui.dashboard.text import clock_text
from nbaccel.ui.dashboard.widgets import close_tree
from nbaccel.ui.kernel import in_kernel
from nbaccel.ui.sweep_summary import (
    Curve,
    render_curves,
    shown_metric,
    summary_line,
    table_html,
    table_text,
    value_text,
)

if TYPE_CHECKING:
    from nbaccel.sweeps.trials import Sweep, Trial

WRITE_INTERVAL = 0.5  # at most two writes a second: the table, and the curves if changed
IDLE_REFRESH = 1.0  # the header's clock and the running trials' seconds tick
END_WAIT = 10.0  # the scheduler's last call waits this long for the final summary
SWEEP_BLOCKING_NOTE = (
    "Blocking sweep: to stop it, interrupt the kernel (■ in the toolbar, or I, I): every "
    "running trial stops. Use nbaccel.sweep(..., wait=False) for working Stop buttons."
)
Display = Callable[..., Any]  # IPython.display.display (raw bundles, display ids)


class SweepBoard:
    """The sweep's widgets in the calling cell, and the watcher that keeps them current.

    ``capacity``: trials at once; ``blocking``: the sweep blocks the kernel (its buttons
    cannot receive clicks); ``total``: trials to run (an Optuna sweep's list grows).
    ``display``: IPython's ``display`` (default: in a kernel; elsewhere nothing is shown);
    ``threaded=False`` runs no UI thread: call ``tick()`` (tests).

    >>> from nbaccel.sweeps.trials import Sweep, Trial
    >>> sweep = Sweep([Trial(0, {"lr": 0.1})], "loss", "min")
    >>> board = SweepBoard(sweep, 1, threaded=False)
    >>> board(sweep); board.tick(force=True)
    >>> board.stop_all_button.disabled, "data-state='pending'" in board.table.value
    (True, True)
    """

    def __init__(
        self,
        sweep: Sweep,
        capacity: int,
        *,
        blocking: bool = True,
        total: int | None = None,
        display: Display | None = None,
        interval: float = WRITE_INTERVAL,
        threaded: bool = True,
        end_wait: float = END_WAIT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sweep, self.capacity, self.blocking = sweep, capacity, blocking
        self.total = total
        self._interval, self._threaded, self._end_wait = interval, threaded, end_wait
        self._clock = clock
        self._began = clock()
        self._changes = 0  # watcher calls and clicks so far (the UI thread writes them)
        self._written_changes = -1
        self._next_write = self._next_tick = 0.0
        self._written: dict[str, Any] = {}  # what each part shows, to skip equal writes
        self._writing = False  # our own writes must not look like the user's choice
        self._stopping_all = False
        self._picked: int | None = None  # the trial the user picked to stop
        self._wake = threading.Event()
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        self._outputs: tuple[Any, Any] | None = None
        self.frames = 0  # curve images drawn (tests count them)
        self.curves_png: bytes | None = None
        self.summary_html = ""
        self.summary_text = ""
        self.summary_png: bytes | None = None
        self.closed = False
        self._build()
        self._write(self._clock(), images=False)  # the table at once, the curves to come
        if display is None and in_kernel():
            from IPython import display as ipython_display

            display = ipython_display.display
        if display is not None:
            self._show(display)
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="nbaccel-sweep-ui", daemon=True)
            self._thread.start()

    # ----- the widgets --------------------------------------------------------------
    def _build(self) -> None:
        layout = widgets.Layout
        note = SWEEP_BLOCKING_NOTE
        self.header = _tagged(widgets.HTML(), "nbaccel-sweep-header")
        self.trial_picker = _tagged(
            widgets.Dropdown(
                options=[], description="trial", style={"description_width": "initial"},
                layout=layout(width="280px"), disabled=self.blocking,
            ),
            "nbaccel-sweep-trial",
        )  # fmt: skip
        buttons = {"layout": layout(width="auto", min_width="100px")}
        self.stop_trial_button = _tagged(
            widgets.Button(
                description="Stop trial", icon="stop", button_style="warning", disabled=True,
                tooltip=note if self.blocking else "Stop the trial picked (it ends 'stopped')",
                **buttons,
            ),
            "nbaccel-sweep-stop-trial",
        )  # fmt: skip
        self.stop_all_button = _tagged(
            widgets.Button(
                description="Stop all", icon="stop", button_style="danger", disabled=True,
                tooltip=note if self.blocking else "Stop every running trial, start no more",
                **buttons,
            ),
            "nbaccel-sweep-stop-all",
        )  # fmt: skip
        said = f"<small>{html.escape(note)}</small>" if self.blocking else ""
        self.stop_note = _tagged(widgets.HTML(said), "nbaccel-sweep-stop-note")
        self.table = _tagged(widgets.HTML(), "nbaccel-sweep-table")
        # Hidden until its first frame: an empty image shows as a broken one.
        self.curves = _tagged(
            widgets.Image(format="png", layout=layout(display="none")), "nbaccel-sweep-curves"
        )
        controls = widgets.HBox(
            [self.trial_picker, self.stop_trial_button, self.stop_all_button, self.stop_note]
        )
        self.widget = _tagged(
            widgets.VBox([self.header, controls, self.table, self.curves]),
            "nbaccel-sweep-board",
        )
        self.trial_picker.observe(self._on_pick, names="value")
        self.stop_trial_button.on_click(self._on_stop_trial)
        self.stop_all_button.on_click(self._on_stop_all)

    def _show(self, display: Display) -> None:
        """The widgets in the calling cell, and a second output for the summary's picture:
        at the end both are updated by their display ids, wherever the kernel is by then."""
        bundle = dict(self.widget._repr_mimebundle_())
        bundle["text/plain"] = "nbaccel sweep dashboard (its final summary follows)"
        self._outputs = (
            display(bundle, raw=True, display_id=True),
            display({"text/plain": ""}, raw=True, display_id=True),
        )

    # ----- input (any thread) -------------------------------------------------------
    def __call__(self, sweep: Sweep) -> None:
        """The scheduler's call after each change: count it and wake the UI thread; the
        last one (``sweep.done``) waits for the final summary (at most ``end_wait`` s)."""
        if self._finished.is_set():
            return
        self._poke()
        thread = self._thread
        if sweep.done and thread is not None and thread is not threading.current_thread():
            self._finished.wait(self._end_wait)

    def _poke(self) -> None:
        self._changes += 1
        self._wake.set()

    def _on_pick(self, change: dict[str, Any]) -> None:
        if not self._writing:
            self._picked = change["new"]

    def _on_stop_trial(self, _button: Any) -> None:
        number = self.trial_picker.value
        if self.blocking or number is None:
            return
        self.sweep.stop_trial(int(number))  # asks, returns at once: its end comes as events
        self._poke()

    def _on_stop_all(self, _button: Any) -> None:
        if self.blocking or self._stopping_all:
            return
        self._stopping_all = True
        self.sweep.stop()
        self._poke()

    def wait_finished(self, timeout: float = END_WAIT) -> bool:
        """Wait until the final summary is out; False on timeout."""
        return self._finished.wait(timeout)

    # ----- the UI thread ------------------------------------------------------------
    def _loop(self) -> None:
        reported = False
        while not self._finished.is_set():
            self._wake.wait(self._wait_time())
            self._wake.clear()
            try:
                self.tick()
            except Exception as error:  # noqa: BLE001 - a broken display must not stop a sweep
                if not reported:
                    print(f"nbaccel: sweep dashboard update failed: {error!r}", file=sys.__stderr__)
                    reported = True
                if self.sweep.done:
                    self._finished.set()  # never keep the scheduler waiting

    def _wait_time(self) -> float:
        now = self._clock()
        if self.sweep.done:
            return 0.0
        if self._changes != self._written_changes:
            return max(0.0, min(self._next_write, self._next_tick) - now)
        return max(0.0, self._next_tick - now)

    def tick(self, now: float | None = None, *, force: bool = False) -> None:
        """Write what is due at ``now`` (everything if ``force``); once the sweep is done,
        the final frame and the summary, then close the widgets."""
        if self._finished.is_set():
            return
        now = self._clock() if now is None else now
        if self.sweep.done:
            self._finish()
            return
        changed = self._changes != self._written_changes
        if force or (changed and now >= self._next_write) or now >= self._next_tick:
            self._write(now)

    def _write(self, now: float, *, images: bool = True) -> None:
        changes = self._changes
        sweep = self.sweep
        rows, metric = self._rows(), shown_metric(sweep)
        best = sweep.best_trial()
        trials = {trial.number: trial for trial in list(sweep.trials)}
        running = [t for t in trials.values() if t.state == "running" and not t.ending]
        states = {n: "stopping" for n, t in trials.items() if t.state == "running" and t.ending}
        self._set("header", self.header, "value", self._header_html(trials, best, metric, now))
        best_number = best.number if best is not None else None
        self.table_html = table_html(rows, metric, best_number, states)
        self._set("table", self.table, "value", self.table_html)
        self._write_controls(running, any(t.state == "pending" for t in trials.values()))
        if images and metric is not None:
            self._write_curves(metric, best_number)
        self._written_changes = changes
        self._next_write = now + self._interval
        self._next_tick = now + IDLE_REFRESH

    def _rows(self) -> list[dict[str, Any]]:
        for _ in range(4):
            try:
                return self.sweep.rows()
            except RuntimeError:  # a trial's first value of a new metric, logged meanwhile
                continue
        return self.sweep.rows()

    def _header_html(
        self, trials: dict[int, Trial], best: Trial | None, metric: str | None, now: float
    ) -> str:
        states: dict[str, int] = {}
        for trial in trials.values():
            states[trial.state] = states.get(trial.state, 0) + 1
        total = max(self.total or 0, len(trials))
        parts = [f"{total} trials", f"{self.capacity} at a time", clock_text(now - self._began)]
        parts += [f"{count} {state}" for state, count in states.items()]
        if best is not None and metric is not None:
            parts.append(f"best: trial {best.number}, {metric} {value_text(best.last(metric))}")
        if self._stopping_all and not self.sweep.done:
            parts.append("stopping every trial")
        said = html.escape(" · ".join(parts))
        return f"<div style='font-family:monospace'><b>nbaccel sweep</b> · {said}</div>"

    def _write_controls(self, running: list[Trial], pending: bool) -> None:
        options = tuple((f"trial {t.number}: {_config_text(t.config)}", t.number) for t in running)
        if self._set("picker_options", self.trial_picker, "options", options):
            numbers = [number for _, number in options]
            keep = self._picked if self._picked in numbers else (numbers[0] if numbers else None)
            self._written.pop("picker_value", None)  # new options reset the value: set it again
            self._set("picker_value", self.trial_picker, "value", keep)
        inert = self.blocking or self.sweep.done
        self._set("picker_disabled", self.trial_picker, "disabled", inert or not running)
        self._set("stop_trial", self.stop_trial_button, "disabled", inert or not running)
        idle = not running and not pending
        self._set("stop_all", self.stop_all_button, "disabled", inert or self._stopping_all or idle)
        if self._stopping_all:
            self._set("stop_all_label", self.stop_all_button, "description", "Stopping…")

    def _curves(self, metric: str) -> list[Curve]:
        curves: list[Curve] = []
        for trial in list(self.sweep.trials):
            points = list(trial.metrics.get(metric, ()))  # a copy: the scheduler appends
            if points:
                steps, values = zip(*points, strict=True)
                curves.append((trial.number, steps, values, trial.state))
        return curves

    def _write_curves(self, metric: str, best: int | None) -> None:
        curves = self._curves(metric)
        key = (metric, best, tuple((n, len(s), state) for n, s, _, state in curves))
        if not curves or self._written.get("curves_key") == key:
            return
        self._written["curves_key"] = key
        try:
            png = render_curves(curves, metric, best, self.sweep.mode)
        except ImportError:  # no matplotlib in this kernel: the table alone
            self._set(
                "curves_missing", self.stop_note, "value", "<small>matplotlib is missing</small>"
            )
            return
        self.curves_png = png
        self.frames += 1
        self._set("curves", self.curves, "value", png)
        self._set("curves_shown", self.curves.layout, "display", None)

    def _set(self, part: str, widget: Any, name: str, value: Any) -> bool:
        """Assign a widget trait if it changed (each assignment is one message)."""
        if part in self._written and self._written[part] == value:
            return False
        self._written[part] = value
        self._writing = True
        try:
            setattr(widget, name, value)
        finally:
            self._writing = False
        return True

    # ----- the end ------------------------------------------------------------------
    def _finish(self) -> None:
        """The final frame, the summary in the widgets' place, then the widgets close."""
        try:
            sweep = self.sweep
            rows, metric, best = self._rows(), shown_metric(sweep), sweep.best_trial()
            best_number = best.number if best is not None else None
            self.table_html = table_html(rows, metric, best_number)
            if metric is not None:
                self._write_curves(metric, best_number)
            line = summary_line(sweep, best, metric)
            if sweep.error is not None and not isinstance(sweep.error, KeyboardInterrupt):
                line += f" (ended by {type(sweep.error).__name__}: {sweep.error})"
            self.summary_text = line + "\n" + table_text(rows, metric, best_number)
            self.summary_html = (
                "<div class='nbaccel-sweep-summary'>"
                f"<div style='font-family:monospace'><b>{html.escape(line)}</b></div>"
                f"{self.table_html}</div>"
            )
            self.summary_png = self.curves_png
            self._publish(line, metric)
        finally:
            self._close_widgets()
            self._finished.set()

    def _publish(self, line: str, metric: str | None) -> None:
        if self._outputs is None:
            return
        board, image = self._outputs
        board.update({"text/html": self.summary_html, "text/plain": self.summary_text}, raw=True)
        if self.summary_png is not None:
            encoded = base64.b64encode(self.summary_png).decode("ascii")
            said = f"nbaccel sweep: {metric} of every trial"
            image.update({"image/png": encoded, "text/plain": said}, raw=True)

    def _close_widgets(self) -> None:
        if not self.closed:
            self.closed = True
            close_tree(self.widget)


def _config_text(config: dict[str, Any], limit: int = 40) -> str:
    text = ", ".join(f"{key}={value!r}" for key, value in config.items())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _tagged(widget: Any, dom_class: str) -> Any:
    widget.add_class(dom_class)
    return widget
