"""The step at which every rank saves or stops: agreed, never guessed.

Ranks see a signal, a deadline or a wall-clock cadence at different moments, so each one's
own view is summed over all ranks in one small all-reduce: ``[stop asked, save due, the
check interval proposed]``. Every rank gets the same sums, so they save (or stop) at the same
step. The check is not every step: its cost (~0.1 ms on gloo) must vanish against the step,
so each rank proposes how many steps make ``CHECK_SECONDS`` and the mean of the proposals
(the same number everywhere) is the next interval. A step cadence ("500 steps") needs no
agreement for the save itself, but the check lands on its multiples so a stop still can.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from nbaccel.config.cadence import Cadence

CHECK_SECONDS = 0.2  # how often ranks compare notes: a stop waits at most about this long
MAX_INTERVAL = 10_000


@dataclass(frozen=True)
class Decision:
    save: bool
    stop: bool


class StepAgreement:
    """When to check, and the check. ``reduce_sum`` sums a list of ints over all ranks.

    >>> clock = iter([0.0, 1.0, 2.0]).__next__
    >>> agree = StepAgreement(lambda values: values, world_size=1,
    ...                       cadence=Cadence(steps=2), clock=clock)
    >>> agree.at_step(1, stop_asked=False), agree.at_step(2, stop_asked=False)
    (Decision(save=False, stop=False), Decision(save=True, stop=False))
    """

    def __init__(
        self,
        reduce_sum: Callable[[list[int]], list[int]],
        world_size: int,
        cadence: Cadence | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reduce, self._world, self.cadence, self._clock = (
            reduce_sum,
            world_size,
            cadence,
            clock,
        )
        now = clock()
        self.last_save_time, self.last_save_step = now, 0
        self._last_check_time, self._last_check_step = now, 0
        self.next_check = 1

    def restart_from(self, completed_steps: int) -> None:
        """A resume: the loaded state counts as the last save, and checks go on from it."""
        self.last_save_step = self._last_check_step = completed_steps
        self.last_save_time = self._last_check_time = self._clock()
        self.next_check = completed_steps + 1

    def saved(self, completed_steps: int) -> None:
        self.last_save_step, self.last_save_time = completed_steps, self._clock()

    def at_step(self, completed_steps: int, *, stop_asked: bool) -> Decision | None:
        """Called at each step boundary with the optimizer steps done; None when this step
        is not a check (the same on every rank), else what all ranks decided together."""
        if completed_steps < self.next_check:
            return None
        now = self._clock()
        due = self._due(completed_steps, now)
        per_step = (now - self._last_check_time) / max(1, completed_steps - self._last_check_step)
        proposal = (
            MAX_INTERVAL if per_step <= 0 else min(MAX_INTERVAL, int(CHECK_SECONDS / per_step))
        )
        stops, dues, proposals = self._reduce([int(stop_asked), int(due), max(1, proposal)])
        interval = max(1, proposals // self._world)
        if self.cadence is not None and self.cadence.steps is not None:
            to_multiple = self.cadence.steps - completed_steps % self.cadence.steps
            interval = min(interval, to_multiple)
        self.next_check = completed_steps + interval
        self._last_check_time, self._last_check_step = now, completed_steps
        return Decision(save=stops > 0 or dues > 0, stop=stops > 0)

    def _due(self, completed_steps: int, now: float) -> bool:
        if self.cadence is None or completed_steps <= self.last_save_step:
            return False
        if self.cadence.steps is not None:
            return completed_steps % self.cadence.steps == 0
        assert self.cadence.seconds is not None
        return now - self.last_save_time >= self.cadence.seconds - 1e-9 and not math.isnan(now)
