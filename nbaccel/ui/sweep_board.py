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
widgets close (ipywidgets keeps every widget until closed). Displays from the UI thread
run in the calling cell's ``contextvars`` context, as ``interactive/call_display.py``'s.

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
import contextvars
import html
import io
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets  # untyped: widgets are held as Any

from nbaccel.ui.dashboard.text import clock_text
from nbaccel.ui.kernel import in_kernel

if TYPE_CHECKING:
    from nbaccel.sweeps.trials import Sweep, Trial

WRITE_INTERVAL = 0.5  # at most two writes a second: the table, and the curves if changed
IDLE_REFRESH = 1.0  # the header's clock and the running trials' seconds tick
END_WAIT = 10.0  # the scheduler's last call waits this long for the final summary
MAX_DRAWN_POINTS = 2000  # per trial's line: more points than pixels only cost time
MAX_LEGEND = 10  # trials named in the plot's legend (the best one always)
SWEEP_BLOCKING_NOTE = (
    "Blocking sweep: to stop it, interrupt the kernel (■ in the toolbar, or I, I): every "
    "running trial stops. Use nbaccel.sweep(..., wait=False) for working Stop buttons."
)
_STATE_COLOURS = {
    "pending": "#777",
    "running": "#1565c0",
    "stopping": "#6a1b9a",
    "succeeded": "#2e7d32",
    "failed": "#c62828",
    "stopped": "#6a1b9a",
    "pruned": "#e65100",
    "timed out": "#e65100",
    "cancelled": "#777",
}
_TABLE_STYLE = "border-collapse:collapse;font-family:monospace;font-size:85%"
_CELL_STYLE = "padding:1px 8px;text-align:left;border-bottom:1px solid #ddd"
_BEST_STYLE = "background:#fff3c4;font-weight:bold"

# A trial's line: its number, steps, values and state.
Curve = tuple[int, Sequence[float], Sequence[float], str]
Display = Callable[..., Any]  # IPython.display.display (raw bundles, display ids)


def shown_metric(sweep: Sweep) -> str | None:
    """The metric the board shows: the sweep's, else "loss" once logged, else the first
    logged (by name), else None."""
    if sweep.metric is not None:
        return sweep.metric
    names = sorted({name for trial in list(sweep.trials) for name in dict(trial.metrics)})
    if not names:
        return None
    return "loss" if "loss" in names else names[0]


def _value_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def _columns(rows: Sequence[dict[str, Any]], metric: str | None) -> list[str]:
    """The shown columns: trial, its config's keys, state, step, the metric's last and best
    values, seconds, device (and error, when a trial has one)."""
    if not rows:
        return []
    keys = list(rows[0])
    config = keys[1 : keys.index("state")]
    names = [metric, f"best {metric}"] if metric is not None else []
    errors = ["error"] if any(row.get("error") for row in rows) else []
    return ["trial", *config, "state", "step", *names, "seconds", "device", *errors]


def table_html(
    rows: Sequence[dict[str, Any]],
    metric: str | None,
    best: int | None,
    states: dict[int, str] | None = None,
) -> str:
    """The trials as an HTML table, the best one (trial number ``best``) starred and
    highlighted. ``states``: a shown state by trial number, over the rows' (a running trial
    asked to stop is "stopping"). Every value is HTML-escaped.

    >>> rows = [{"trial": 0, "lr": "<b>", "state": "succeeded", "step": 1, "seconds": 1.5,
    ...          "device": "CPU slot 0", "error": ""}]
    >>> text = table_html(rows, None, 0)
    >>> "&lt;b&gt;" in text, "★ 0" in text, "nbaccel-sweep-best" in text
    (True, True, True)
    """
    columns = _columns(rows, metric)
    head = "".join(f"<th style='{_CELL_STYLE}'>{html.escape(name)}</th>" for name in columns)
    body = []
    for row in rows:
        number = int(row["trial"])
        state = (states or {}).get(number, str(row["state"]))
        cells = []
        for name in columns:
            if name == "trial":
                text = f"★ {number}" if number == best else str(number)
            elif name == "state":
                colour = _STATE_COLOURS.get(state, "#333")
                cells.append(f"<td style='{_CELL_STYLE};color:{colour}'>{html.escape(state)}</td>")
                continue
            elif name == "seconds":
                seconds = row.get("seconds")
                text = f"{seconds:.1f}" if isinstance(seconds, (int, float)) else ""
            else:
                text = _value_text(row.get(name))
            cells.append(f"<td style='{_CELL_STYLE}'>{html.escape(text)}</td>")
        tags = "nbaccel-sweep-row nbaccel-sweep-best" if number == best else "nbaccel-sweep-row"
        style = f" style='{_BEST_STYLE}'" if number == best else ""
        body.append(
            f"<tr class='{tags}' data-trial='{number}' data-state='{html.escape(state)}'"
            f"{style}>{''.join(cells)}</tr>"
        )
    return (
        f"<table class='nbaccel-sweep-rows' style='{_TABLE_STYLE}'><thead><tr>{head}</tr>"
        f"</thead><tbody>{''.join(body)}</tbody></table>"
    )


def table_text(rows: Sequence[dict[str, Any]], metric: str | None, best: int | None) -> str:
    """The table as aligned text: what a viewer without HTML shows of the summary.

    >>> print(table_text([{"trial": 0, "lr": 0.1, "state": "succeeded", "step": 3,
    ...                    "seconds": 2.0, "device": "CPU slot 0", "error": ""}], None, 0))
    trial  lr   state      step  seconds  device
    ★ 0    0.1  succeeded  3     2.0      CPU slot 0
    """
    columns = _columns(rows, metric)
    lines = [columns]
    for row in rows:
        number = int(row["trial"])
        line = []
        for name in columns:
            if name == "trial":
                line.append(f"★ {number}" if number == best else str(number))
            elif name == "seconds" and isinstance(row.get("seconds"), (int, float)):
                line.append(f"{row['seconds']:.1f}")
            else:
                line.append(_value_text(row.get(name)))
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def summary_line(sweep: Sweep, best: Trial | None, metric: str | None) -> str:
    """One line: how many trials ended how, and the best trial.

    >>> from nbaccel.sweeps.trials import Sweep, Trial
    >>> done = Trial(0, {"lr": 0.1}, state="succeeded", metrics={"loss": [(1, 0.25)]})
    >>> sweep = Sweep([done, Trial(1, {"lr": 1.0}, state="stopped")], "loss", "min")
    >>> summary_line(sweep, done, "loss")
    "nbaccel sweep: 2 trials: 1 succeeded, 1 stopped; best trial 0: loss 0.25 with {'lr': 0.1}"
    """
    states: dict[str, int] = {}
    for trial in list(sweep.trials):
        states[trial.state] = states.get(trial.state, 0) + 1
    said = ", ".join(f"{count} {state}" for state, count in states.items())
    line = f"nbaccel sweep: {len(sweep.trials)} trials: {said}"
    if best is not None and metric is not None:
        value = best.last(metric)
        line += f"; best trial {best.number}: {metric} {_value_text(value)} with {best.config}"
    return line


def _thin(steps: Sequence[float], values: Sequence[float]) -> tuple[list[float], list[float]]:
    stride = max(1, math.ceil(len(steps) / MAX_DRAWN_POINTS))
    xs, ys = list(steps[::stride]), list(values[::stride])
    if stride > 1 and xs[-1] != steps[-1]:  # always the latest point
        xs.append(steps[-1])
        ys.append(values[-1])
    return xs, ys


def render_curves(
    curves: Sequence[Curve],
    metric: str,
    best: int | None,
    mode: str = "min",
    *,
    width_px: int = 720,
    height_px: int = 280,
    dpi: int = 80,
) -> bytes:
    """A PNG of every trial's ``metric`` against step in one plot, the best trial's line
    thick and named "best" in the legend (the others thinner, fainter once a best exists).

    >>> png = render_curves([(0, [0, 1], [1.0, 0.5], "succeeded"), (1, [0], [0.9], "running")],
    ...                     "loss", 0)
    >>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
    True
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # on the UI thread only
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(width_px / dpi, height_px / dpi), dpi=dpi)
    canvas: Any = FigureCanvasAgg(figure)  # Agg's printing methods carry no annotations
    axes = figure.add_subplot()
    figure.subplots_adjust(left=0.08, right=0.8, top=0.9, bottom=0.14)
    axes.tick_params(labelsize=8)
    axes.grid(True, alpha=0.3)
    axes.set_xlabel("step", fontsize=8)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    better = "lower" if mode == "min" else "higher"
    axes.set_title(f"{metric} of every trial ({better} is better)", fontsize=9, loc="left")
    named = 0
    for number, steps, values, state in curves:
        if not steps:
            continue
        xs, ys = _thin(steps, values)
        is_best = number == best
        label = None
        if is_best:
            label = f"trial {number} ★ best"
        elif named < MAX_LEGEND - (best is not None):
            label = f"trial {number}" + ("" if state in ("running", "succeeded") else f" ({state})")
            named += 1
        axes.plot(
            xs, ys, color=f"C{number % 10}", label=label,
            lw=2.8 if is_best else 1.2, alpha=1.0 if is_best or best is None else 0.55,
            zorder=3 if is_best else 2, marker="o" if len(xs) == 1 else None, markersize=3,
        )  # fmt: skip
    if axes.lines:
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    else:
        axes.text(0.5, 0.5, f"no {metric} logged yet", ha="center", transform=axes.transAxes)
    out = io.BytesIO()
    canvas.print_png(out)
    return out.getvalue()


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
        self._context = contextvars.copy_context()  # the calling cell's: displays land there
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
            parts.append(f"best: trial {best.number}, {metric} {_value_text(best.last(metric))}")
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
            self._context.run(self._publish, line, metric)
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
            _close_tree(self.widget)


def _config_text(config: dict[str, Any], limit: int = 40) -> str:
    text = ", ".join(f"{key}={value!r}" for key, value in config.items())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _close_tree(widget: Any) -> None:
    """Close a widget, its children, and the layout and style models each one holds."""
    for child in getattr(widget, "children", ()):
        _close_tree(child)
    for name in ("layout", "style"):
        part = getattr(widget, name, None)
        if isinstance(part, widgets.Widget):
            part.close()
    widget.close()


def _tagged(widget: Any, dom_class: str) -> Any:
    widget.add_class(dom_class)
    return widget
