"""The dashboard model's building blocks: memory readings, failure reports, a rank's log
tail and a bounded metric series (plain data, stdlib only; ``dashboard_model`` re-exports
them)."""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class MemoryReading:
    """One device's memory in bytes; ``None`` where it is not known (shown as "n/a")."""

    device: str
    current: int | None
    peak: int | None
    limit: int | None
    # CPU workers: of ``current`` (RSS), the pages this process alone holds (USS), and its
    # share of the pages it shares with others (PSS: data in shared memory, mapped by every
    # rank, counts once over them, so the ranks' PSS add up to what they take together).
    private: int | None = None
    proportional: int | None = None
    # Context, not part of the reading itself (so not compared: two readings of the same
    # figures are equal whatever came before them).
    # The latest known ``current`` (kept when a reading comes back "n/a": the worker ended).
    last: int | None = field(default=None, compare=False)
    # CPU: the RSS of a bare worker (Python, torch and nbaccel, before the function), so
    # that RSS minus it is what the run itself holds.
    baseline: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ErrorReport:
    """A failure to highlight: which rank, one summary line, and its traceback (may be "")."""

    rank: int | None
    summary: str
    traceback: str


class LogTail:
    """The last ``limit`` lines of one rank; a ``\\r`` redraw replaces its line in place.

    >>> tail = LogTail(limit=2)
    >>> for text, replace, partial in [("a", False, False), (" 5%", False, True),
    ...                                ("50%", True, True), ("99%", True, False)]:
    ...     tail.add(text, replace, partial)
    >>> tail.lines, tail.dropped
    (['a', '99%'], 0)
    """

    def __init__(self, limit: int) -> None:
        self._lines: deque[str] = deque(maxlen=limit)
        self._open = False  # the last line ended with "\r": the next one may overwrite it
        self.dropped = 0  # lines that fell off the front (still in run.logs(rank))
        self.version = 0

    @property
    def lines(self) -> list[str]:
        return list(self._lines)

    def add(self, text: str, replace: bool, partial: bool) -> None:
        if replace and self._open and self._lines:
            self._lines[-1] = text
        else:
            if len(self._lines) == self._lines.maxlen:
                self.dropped += 1
            self._lines.append(text)
        self._open = partial
        self.version += 1


@dataclass
class Series:
    """One metric against step, kept to at most ``limit`` points by halving its density."""

    limit: int
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    stride: int = 1  # keep every stride-th point; doubles each time the series fills up
    _seen: int = 0

    def add(self, step: int, value: float) -> None:
        self._seen += 1
        if (self._seen - 1) % self.stride:
            return
        self.steps.append(step)
        self.values.append(value)
        if len(self.steps) >= self.limit:
            # Dropping every other point keeps the whole curve's shape at bounded cost.
            del self.steps[1::2], self.values[1::2]
            self.stride *= 2


def error_report(error: BaseException) -> ErrorReport:
    """The failure as the dashboard shows it: the rank, a summary, the worker's traceback.

    >>> from nbaccel.errors import RemoteTraceback, WorkerError
    >>> error = WorkerError("rank 1 raised ValueError: bad", rank=1)
    >>> error.__cause__ = RemoteTraceback("Traceback from rank 1:\\nValueError: bad")
    >>> report = error_report(error)
    >>> report.rank, report.summary, report.traceback.splitlines()
    (1, 'WorkerError: rank 1 raised ValueError: bad', ['Traceback from rank 1:', 'ValueError: bad'])
    """
    rank = getattr(error, "rank", None)
    cause = error.__cause__
    traceback = str(getattr(cause, "text", "")) if cause is not None else ""
    return ErrorReport(
        rank if isinstance(rank, int) else None, f"{type(error).__name__}: {error}", traceback
    )


def exit_text(rank: int, exitcode: int) -> str:
    """How a worker process ended, in words.

    >>> exit_text(1, -9), exit_text(0, 3)
    ('rank 1 was killed by SIGKILL', 'rank 0 exited with code 3')
    """
    if exitcode >= 0:
        return f"rank {rank} exited with code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    return f"rank {rank} was killed by {name}"
