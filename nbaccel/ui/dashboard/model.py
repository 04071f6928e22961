"""What the dashboard shows, as plain state built from the run's events (no widgets here).

``DashboardModel`` is fed events (and memory readings) by one thread, the dashboard's UI
thread, and answers what to draw: the header, a bounded log tail per rank with ``\\r``
progress bars as one updating line (and, when asked, one of several ranks' lines together,
rank-labelled as the text output labels them), the failure, metric series against step, memory per
device. Each part has a version number so the view redraws only what changed. Stdlib only.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from nbaccel.config.schema import Config
from nbaccel.events import (
    Event,
    LogLine,
    Metric,
    ModelPrepared,
    Notice,
    RankExited,
    RunEnded,
    RunRestarted,
    RunStarted,
    RunState,
    SettingsApplied,
    Waiting,
    WorkerStarted,
)
from nbaccel.hardware.memory_estimate import MemoryEstimate, estimate_for_config
from nbaccel.launcher.printer import line_label
from nbaccel.ui.dashboard.parts import (
    ErrorReport,
    LogTail,
    MemoryReading,
    Series,
    error_report,
    exit_text,
)

__all__ = [
    "DashboardModel",
    "ErrorReport",
    "Header",
    "LogTail",
    "MemoryReading",
    "Series",
    "error_report",
    "exit_text",
]

# tqdm's default bar ends with "| n/total [elapsed<remaining, rate]".
_PROGRESS = re.compile(r"(\d+)/(\d+) \[")
_RATE_WINDOW = 20.0  # seconds of (time, step) samples behind the step rate
# The "rank" of the log that shows several ranks' lines together (``together``).
TOGETHER = -1


@dataclass(frozen=True)
class Header:
    """The header line's facts; rates and ETA are ``None`` until they can be estimated."""

    run_id: str
    state: str
    elapsed: float
    step: int | None
    total: int | None
    step_rate: float | None
    samples_rate: float | None
    eta: float | None
    world_size: int
    strategy: str
    precision: str
    attempt: str | None = None  # "attempt 2 of 3" once torch elastic restarted the workers
    machines: int = 1  # hosts the ranks run on (hosts=...), as far as they have started


class DashboardModel:
    """Run state for the dashboard, built from events. Not thread-safe: one thread feeds it.

    >>> from nbaccel.events import LogLine, Metric
    >>> model = DashboardModel(world_size=2)
    >>> model.handle(LogLine(0, "epoch 1", False, False, 0.0))
    >>> model.handle(Metric(0, 0, {"loss": 2.0}, 0.0))
    >>> model.handle(Metric(0, 10, {"loss": 1.0}, 5.0))
    >>> model.tail(0), model.series("loss"), model.header(now=5.0).step_rate
    (['epoch 1'], ([0, 10], [2.0, 1.0]), 2.0)
    """

    def __init__(
        self,
        world_size: int = 1,
        *,
        ranks: Sequence[int] | None = None,
        strategy: str = "auto",
        precision: str = "no",
        tail_lines: int = 200,
        max_points: int = 4000,
        together: Sequence[int] = (),
    ) -> None:
        self.world_size = world_size
        # The ranks this dashboard's run has: all, or one machine's of a job launched from
        # each machine's own cell.
        self._ranks = list(ranks) if ranks is not None else None
        self.strategy = strategy
        self.precision = precision
        self.run_id = ""
        self.run_dir = ""  # from RunStarted: its parent holds the earlier runs to compare
        self.state = RunState.PENDING
        self.pids: dict[int, int] = {}
        self.errors: list[ErrorReport] = []
        self.waiting: str | None = None  # what the workers wait for (events.Waiting)
        self.notices: list[str] = []  # the launcher's Notice texts: the summary lists them apart
        self.errors_version = 0
        self.metrics_version = 0
        self.memory_version = 0
        self._tail_lines = tail_lines
        self._max_points = max_points
        self._tails: dict[int, LogTail] = {}
        # The ranks whose lines a log shows together (``TOGETHER``), and whose "\\r" line is
        # open in it: a redraw replaces only that rank's own line.
        self.together = tuple(sorted(together))
        self._together_open: int | None = None
        self._series: dict[str, Series] = {}
        self._memory: dict[str, MemoryReading] = {}
        self._started: float | None = None
        self._elapsed: float | None = None  # fixed when the run ends
        self._step: int | None = None
        self._total: int | None = None
        self._steps: deque[tuple[float, int]] = deque()  # (time, step) of rank-0 metrics
        self._batch: float | None = None  # per-process batch size, if the run logs it
        self._progress: tuple[int, int] | None = None  # tqdm's n/total on rank 0
        self._progress_times: deque[tuple[float, int]] = deque()
        self.config: Config | None = None  # set by for_config: the memory estimate needs it
        self.settings_sources: dict[str, str] = {}  # what rank 0's Accelerator changed, why
        self.hosts: dict[int, str] = {}  # rank -> host, on several machines
        self.attempt: str | None = None  # after a restart (max_restarts): which attempt runs
        self.estimate: MemoryEstimate | None = None  # per device, once rank 0 prepared a model

    @classmethod
    def for_config(
        cls,
        config: Config,
        world_size: int,
        ranks: Sequence[int] | None = None,
        together: Sequence[int] = (),
        **options: int,
    ) -> DashboardModel:
        """A model labelled with a run's strategy and precision."""
        model = cls(
            world_size,
            ranks=ranks,
            strategy=config.strategy,
            precision=config.mixed_precision,
            together=together,
            **options,
        )
        model.config = config
        return model

    # ----- input ------------------------------------------------------------------
    def handle(self, event: Event) -> None:
        """Take one event from the run."""
        if self._started is None:
            self._started = event.time
        if isinstance(event, LogLine):
            self._tail(event.rank).add(event.text, event.replace, event.partial)
            if event.rank in self.together:
                replace = event.replace and self._together_open == event.rank
                label = line_label(event.rank, self.hosts.get(event.rank))
                self._tail(TOGETHER).add(label + event.text, replace, event.partial)
                self._together_open = event.rank if event.partial else None
            if event.rank == 0:
                self._read_progress(event)
        elif isinstance(event, Metric):
            self._on_metric(event)
        elif isinstance(event, Waiting):
            self.waiting = event.text  # the header's state until a worker starts
        elif isinstance(event, WorkerStarted):
            self.waiting = None
            if event.host is None:  # a pid on another host is not read here
                self.pids[event.rank] = event.pid
            else:
                self.hosts[event.rank] = event.host
        elif isinstance(event, SettingsApplied):
            # The Accelerator's plugins or arguments changed what runs: the header (and the
            # memory estimate) follow the worker's settings, not the launch's.
            self.strategy = str(event.values.get("strategy", self.strategy))
            self.precision = str(event.values.get("mixed_precision", self.precision))
            self.settings_sources = dict(event.sources)
            if self.config is not None:
                self.config = self.config.replace(**event.values)
        elif isinstance(event, ModelPrepared) and self.config is not None:
            # What the config panel estimated, now for the real model: shown by the bars.
            self.estimate = estimate_for_config(
                self.config, event.num_params, world_size=self.world_size
            )
            self.memory_version += 1
        elif isinstance(event, RunStarted):
            self.run_id, self.world_size = event.run_id, event.world_size
            self.run_dir = event.run_dir
            self.state, self._started = RunState.RUNNING, event.time
        elif isinstance(event, RankExited):
            if event.exitcode != 0 and not self.errors and self.state is RunState.RUNNING:
                # Provisional: the run's own error (with the traceback) replaces it at the end.
                self._set_error(ErrorReport(event.rank, exit_text(event.rank, event.exitcode), ""))
        elif isinstance(event, Notice):  # in the first rank's log, as the text output has it
            self.notices.append(event.text)
            first = self._ranks[0] if self._ranks else 0
            for tail in (first, TOGETHER) if self.together else (first,):
                self._tail(tail).add(f"nbaccel: {event.text}", False, False)
            self._together_open = None
        elif isinstance(event, RunRestarted):
            self.attempt = f"attempt {event.attempt + 1} of {event.max_restarts + 1}"
        elif isinstance(event, RunEnded):
            self.state, self._elapsed = event.state, event.elapsed
            if event.error is not None:
                self._set_error(error_report(event.error))
            elif self.errors and event.state is not RunState.FAILED:
                self._set_error(None)

    def set_memory(self, readings: list[MemoryReading]) -> None:
        """Take a memory sample; peaks are the highest seen for each device, ``last`` the
        latest known reading (kept when a worker has gone and reads "n/a")."""
        for reading in readings:
            old = self._memory.get(reading.device)
            old_peak = old.peak if old is not None else None
            peaks = [p for p in (reading.peak, reading.current, old_peak) if p is not None]
            last, baseline = reading.current, reading.baseline
            if old is not None:
                last = old.last if last is None else last
                baseline = old.baseline if baseline is None else baseline
            self._memory[reading.device] = MemoryReading(
                reading.device,
                reading.current,
                max(peaks) if peaks else None,
                reading.limit,
                private=reading.private,
                proportional=reading.proportional,
                last=last,
                baseline=baseline,
            )
        # In the source's order (by rank), whichever worker was read first: a reading taken
        # as rank 1 started alone must not put it above rank 0 for good.
        order = [r.device for r in readings]
        order += [device for device in self._memory if device not in order]
        self._memory = {device: self._memory[device] for device in order}
        self.memory_version += 1

    # ----- output -----------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        return list(self._ranks) if self._ranks is not None else list(range(self.world_size))

    def tail(self, rank: int) -> list[str]:
        """A rank's last lines; ``TOGETHER``: those of the ranks shown together, labelled."""
        return self._tail(rank).lines

    def log_choices(self) -> list[tuple[str, int]]:
        """What the log selector offers: the ranks together (when asked), then each rank.

        >>> DashboardModel(world_size=2, together=[0, 1]).log_choices()
        [('all ranks', -1), ('rank 0', 0), ('rank 1', 1)]
        """
        each = [(self.rank_label(r), r) for r in self.ranks]
        if not self.together:
            return each
        every = list(self.together) == self.ranks
        label = "all ranks" if every else "ranks " + ", ".join(map(str, self.together))
        return [(label, TOGETHER), *each]

    def tail_state(self, rank: int) -> tuple[int, int]:
        """(version, lines dropped) of a rank's tail: redraw when the version moves."""
        tail = self._tail(rank)
        return tail.version, tail.dropped

    @property
    def total_steps(self) -> int | None:
        """The run's last step, when it logs a ``total_steps`` metric."""
        return self._total

    @property
    def expected_last_step(self) -> int | None:
        """Where the curve's x axis should end: ``total_steps``, else rank 0's tqdm total
        (a guess: steps usually count the bar's iterations; the plot widens if they do not)."""
        if self._total is not None:
            return self._total
        return self._progress[1] if self._progress is not None else None

    @property
    def metric_names(self) -> list[str]:
        return list(self._series)

    def series(self, name: str) -> tuple[list[int], list[float]]:
        found = self._series.get(name)
        return (list(found.steps), list(found.values)) if found else ([], [])

    @property
    def memory(self) -> list[MemoryReading]:
        return list(self._memory.values())

    def header(self, now: float | None = None) -> Header:
        """The header at wall-clock time ``now`` (default: now)."""
        now = time.time() if now is None else now
        elapsed = self._elapsed
        if elapsed is None:
            elapsed = max(0.0, now - self._started) if self._started is not None else 0.0
        step, total, rate = self._step, self._total, _rate(self._steps)
        pace = rate  # in the units of step/total, for the ETA
        if total is None and self._progress is not None:
            # No total_steps metric: the rank-0 progress bar gives the position and its pace.
            (step, total), pace = self._progress, _rate(self._progress_times)
            rate = rate if rate is not None else pace
        samples = rate * self._batch * self.world_size if rate and self._batch else None
        eta = None
        running = self.state is RunState.RUNNING
        if running and pace and total is not None and step is not None and total >= step:
            eta = (total - step) / pace
        waiting = running and self.waiting is not None
        return Header(
            self.run_id,
            f"starting: {self.waiting}" if waiting else self.state.value,
            elapsed,
            step,
            total,
            rate,
            samples,
            eta,
            self.world_size,
            self.strategy,
            self.precision,
            self.attempt,
            len(set(self.hosts.values())) or 1,
        )

    def rank_label(self, rank: int) -> str:
        """How the log selector names a rank: ``rank 3``, or ``node2:rank 3`` on hosts.

        >>> model = DashboardModel(world_size=2)
        >>> model.hosts[1] = "node2"
        >>> model.rank_label(0), model.rank_label(1)
        ('rank 0', 'node2:rank 1')
        """
        host = self.hosts.get(rank)
        return f"{host}:rank {rank}" if host else f"rank {rank}"

    # ----- internals --------------------------------------------------------------
    def _tail(self, rank: int) -> LogTail:
        if rank not in self._tails:
            self._tails[rank] = LogTail(self._tail_lines)
        return self._tails[rank]

    def _set_error(self, report: ErrorReport | None) -> None:
        self.errors = [] if report is None else [report]
        self.errors_version += 1

    def _on_metric(self, event: Metric) -> None:
        if event.rank != 0:
            return  # rank 0's records are the run's (as in run.metrics)
        for name, value in event.values.items():
            if name == "total_steps":
                self._total = int(value)
            elif name == "batch_size":
                self._batch = float(value)
            else:
                if name not in self._series:
                    self._series[name] = Series(self._max_points)
                self._series[name].add(event.step, float(value))
        self._step = event.step
        _push(self._steps, (event.time, event.step))
        self.metrics_version += 1

    def _read_progress(self, event: LogLine) -> None:
        match = _PROGRESS.search(event.text)
        if match is None:
            return
        n, total = int(match.group(1)), int(match.group(2))
        if self._progress is not None and n < self._progress[0]:
            self._progress_times.clear()  # a new bar (next epoch) restarts the count
        self._progress = (n, total)
        _push(self._progress_times, (event.time, n))


def _push(window: deque[tuple[float, int]], sample: tuple[float, int]) -> None:
    window.append(sample)
    while len(window) > 2 and sample[0] - window[0][0] > _RATE_WINDOW:
        window.popleft()


def _rate(window: deque[tuple[float, int]]) -> float | None:
    if len(window) < 2:
        return None
    (t0, s0), (t1, s1) = window[0], window[-1]
    return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 >= s0 else None
