"""The dashboard's words: the header line, the summary, and the HTML its widgets show.

Pure functions of the model's data (stdlib only), so the widget view, the final summary and
tests share one rendering. All text from workers is HTML-escaped.
"""

from __future__ import annotations

import html

from nbaccel.memory_estimate import MemoryEstimate
from nbaccel.ui.dashboard_model import DashboardModel, ErrorReport, Header, MemoryReading

BLOCKING_NOTE = (
    "Blocking call: to stop the run, interrupt the kernel (■ in the toolbar, or I, I). "
    "Use nbaccel.launch() for a working Stop button."
)
_STATE_COLOURS = {"running": "#1565c0", "succeeded": "#2e7d32", "failed": "#c62828"}


def clock_text(seconds: float) -> str:
    """``h:mm:ss`` or ``m:ss``.

    >>> clock_text(3725.2), clock_text(9)
    ('1:02:05', '0:09')
    """
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def size_text(size: int | None) -> str:
    """Bytes in binary units, "n/a" when unknown.

    >>> size_text(3 * 2**30), size_text(None)
    ('3.0 GiB', 'n/a')
    """
    if size is None:
        return "n/a"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def header_text(head: Header) -> str:
    """The header as one line.

    >>> header_text(Header("r1", "running", 75.0, 10, 40, 2.0, None, 15.0, 2, "ddp", "bf16"))
    'running · 1:15 · step 10/40 · 2.00 steps/s · ETA 0:15 · 2 processes · ddp · bf16 autocast'
    """
    parts = [head.state, clock_text(head.elapsed)]
    if head.step is not None:
        parts.append(f"step {head.step}" + (f"/{head.total}" if head.total else ""))
    if head.step_rate is not None:
        parts.append(f"{head.step_rate:.2f} steps/s")
    if head.samples_rate is not None:
        parts.append(f"{head.samples_rate:.1f} samples/s")
    if head.eta is not None:
        parts.append(f"ETA {clock_text(head.eta)}")
    processes = "process" if head.world_size == 1 else "processes"
    # "auto" and "no" are the config's words; say what runs: DDP (auto with several
    # processes off TPUs), fp32.
    strategy = head.strategy
    if strategy == "auto":
        strategy = "ddp" if head.world_size > 1 else "one process"
    parts += [
        f"{head.world_size} {processes}",
        strategy,
        _PRECISION.get(head.precision, head.precision),
    ]
    return " · ".join(parts)


def summary_text(model: DashboardModel) -> str:
    """The run in a few lines: the static summary left in the cell at the end.

    >>> from nbaccel.events import Metric
    >>> model = DashboardModel()
    >>> model.handle(Metric(0, 3, {"loss": 0.25}, 0.0))
    >>> summary_text(model).splitlines()[1]
    'loss: last 0.25 at step 3, min 0.25 at step 3'
    """
    lines = [f"nbaccel run {model.run_id}: {header_text(model.header())}"]
    for name in model.metric_names:
        steps, values = model.series(name)
        low = min(range(len(values)), key=values.__getitem__)
        lines.append(
            f"{name}: last {values[-1]:.6g} at step {steps[-1]}, "
            f"min {values[low]:.6g} at step {steps[low]}"
        )
    for r in model.memory:
        lines.append(
            f"memory {r.device}: {size_text(r.current)} last, {size_text(r.peak)} peak, "
            f"{size_text(r.limit)} limit"
        )
    if model.estimate is not None:
        lines.append(estimate_line(model.estimate))
    lines += [f"error: {error.summary}" for error in model.errors]
    return "\n".join(lines)


def header_html(head: Header, *, stopping: bool) -> str:
    """The header widget's HTML: the state in colour, then the rest of the line."""
    colour = _STATE_COLOURS.get(head.state, "#e65100")
    state = "stopping" if stopping and head.state == "running" else head.state
    rest = html.escape(header_text(head).split(" · ", 1)[1])
    return (
        f"<div style='font-family:monospace'><b style='color:{colour}'>{state}</b> · {rest} "
        f"<small style='color:#777'>{html.escape(head.run_id)}</small></div>"
    )


def log_html(lines: list[str], dropped: int, rank: int) -> str:
    """A rank's log tail in a box that stays scrolled to its newest line.

    >>> "&lt;b&gt;" in log_html(["<b>"], 0, 0)
    True
    """
    body = [f"<span style='color:#888'>… {dropped} earlier lines: run.logs({rank})</span>"]
    body = body if dropped else []
    for line in lines:
        text = html.escape(line)
        if line.startswith("Traceback") or "Error" in line.split(":", 1)[0]:
            text = f"<span style='color:#c62828'>{text}</span>"
        body.append(text)
    # column-reverse anchors the scroll position at the bottom as the tail is replaced.
    return (
        "<div style='display:flex;flex-direction:column-reverse;height:16em;overflow:auto;"
        "border:1px solid #ddd;background:#fafafa'><pre style='margin:0;padding:4px;"
        "font-size:12px;line-height:1.3'>" + "\n".join(body) + "</pre></div>"
    )


def errors_html(errors: list[ErrorReport]) -> str:
    """The failure, highlighted, with the failing rank's traceback."""
    parts = []
    for error in errors:
        where = f"rank {error.rank} failed" if error.rank is not None else "the run failed"
        trace = f"<pre style='margin:4px 0'>{html.escape(error.traceback)}</pre>"
        parts.append(
            "<div style='border-left:4px solid #c62828;background:#ffebee;padding:4px 8px'>"
            f"<b>{where}</b>: {html.escape(error.summary)}"
            + (trace if error.traceback else "")
            + "</div>"
        )
    return "".join(parts)


_PRECISION = {"no": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast"}


def memory_html(
    readings: list[MemoryReading], ended: bool = False, estimate: MemoryEstimate | None = None
) -> str:
    """One line per device: current (the last reading once the run ended), peak and limit
    ("n/a" where unknown); then the estimate for the prepared model, when there is one."""
    when = "last" if ended else "now"
    rows = [
        f"{html.escape(r.device)}: {size_text(r.current)} {when} · {size_text(r.peak)} peak"
        f" · {size_text(r.limit)} limit"
        for r in readings
    ]
    if estimate is not None:
        rows.append(html.escape(estimate_line(estimate)))
    return "<small style='font-family:monospace'>" + "<br>".join(rows) + "</small>"


def estimate_line(estimate: MemoryEstimate) -> str:
    """The estimate next to the readings: model states only (no activations), so a
    reading above it is expected; on CPU the process's RSS also holds torch itself."""
    return f"estimate (model states, per device): {estimate.describe()}"
