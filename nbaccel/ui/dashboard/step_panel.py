"""The dashboard's step-time panel: where each rank's step goes, throughput, the straggler.

One row per rank: its mean step time over the last few seconds, a bar stacked by phase
(data, forward, backward, communication, optimizer, other; widths are shares of the step),
samples/s (and tokens/s when batches carry ``input_ids``), and the peak memory of the
phase that peaked highest where the device reports it (CUDA). Below, the throughput of all
ranks together, the time spent compiling (torch.compile) when there was a compile, and, when
ranks drift apart, the slowest one named (``nbaccel.step_board.StepBoard.straggler``). Plain
HTML in one ``ipywidgets.HTML``: no image to render, so it follows the dashboard's text
updates (4 Hz) at no cost worth measuring.
"""

from __future__ import annotations

import html

from nbaccel.events import Event, StepBreakdown
from nbaccel.step_board import PHASES, STRAGGLER_THRESHOLD, StepBoard, compile_text

COLOURS = {
    "data": "#f2a541",
    "forward": "#4c9be8",
    "backward": "#2f6db5",
    "communication": "#d9534f",
    "optimizer": "#5cb85c",
    "other": "#b0b0b0",
}


class StepPanel:
    """Step-time breakdowns in, HTML out (fed and read by the dashboard's UI thread).

    >>> panel = StepPanel()
    >>> panel.html()
    ''
    >>> panel.handle(StepBreakdown(0, 4, {"forward": 0.02, "backward": 0.02}, 32, None, None, 0))
    True
    >>> "10.0 ms" in panel.html() and "800 samples/s" in panel.html()
    True
    >>> "compile" in panel.html()  # no torch.compile: nothing said about it
    False
    >>> _ = panel.handle(StepBreakdown(0, 1, {"forward": 0.01}, 8, None, None, 0, 31.24))
    >>> "compile 31.2 s" in panel.html()
    True
    """

    def __init__(self) -> None:
        self.board = StepBoard()

    def handle(self, event: Event) -> bool:
        """Take an event; True when it was a step breakdown (the panel changed)."""
        if not isinstance(event, StepBreakdown):
            return False
        self.board.add(event)
        return True

    def html(self) -> str:
        """The panel, or "" before the first breakdown arrives (nothing shown)."""
        board = self.board
        if not board.ranks:
            return ""
        rows = "".join(self._row(rank) for rank in board.ranks)
        legend = " ".join(
            f'<span style="color:{COLOURS[p]}">&#9632;</span>&nbsp;{p}' for p in PHASES
        )
        samples, tokens = board.throughput()
        rate = f"{samples:,.0f} samples/s" + (f", {tokens:,.0f} tokens/s" if tokens else "")
        compiling = board.compile_seconds()
        compiled = (
            f'<span class="nbaccel-steps-compile">{compile_text(compiling)}</span> &middot; '
            if compiling > 0
            else ""
        )
        slow = board.straggler()
        if slow is None:
            drift = f"ranks keep together (straggler: &gt; {STRAGGLER_THRESHOLD:.0%} busier)"
        else:
            drift = (
                f'<b style="color:#d9534f">straggler: rank {slow.rank}</b>, '
                f"{slow.busy_seconds * 1000:.1f} ms busy per step vs "
                f"{slow.others_seconds * 1000:.1f} ms for the others "
                f"(+{slow.excess:.0%}); the others wait for it in communication"
            )
        return (
            '<div class="nbaccel-steps-panel"><b>Step time</b> (last seconds, per rank)'
            '<table style="border-collapse:collapse;font-size:90%">'
            f"{rows}</table><small>{legend}</small><br>"
            f'<span class="nbaccel-steps-rate">throughput: {rate}</span> &middot; {compiled}'
            f'<span class="nbaccel-steps-drift">{drift}</span></div>'
        )

    def summary(self) -> str:
        """One line for the end-of-run summary ("" when no breakdown arrived)."""
        line = self.board.summary()
        return f"step time: {line}" if line else ""

    def _row(self, rank: int) -> str:
        figures = self.board.recent(rank)
        step = figures.step_seconds
        bar = "".join(
            f'<div title="{p}: {figures.phases[p] * 1000:.2f} ms" style="display:inline-block;'
            f'height:12px;width:{300 * figures.phases[p] / step:.1f}px;background:{COLOURS[p]}">'
            "</div>"
            for p in PHASES
            if figures.phases.get(p, 0.0) > 0 and step > 0
        )
        shares = ", ".join(
            f"{p} {100 * figures.phases[p] / step:.0f}%"
            for p in PHASES
            if figures.phases.get(p, 0.0) > 0 and step > 0
        )
        rate = f"{figures.samples_per_second:,.0f} samples/s"
        if figures.tokens_per_second is not None:
            rate += f", {figures.tokens_per_second:,.0f} tokens/s"
        peak = ""
        if figures.peak_memory:
            phase, value = max(figures.peak_memory.items(), key=lambda item: item[1])
            peak = f"peak {value / 2**30:.2f} GiB ({phase})"
        cells = (f"rank {rank}", f"{step * 1000:.1f} ms", bar, rate, peak)
        tds = "".join(f'<td style="padding:0 6px">{cell}</td>' for cell in cells)
        return f'<tr title="{html.escape(shares)}">{tds}</tr>'
