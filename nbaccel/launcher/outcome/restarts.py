"""The attempts of a run whose workers torch elastic restarts (``max_restarts``).

A failure in an attempt with restarts left ends nothing: elastic stops every worker on
every host and starts them again. ``Attempts`` keeps such failures until the next attempt
starts, then names its culprit (the same choice as the arbiter's: a rank's own failure
before a peer's report of it) for the ``RunRestarted`` event. Plain logic; stdlib only.
"""

from __future__ import annotations

from typing import Any

from nbaccel.events import RunRestarted
from nbaccel.launcher.outcome.failures import Failure, choose_culprit, describe_failure


class Attempts:
    """Which attempt runs, and the failures of those elastic restarts after.

    >>> attempts = Attempts(max_restarts=1)
    >>> attempts.restartable(0), attempts.restartable(1)
    (True, False)
    >>> _ = attempts.record(Failure(0, "peer", 1.0), 0, host=None)
    >>> _ = attempts.record(Failure(1, "exit", 2.0, exitcode=-9), 0, host="node2")
    >>> event = attempts.started(1, now=3.0)
    >>> event.attempt, event.rank, event.host, event.reason
    (1, 1, 'node2', 'killed by SIGKILL')
    >>> attempts.started(1, now=4.0) is None  # said once
    True
    """

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.current = 0  # the latest attempt started
        self._failures: dict[int, list[tuple[Failure, str | None]]] = {}

    def restartable(self, attempt: int) -> bool:
        """Whether elastic restarts every worker after a failure in ``attempt``."""
        return attempt < self.max_restarts

    def record(self, failure: Failure, attempt: int, host: str | None) -> dict[str, Any] | None:
        """Keep a failure of ``attempt``; its ``events.jsonl`` record, or None when the rank
        already failed in that attempt (the exit that follows its reported error)."""
        failures = self._failures.setdefault(attempt, [])
        if any(f.rank == failure.rank for f, _ in failures):
            return None
        failures.append((failure, host))
        return {
            "event": "failure",
            "attempt": attempt,
            "rank": failure.rank,
            "host": host,
            "cause": failure.cause,
            "reason": describe_failure(failure),
        }

    def restarts_used(self) -> tuple[int, int] | None:
        """(the attempt running, max_restarts) for a run that restarts; None otherwise."""
        return (self.current, self.max_restarts) if self.max_restarts else None

    def started(self, attempt: int, now: float) -> RunRestarted | None:
        """Elastic started ``attempt``: the event saying why (None if already said)."""
        if attempt <= self.current:
            return None
        failed = [f for a in range(attempt) for f in self._failures.pop(a, [])]
        self.current = attempt
        culprit = choose_culprit([f for f, _ in failed]) if failed else None
        if culprit is None:  # no worker said how (its host's agent may have broken)
            return RunRestarted(attempt, self.max_restarts, None, None, "a worker failed", now)
        host = next(h for f, h in failed if f is culprit)
        reason = describe_failure(culprit)
        return RunRestarted(attempt, self.max_restarts, culprit.rank, host, reason, now)
