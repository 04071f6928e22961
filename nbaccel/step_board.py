"""Every rank's step-time breakdown, read back in the parent: per-rank means, throughput,
the straggler and the time spent compiling (``StepBoard``). The dashboard's step panel and
the text printer show it.

The workers send it with ``nbaccel.metrics.report_step_breakdown`` (from the Accelerator's
``StepTimer``). Plain data, stdlib only.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from nbaccel.events import StepBreakdown

STRAGGLER_THRESHOLD = 0.15  # a rank busy 15 % longer per step than the others' median
PHASES = ("data", "forward", "backward", "communication", "optimizer", "other")
STRAGGLER_MIN_STEPS = 10  # fewer recent steps on a rank: too few to name a straggler
RECENT_WINDOWS = 6  # ~3 s of a rank's windows behind "recent" figures and the straggler


@dataclass(frozen=True)
class RankSteps:
    """A rank's steps as the board shows them: per-step means and rates."""

    rank: int
    steps: int
    step_seconds: float  # mean time of a step
    phases: dict[str, float]  # mean seconds of each phase in a step
    samples_per_second: float
    tokens_per_second: float | None
    peak_memory: dict[str, int] | None
    compile_seconds: float = 0.0  # spent in torch.compile since the rank started

    @property
    def busy_seconds(self) -> float:
        """A step's time less the wait for the gradient reduction: what the rank itself
        spends. Ranks in lockstep (DDP) take equal steps; the slow one waits least."""
        return self.step_seconds - self.phases.get("communication", 0.0)


@dataclass(frozen=True)
class Straggler:
    """The slowest rank, when it is ``excess`` (0.25: 25 %) busier per step than the
    median of the others."""

    rank: int
    busy_seconds: float
    others_seconds: float

    @property
    def excess(self) -> float:
        return self.busy_seconds / self.others_seconds - 1.0


class StepBoard:
    """Every rank's step-time breakdown as it arrives (one thread feeds and reads it).

    >>> board = StepBoard()
    >>> for rank, compute in ((0, 0.010), (1, 0.014)):  # rank 1 computes 40 % longer
    ...     board.add(StepBreakdown(rank, 10, {"forward": compute, "communication": 0.004
    ...                             if rank == 0 else 0.0, "data": 0.0}, 320, None, None, 0.0))
    >>> board.straggler()
    Straggler(rank=1, busy_seconds=0.0014, others_seconds=0.001)
    >>> round(board.throughput()[0])  # 320 samples in 0.014 s, twice
    45714
    """

    def __init__(self, threshold: float = STRAGGLER_THRESHOLD) -> None:
        self.threshold = threshold
        self._recent: dict[int, deque[StepBreakdown]] = {}
        self._totals: dict[int, _Totals] = {}
        self.version = 0  # bumped by every add: views redraw when it changed

    def add(self, event: StepBreakdown) -> None:
        self._recent.setdefault(event.rank, deque(maxlen=RECENT_WINDOWS)).append(event)
        self._totals.setdefault(event.rank, _Totals()).add(event)
        self.version += 1

    @property
    def ranks(self) -> list[int]:
        return sorted(self._recent)

    def recent(self, rank: int) -> RankSteps:
        """The rank's last few windows (~3 s)."""
        return _rank_steps(rank, self._recent[rank])

    def total(self, rank: int) -> RankSteps:
        """The rank's whole run."""
        return _rank_steps(rank, [self._totals[rank].as_event(rank)])

    def compile_seconds(self) -> float:
        """The longest any rank has spent compiling (torch.compile) so far: ranks compile
        side by side, so the slowest is what the run waited. 0.0 without a compile."""
        return max((self._totals[r].compile_seconds for r in self.ranks), default=0.0)

    def throughput(self, *, whole_run: bool = False) -> tuple[float, float | None]:
        """Samples/s and tokens/s (None without ``input_ids``) of all ranks together."""
        figures = [self.total(r) if whole_run else self.recent(r) for r in self.ranks]
        samples = sum(f.samples_per_second for f in figures)
        tokens = [f.tokens_per_second for f in figures if f.tokens_per_second is not None]
        return samples, (sum(tokens) if tokens else None)

    def straggler(self, *, whole_run: bool = False) -> Straggler | None:
        """The slowest rank, if its busy time per step exceeds the others' median by more
        than ``threshold``; None while ranks keep together, with one rank, or before every
        rank has ``STRAGGLER_MIN_STEPS`` recent steps (the first steps warm up unevenly)."""
        figures = [self.total(r) if whole_run else self.recent(r) for r in self.ranks]
        if len(figures) < 2 or min(f.steps for f in figures) < STRAGGLER_MIN_STEPS:
            return None
        slowest = max(figures, key=lambda f: f.busy_seconds)
        others = statistics.median(f.busy_seconds for f in figures if f is not slowest)
        if others <= 0 or slowest.busy_seconds <= others * (1 + self.threshold):
            return None
        return Straggler(slowest.rank, slowest.busy_seconds, others)

    def summary(self) -> str:
        """One line for the end of a run: mean step, phase shares, throughput, straggler."""
        if not self.ranks:
            return ""
        figures = [self.total(r) for r in self.ranks]
        step = statistics.mean(f.step_seconds for f in figures)
        phases = {p: statistics.mean(f.phases.get(p, 0.0) for f in figures) for p in PHASES}
        shares = ", ".join(
            f"{p} {100 * v / step:.0f}%" for p, v in phases.items() if v > 0 and step > 0
        )
        samples, tokens = self.throughput(whole_run=True)
        line = f"step {step * 1000:.1f} ms ({shares}); {samples:,.0f} samples/s"
        if tokens is not None:
            line += f", {tokens:,.0f} tokens/s"
        slow = self.straggler(whole_run=True)
        if slow is not None:
            line += f"; slowest rank {slow.rank} (+{100 * slow.excess:.0f}% busy per step)"
        compiling = self.compile_seconds()
        if compiling > 0:
            line += f"; {compile_text(compiling)}"
        return line


class _Totals:
    def __init__(self) -> None:
        self.steps = self.samples = 0
        self.tokens: int | None = None
        self.phases: dict[str, float] = {}
        self.peaks: dict[str, int] | None = None
        self.compile_seconds = 0.0

    def add(self, event: StepBreakdown) -> None:
        self.steps += event.steps
        # A running total on the rank, so its highest reading is its latest.
        self.compile_seconds = max(self.compile_seconds, event.compile_seconds)
        self.samples += event.samples
        if event.tokens is not None:
            self.tokens = (self.tokens or 0) + event.tokens
        for phase, seconds in event.phases.items():
            self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        for phase, peak in (event.peak_memory or {}).items():
            self.peaks = self.peaks if self.peaks is not None else {}
            self.peaks[phase] = max(self.peaks.get(phase, 0), peak)

    def as_event(self, rank: int) -> StepBreakdown:
        return StepBreakdown(
            rank,
            self.steps,
            self.phases,
            self.samples,
            self.tokens,
            self.peaks,
            0.0,
            self.compile_seconds,
        )


def _rank_steps(rank: int, windows: Any) -> RankSteps:
    steps = sum(w.steps for w in windows)
    seconds = sum(w.seconds for w in windows)
    phases: dict[str, float] = {}
    peaks: dict[str, int] | None = None
    tokens: int | None = None
    compiling = 0.0
    for window in windows:
        compiling = max(compiling, window.compile_seconds)
        for phase, value in window.phases.items():
            phases[phase] = phases.get(phase, 0.0) + value / max(steps, 1)
        for phase, peak in (window.peak_memory or {}).items():
            peaks = peaks if peaks is not None else {}
            peaks[phase] = max(peaks.get(phase, 0), peak)
        if window.tokens is not None:
            tokens = (tokens or 0) + window.tokens
    rate = 1.0 / seconds if seconds > 0 else 0.0
    return RankSteps(
        rank,
        steps,
        seconds / max(steps, 1),
        phases,
        sum(w.samples for w in windows) * rate,
        None if tokens is None else tokens * rate,
        peaks,
        compiling,
    )


def compile_text(seconds: float) -> str:
    """How the step-time line and the dashboard say the time spent compiling.

    >>> compile_text(31.24), compile_text(0.04)
    ('compile 31.2 s', 'compile 0.0 s')
    """
    return f"compile {seconds:.1f} s"
