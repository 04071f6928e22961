"""The dashboard's words: the header line, the summary, and the HTML its widgets show.

Pure functions of the model's data (stdlib only), so the widget view, the final summary and
tests share one rendering. All text from workers is HTML-escaped.
"""

from __future__ import annotations

import html
from collections import Counter

from nbaccel.hardware.memory_estimate import MemoryEstimate
from nbaccel.ui.dashboard.model import (
    TOGETHER,
    DashboardModel,
    ErrorReport,
    Header,
    MemoryReading,
)

BLOCKING_NOTE = (
    "Blocking call: to stop the run, interrupt the kernel (■ in the toolbar, or I, I). "
    "Use nbaccel.launch() for working Stop, Save & stop and Stacks buttons; here a stall "
    "warning shows every rank's stack."
)
# run.stop(save=True)'s button (clicks.py): every rank saves at one step, then the run ends.
SAVE_STOP_LABEL = "Save & stop"
SAVE_STOP_TOOLTIP = (
    "Every rank saves a checkpoint at the same step, then the run ends; launch again with "
    "resume='auto' to go on from it"
)
# The saved summary keeps the end of the shown rank's log, as a cell that printed would:
# bounded, since a cell's text is saved into the notebook file (the whole log stays in
# run.logs(rank) and the run's folder).
SUMMARY_LOG_LINES = 20
SUMMARY_LINE_CHARS = 300
# "stopped": saved and ended on request (resumable), neither a success nor a failure.
_STATE_COLOURS = {
    "running": "#1565c0",
    "succeeded": "#2e7d32",
    "failed": "#c62828",
    "stopped": "#6a1b9a",
}


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
    if head.attempt is not None:  # torch elastic restarted the workers (max_restarts)
        parts.append(head.attempt)
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
    machines = f" on {head.machines} machines" if head.machines > 1 else ""
    parts += [
        f"{head.world_size} {processes}{machines}",
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
            f"memory {r.device}: {size_text(r.peak)} peak, {size_text(r.last)} last, "
            f"{size_text(r.limit)} limit"
        )
    together = shared_once_text(model.memory)
    if together:
        lines.append(f"memory: {together}")
    if model.estimate is not None:
        lines.append(estimate_line(model.estimate))
    lines += [f"error: {error.summary}" for error in model.errors]
    # The launcher's notices are about the run (or another rank): not under a rank's lines.
    lines += [f"note: {text}" for text in model.notices]
    lines += log_tail_lines(model)
    return "\n".join(lines)


def log_tail_lines(model: DashboardModel) -> list[str]:
    """The last ``SUMMARY_LOG_LINES`` lines of the ranks shown together (``together``), else
    of the first rank that printed (rank 0 unless ``log_ranks`` leaves it out), each cut to
    ``SUMMARY_LINE_CHARS``, under a line that names the rank(s); none if nothing printed.

    >>> from nbaccel.events import LogLine
    >>> model = DashboardModel(world_size=2)
    >>> for i in range(25):
    ...     model.handle(LogLine(0, f"epoch {i}", False, False, 0.0))
    >>> log_tail_lines(model)[:2]
    ["rank 0's last 20 lines (all of them: run.logs(0)):", '  epoch 5']
    """
    if model.together:
        tail = _printed(model, TOGETHER)[-SUMMARY_LOG_LINES:]
        if not tail:
            return []
        label = model.log_choices()[0][0]
        head = f"{label}, the last {len(tail)} lines (each rank's whole log: {whole_log(model)}):"
    else:
        # log_ranks may skip rank 0
        rank = next((r for r in model.ranks if _printed(model, r)), None)
        if rank is None:
            return []
        tail = _printed(model, rank)[-SUMMARY_LOG_LINES:]
        head = (
            f"{model.rank_label(rank)}'s last {len(tail)} lines "
            f"(all of them: {whole_log(model, rank)}):"
        )
    cut = [
        line if len(line) <= SUMMARY_LINE_CHARS else line[: SUMMARY_LINE_CHARS - 1] + "…"
        for line in tail
    ]
    return [head, *(f"  {line}" for line in cut)]


def whole_log(model: DashboardModel, rank: int | None = None) -> str:
    """Where a rank's whole output is, for every reader: its file in the run folder (a
    ``notebook_launcher`` user has no ``Run`` to call ``logs`` on), else ``run.logs``.

    >>> model = DashboardModel(world_size=2)
    >>> whole_log(model, 1), whole_log(model)
    ('run.logs(1)', 'run.logs(rank)')
    >>> model.run_dir = "/runs/r1"
    >>> whole_log(model, 1), whole_log(model)
    ('/runs/r1/rank1.log', '/runs/r1/rank<N>.log')
    """
    if not model.run_dir:
        return "run.logs(rank)" if rank is None else f"run.logs({rank})"
    return f"{model.run_dir}/rank{'<N>' if rank is None else rank}.log"


def _printed(model: DashboardModel, rank: int) -> list[str]:
    """A rank's tail without the launcher's notices (the live log shows them in the first
    rank's; the summary lists them apart, as notes: one can be about another rank)."""
    notices = Counter(f"nbaccel: {text}" for text in model.notices)
    kept = []
    for line in model.tail(rank):
        if notices[line]:
            notices[line] -= 1
        else:
            kept.append(line)
    return kept


def header_html(head: Header, *, stopping: bool, saving: bool = False) -> str:
    """The header widget's HTML: the state in colour, then the rest of the line; a running
    run asked to stop is "stopping", or "saving" (Save & stop: every rank saves, then ends).

    >>> head = Header("r1", "running", 5.0, None, None, None, None, None, 2, "ddp", "no")
    >>> header_html(head, stopping=True, saving=True).split("</b>")[0][-6:]
    'saving'
    """
    colour = _STATE_COLOURS.get(head.state, "#e65100")
    asked = "saving" if saving else "stopping"
    state = asked if stopping and head.state == "running" else head.state
    rest = html.escape(header_text(head).split(" · ", 1)[1])
    return (
        f"<div style='font-family:monospace'><b style='color:{colour}'>{state}</b> · {rest} "
        f"<small style='color:#777'>{html.escape(head.run_id)}</small></div>"
    )


def log_html(lines: list[str], dropped: int, rank: int, whole_log: str = "") -> str:
    """A rank's log tail (``TOGETHER``: several ranks') in a box that stays scrolled to its
    newest line.

    >>> "&lt;b&gt;" in log_html(["<b>"], 0, 0)
    True
    """
    where = whole_log or ("run.logs(rank)" if rank == TOGETHER else f"run.logs({rank})")
    where = f"{where} has each rank's" if rank == TOGETHER else where
    body = [f"<span style='color:#888'>… {dropped} earlier lines: {where}</span>"]
    body = body if dropped else []
    for line in lines:
        text = html.escape(line)
        if line.startswith("Traceback") or "Error" in line.split(":", 1)[0]:
            text = f"<span style='color:#c62828'>{text}</span>"
        body.append(text)
    # column-reverse anchors the scroll position at the bottom as the tail is replaced.
    return (
        f"<div style='display:flex;flex-direction:column-reverse;height:{log_height(len(body))};"
        "overflow:auto;border:1px solid #ddd;background:#fafafa'><pre style='margin:0;"
        "padding:4px;font-size:12px;line-height:1.3'>" + "\n".join(body) + "</pre></div>"
    )


LOG_LINE_EM = 1.3  # the <pre>'s line height, in em of its 12 px font
LOG_MAX_LINES = 12  # beyond this many lines the box scrolls (its newest line in view)


def log_height(lines: int) -> str:
    """The log box's CSS height: as many lines as the tail holds (at least one, at most
    ``LOG_MAX_LINES``), plus the padding, so a one-line log does not sit in an empty box.

    >>> log_height(1), log_height(0), log_height(500)
    ('calc(15.6px + 10px)', 'calc(15.6px + 10px)', 'calc(187.2px + 10px)')
    """
    shown = min(max(lines, 1), LOG_MAX_LINES)
    return f"calc({shown * LOG_LINE_EM * 12:.1f}px + 10px)"  # 8 px padding, 2 px border


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
    """One line per device, then what the numbers cover.

    While running: the reading now, the peak and the limit. Once the run ended the bars
    show each device's peak; the text gives the peak and the last reading before the worker
    ended ("n/a" where unknown). On CPU a reading is the worker's RSS: the whole process,
    of which a bare worker (``MemoryReading.baseline``) is Python and torch alone, so the
    rest is the run's. The estimate, when a model was prepared, is model states only.
    """
    rows = []
    for r in readings:
        if ended:
            text = f"{size_text(r.last)} last · {size_text(r.peak)} peak (the bar)"
        else:
            text = f"{size_text(r.current)} now · {size_text(r.peak)} peak"
            if r.proportional is not None and r.private is not None:
                text += f" · PSS {size_text(r.proportional)} · own {size_text(r.private)}"
        rows.append(f"{html.escape(r.device)}: {text} · {size_text(r.limit)} limit")
    notes = [covers_text(readings, estimate), "" if ended else shared_once_text(readings)]
    if estimate is not None:
        notes.append(estimate_line(estimate))
    return (
        "<div style='font-family:monospace;font-size:85%;line-height:1.4'>"
        + "<br>".join(rows)
        + "<div style='color:#555;margin-top:2px'>"
        + "<br>".join(html.escape(note) for note in notes if note)
        + "</div></div>"
    )


def covers_text(readings: list[MemoryReading], estimate: MemoryEstimate | None) -> str:
    """What a reading covers, in words: on CPU the whole worker process's RSS, split into a
    bare worker and the run's own share (from the highest peak), else the device's use.

    >>> r = MemoryReading("rank 0 (cpu)", 300 * 2**20, 310 * 2**20, 2**34, baseline=250 * 2**20)
    >>> covers_text([r], None)  # doctest: +NORMALIZE_WHITESPACE
    'RSS = the whole worker process. A bare worker (Python + torch, before the function)
    holds 250.0 MiB; the run adds 60.0 MiB at its peak: model states, activations, data,
    caches.'
    """
    cpu = [r for r in readings if r.device.endswith("(cpu)")]
    if not cpu:
        return "Device memory in use (the whole device: runtime and caches included)."
    text = "RSS = the whole worker process."
    baselines = [r.baseline for r in cpu if r.baseline is not None]
    peaks = [r.peak for r in cpu if r.peak is not None]
    if baselines:
        bare = size_text(min(baselines))
        text += f" A bare worker (Python + torch, before the function) holds {bare}"
        if peaks:
            added = max(0, max(peaks) - min(baselines))
            what = "model states, activations, data, caches"
            text += f"; the run adds {size_text(added)} at its peak: {what}."
        else:
            text += "."
    return text


def shared_once_text(readings: list[MemoryReading]) -> str:
    """What the CPU workers take together, shared pages counted once (the sum of their PSS:
    a dataset every rank maps from shared memory counts once, not once per rank); "" when
    no reading has it.

    >>> r = [MemoryReading(f"rank {i} (cpu)", 1300 * 2**20, None, None, private=50 * 2**20,
    ...      proportional=700 * 2**20) for i in range(2)]
    >>> shared_once_text(r)
    'all ranks together: 1.4 GiB (PSS: pages they share counted once; RSS adds up to 2.5 GiB)'
    """
    known = [r for r in readings if r.proportional is not None]
    if not known:
        return ""
    together = sum(r.proportional or 0 for r in known)
    resident = sum(r.current or 0 for r in known)
    return (
        f"all ranks together: {size_text(together)} (PSS: pages they share counted once; "
        f"RSS adds up to {size_text(resident)})"
    )


def estimate_line(estimate: MemoryEstimate) -> str:
    """The estimate next to the readings: model states only (no activations, no runtime),
    so a reading above it is expected."""
    return (
        f"Estimate for the prepared model, model states only (not activations, not the "
        f"runtime): {estimate.describe()}"
    )
