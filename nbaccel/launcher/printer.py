"""Text output of a run: the shown ranks' lines, labelled, with ``\\r`` progress bars kept.

Used outside Jupyter, without ipywidgets, and as the dashboard's fallback. Rank 0 is
printed bare; other ranks get a ``[rank N]`` label (``[host:rank N]`` on several machines,
rank 0's too). At the end, one line sums up the step
time (where it went, throughput, the straggler) when the workers sent a breakdown. A run
that restarts its workers (``max_restarts``) gets one line per restart; a stall warning,
every rank's stack.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TextIO

from nbaccel.events import (
    Event,
    LogLine,
    Notice,
    RunEnded,
    RunRestarted,
    RunState,
    SettingsApplied,
    StallWarning,
    StepBreakdown,
    Waiting,
)
from nbaccel.step_board import StepBoard


class TextPrinter:
    """A run subscriber that writes the chosen ranks' output to a text stream."""

    def __init__(
        self,
        stream: TextIO,
        ranks: frozenset[int] | None,
        announce_end: bool,
        host_of: Callable[[int], str | None] = lambda rank: None,
    ) -> None:
        self._stream = stream
        # Asked per line (``Run.host_of``): a rank's first line can come before its
        # WorkerStarted event (they travel on separate pipes), never before its host is known.
        self._host_of = host_of
        self._ranks = ranks
        self._announce_end = announce_end
        self._open_rank: int | None = None  # whose "\r" progress line is being redrawn
        # ipykernel's stream sends what it holds every flush_interval (0.2 s) by itself;
        # flushing it per line sent one IOPub message per line (measured: 100 msg/s and
        # +10 % of a core in the kernel). Terminals and pipes are flushed per line.
        self._flush_per_line = not hasattr(stream, "flush_interval")
        self._steps = StepBoard()

    def __call__(self, event: Event) -> None:
        if isinstance(event, LogLine):
            if self._ranks is not None and event.rank not in self._ranks:
                return
            text = line_label(event.rank, self._host_of(event.rank)) + event.text
            if event.replace and self._open_rank == event.rank:
                self._stream.write("\r" + text)
            else:
                self._stream.write(("\n" if self._open_rank is not None else "") + text)
            # A line that may be redrawn stays open (no newline) until it is final or another
            # line comes, so a terminal or a notebook redraws the bar in place.
            self._open_rank = event.rank if event.partial else None
            if not event.partial:
                self._stream.write("\n")
            if self._flush_per_line:
                self._stream.flush()
        elif isinstance(event, SettingsApplied):
            changes = ", ".join(
                f"{name}={value!r} ({event.sources.get(name, 'Accelerator')})"
                for name, value in event.values.items()
            )
            self._stream.write(
                ("\n" if self._open_rank is not None else "") + f"nbaccel: settings: {changes}\n"
            )
            self._open_rank = None
        elif isinstance(event, StepBreakdown):
            self._steps.add(event)
        elif isinstance(event, (Notice, Waiting)):
            said = f"starting: {event.text}" if isinstance(event, Waiting) else event.text
            self._stream.write(("\n" if self._open_rank is not None else "") + f"nbaccel: {said}\n")
            self._open_rank = None
            if isinstance(event, Waiting):
                self._stream.flush()  # said now: the wait is what comes next
        elif isinstance(event, StallWarning):
            self._stream.write(
                ("\n" if self._open_rank is not None else "") + stall_text(event) + "\n"
            )
            self._open_rank = None
            self._stream.flush()
        elif isinstance(event, RunRestarted):
            self._stream.write(
                ("\n" if self._open_rank is not None else "") + f"nbaccel: {restart_line(event)}\n"
            )
            self._open_rank = None
            self._stream.flush()
        elif isinstance(event, RunEnded):
            if self._open_rank is not None:
                self._stream.write("\n")
                self._open_rank = None
            if self._steps.ranks:
                self._stream.write(f"nbaccel: step time: {self._steps.summary()}\n")
            if self._announce_end and event.state is not RunState.SUCCEEDED:
                why = f": {event.error}" if event.error is not None else ""  # stop(): no error
                self._stream.write(f"nbaccel: run {event.state.value}{why}\n")
            self._stream.flush()


def line_label(rank: int, host: str | None) -> str:
    """What starts a rank's line where several ranks' lines are shown together: nothing for
    rank 0 on this machine, else ``[rank N] `` (``[host:rank N] `` on another machine).

    >>> line_label(0, None), line_label(1, None), line_label(0, "node2")
    ('', '[rank 1] ', '[node2:rank 0] ')
    """
    if host:
        return f"[{host}:rank {rank}] "
    return f"[rank {rank}] " if rank != 0 else ""


def restart_line(event: RunRestarted) -> str:
    """What a restart is called in text (the printer's line, the dashboard's notice).

    >>> restart_line(RunRestarted(1, 1, 1, None, "killed by SIGKILL", 0.0))
    'rank 1 failed (killed by SIGKILL); restarting the workers (attempt 2 of 2)'
    """
    attempt = f"attempt {event.attempt + 1} of {event.max_restarts + 1}"
    if event.rank is None:
        return f"{event.reason}; restarting the workers ({attempt})"
    where = f" on host {event.host}" if event.host is not None else ""
    return f"rank {event.rank}{where} failed ({event.reason}); restarting the workers ({attempt})"


def seconds_text(seconds: float) -> str:
    """A quiet time as it was, rounded down (it was quiet at least that long): tenths below
    10 s (a ``stall_warning`` of 0.5 s is no "1 s"), whole seconds above.

    >>> seconds_text(0.500663), seconds_text(3.04), seconds_text(120.7)
    ('0.5 s', '3 s', '120 s')
    """
    if seconds >= 10:
        return f"{math.floor(seconds)} s"
    tenths = math.floor(seconds * 10 + 1e-6)  # 0.49999999 of a float is 0.5
    return f"{tenths // 10} s" if tenths % 10 == 0 else f"{tenths / 10:.1f} s"


def stall_text(event: StallWarning) -> str:
    """A stall warning in text: why, then each rank's stack.

    >>> text = stall_text(StallWarning(120.0, {1: "rank 1: in train (t.py:3)"}, {1: None}, 0))
    >>> print(text)  # doctest: +ELLIPSIS
    nbaccel: no rank printed, logged a metric or finished a step for 120 s (stall_warning); ...
    rank 1: in train (t.py:3)
    """
    head = (
        f"nbaccel: no rank printed, logged a metric or finished a step for "
        f"{seconds_text(event.seconds)} "
        "(stall_warning); where each rank is now (the run goes on):"
    )
    return "\n".join([head, *(event.stacks[rank] for rank in sorted(event.stacks))])
