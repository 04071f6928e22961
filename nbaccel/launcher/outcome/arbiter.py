"""Which rank failed, and the schedule of signals that stops the others.

The pump thread reports failures and asks, on every turn, which signals are due. Failures
are collected for a short window so that a rank's own failure can beat its peers'
"connection closed" reports that arrive first; then the culprit is fixed and the others are
stopped: SIGTERM then SIGKILL, or for a hang a stack dump (SIGUSR2) of the stuck ranks first.
A user's stop asks nicely first (SIGINT). Pure logic over the clock it is given; stdlib only.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

from nbaccel.events import STACK_DUMP_SIGNAL
from nbaccel.launcher.outcome.failures import Failure, choose_culprit

ARBITRATION_SECONDS = 0.5  # collect peers' failures before naming the culprit
# A "connection closed by peer" report says another rank died: wait this long for that
# rank's own report (its exit status comes through the helper, which may be busy) before
# blaming the rank that only saw it go. Any rank's own failure closes the window sooner.
PEER_PATIENCE_SECONDS = 5.0
FAILURE_ESCALATION = ((0.0, signal.SIGTERM), (1.0, signal.SIGKILL))
STOP_ESCALATION = ((0.0, signal.SIGINT), (0.5, signal.SIGTERM), (1.5, signal.SIGKILL))
HANG_ESCALATION = ((0.0, STACK_DUMP_SIGNAL), (0.5, signal.SIGTERM), (1.5, signal.SIGKILL))

Signal = tuple[int, list[int] | None]  # (signal number, ranks; None: every live rank)


class Arbiter:
    """Failure bookkeeping of one run.

    >>> a = Arbiter()
    >>> a.fail(Failure(0, "peer", 1.0), now=10.0)  # rank 0 saw a peer go: wait for it
    >>> a.due(now=12.0, live=[0], everyone_exited=False)
    []
    >>> a.fail(Failure(1, "exit", 3.0, exitcode=-9), now=12.1)  # the peer's own exit
    >>> a.due(now=12.2, live=[0], everyone_exited=False)  # still inside the window
    []
    >>> a.due(now=12.6, live=[0], everyone_exited=False) == [(signal.SIGTERM, None)]
    True
    >>> a.culprit.rank
    1
    """

    def __init__(self) -> None:
        self.failures: list[Failure] = []
        self.culprit: Failure | None = None
        self.stuck: list[int] = []  # ranks that never joined a timed-out collective
        self.cancelled = False
        self.saving = False  # asked to save and stop: ranks end on their own, or at the grace
        self._decide_at: float | None = None
        self._steps: list[tuple[float, int]] = []
        self._dump_ranks: list[int] | None = None

    def fail(self, failure: Failure, now: float) -> None:
        if self.cancelled or self.culprit is not None:
            return  # collateral of a failure already decided, or of a stop
        if any(f.rank == failure.rank for f in self.failures):
            return  # the exit that follows a reported error
        self.failures.append(failure)
        window = PEER_PATIENCE_SECONDS if failure.cause == "peer" else ARBITRATION_SECONDS
        deadline = now + window
        self._decide_at = deadline if self._decide_at is None else min(self._decide_at, deadline)

    def cancel(self, now: float) -> None:
        """A user's stop; ignored once a failure is being handled."""
        if not self.cancelled and self.culprit is None:
            self.cancelled = True
            self._schedule(STOP_ESCALATION, now)

    def save_and_stop(self, now: float, grace: float) -> None:
        """Ask every rank to save at a step they agree on and stop (SIGUSR1, which a rank's
        loop answers at its next step: not SIGTERM, which torch elastic's restarts use to end
        ranks), then SIGKILL whatever is left after ``grace``."""
        if not self.cancelled and not self.saving and self.culprit is None:
            self.saving = True
            self._steps = [(now, int(signal.SIGUSR1)), (now + grace, int(signal.SIGKILL))]

    def due(self, now: float, live: Sequence[int], everyone_exited: bool) -> list[Signal]:
        """Decide the culprit when its time has come; return the signals to send now."""
        window_closed = self._decide_at is not None and (now >= self._decide_at or everyone_exited)
        if window_closed and self.culprit is None:
            self.culprit = choose_culprit(self.failures)
            if self.culprit.cause == "timeout":
                failed = {f.rank for f in self.failures}
                self.stuck = [rank for rank in live if rank not in failed]
                self._dump_ranks = self.stuck
                self._schedule(HANG_ESCALATION, now)
            else:
                self._schedule(FAILURE_ESCALATION, now)
        signals: list[Signal] = []
        while self._steps and self._steps[0][0] <= now:
            _, signum = self._steps.pop(0)
            if live:
                signals.append((signum, self._dump_ranks if signum == STACK_DUMP_SIGNAL else None))
        return signals

    def next_deadline(self) -> float | None:
        """When ``due`` next has something to do, if anything is pending."""
        deadlines = [when for when, _ in self._steps[:1]]
        if self._decide_at is not None and self.culprit is None:
            deadlines.append(self._decide_at)
        return min(deadlines) if deadlines else None

    def final_culprit(self) -> Failure | None:
        """At the end of the run: the culprit, deciding now if the window never closed."""
        if self.culprit is None and self.failures:
            self.culprit = choose_culprit(self.failures)
        return self.culprit

    def _schedule(self, steps: tuple[tuple[float, signal.Signals], ...], now: float) -> None:
        self._steps = [(now + delay, int(signum)) for delay, signum in steps]
