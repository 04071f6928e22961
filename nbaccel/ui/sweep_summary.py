"""What a sweep's board shows, as plain values: the trials' table (HTML for the board and
the summary a saved notebook keeps, text beside it), the line naming the best trial, and the
curves of every trial's metric overlaid in one PNG (matplotlib's Agg, off-screen). No
widgets: ``sweep_board.py`` puts these into its widgets and, at the end, into the cell."""

from __future__ import annotations

import html
import io
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nbaccel.sweeps.trials import Sweep, Trial

MAX_DRAWN_POINTS = 2000  # per trial's line: more points than pixels only cost time
MAX_LEGEND = 10  # trials named in the plot's legend (the best one always)
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


def shown_metric(sweep: Sweep) -> str | None:
    """The metric the board shows: the sweep's, else "loss" once logged, else the first
    logged (by name), else None."""
    if sweep.metric is not None:
        return sweep.metric
    names = sorted({name for trial in list(sweep.trials) for name in dict(trial.metrics)})
    if not names:
        return None
    return "loss" if "loss" in names else names[0]


def value_text(value: Any) -> str:
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
                text = value_text(row.get(name))
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
                line.append(value_text(row.get(name)))
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
        line += f"; best trial {best.number}: {metric} {value_text(value)} with {best.config}"
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
