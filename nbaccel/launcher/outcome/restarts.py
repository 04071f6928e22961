"""The attempts of a run whose workers torch elastic restarts (``max_restarts``).

A failure in an attempt with restarts left ends nothing: elastic stops every worker on
every host and starts them again. ``Attempts`` keeps such failures until the next attempt
starts, then names its culprit (the same choice as the arbiter's: a rank's own failure
before a peer's report of it) for the ``RunRestarted`` event. ``RestartsSeen`` is the part
of a run's pump thread that takes a failure to the arbiter or to ``Attempts``, and the
agents' word of a worker's end and of a restart. Plain logic; stdlib only.
"""

from __future__ import annotations

import selectors
import time
from collections.abc import Callable
from typing import Any

from nbaccel.events import Event, RunRestarted
from nbaccel.launcher.outcome.arbiter import Arbiter
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


class RestartsSeen:
    """Failures and restarts as a run's pump thread takes them (a part of ``pump.RunPump``,
    whose state it reads: ``_ranks`` holds its ``RankPipes``)."""

    _arbiter: Arbiter
    _attempts: Attempts
    _helper: Any  # starter.WorkerStarter
    _ranks: dict[int, Any]
    _record: Callable[[dict[str, Any]], None]
    _emit: Callable[[Event], None]
    _read: Callable[[selectors.BaseSelector, Any, str], bool]
    _on_exit: Callable[[Any, int, selectors.BaseSelector], None]

    def _fail(self, failure: Failure, attempt: int | None = None) -> None:
        """A rank failed (in ``attempt``, for a worker's own report): the arbiter ends the
        run, unless elastic restarts every worker after it (restarts left, no stop)."""
        if attempt is None or not self._restartable(attempt):
            self._arbiter.fail(failure, time.monotonic())
            return
        host = self._helper.host_of(failure.rank) if self._helper is not None else None
        record = self._attempts.record(failure, attempt, host)
        if record is not None:
            self._record(record)

    def _restartable(self, attempt: int) -> bool:
        return self._attempts.restartable(attempt) and not self._arbiter.cancelled

    def _on_worker_ended(self, message: dict[str, Any], selector: selectors.BaseSelector) -> None:
        """One worker of an attempt ended (only the agent says so, its last bytes first):
        with restarts left a failure of that attempt; in the last one the arbiter hears of
        it before elastic's end reports every rank (the ranks it stopped after it, too)."""
        r, attempt, status = self._ranks[message["rank"]], message["attempt"], message["status"]
        if not self._restartable(attempt) and r.exitcode is None:
            # No attempt comes after this one (restarts used up, or a stop): the rank's
            # process is gone, and waiting for elastic to return took 2-4 s more on a stop.
            # Its status is None where elastic reaped it before the agent read it: then its
            # exit is elastic's to report ("exited"), not an exit code of None.
            if status is not None:
                self._on_exit(r, status, selector)
            return
        if status == 0:
            return
        while self._read(selector, r, "events"):
            pass  # its error report, if it sent one, names the failure better than its exit
        if r.has_result and r.attempt == attempt:
            return  # it had finished: a peer's failure stopped it at the end
        self._fail(Failure(r.rank, "exit", time.time(), exitcode=status), attempt)

    def _on_restarted(self, attempt: int) -> None:
        if self._arbiter.cancelled:
            return  # a stop's restart runs nothing (the agent's stop pipe)
        event = self._attempts.started(attempt, time.time())
        if event is not None:
            entry = {"event": "restarted", "attempt": attempt, "rank": event.rank}
            self._record({**entry, "host": event.host, "reason": event.reason})
            self._emit(event)
