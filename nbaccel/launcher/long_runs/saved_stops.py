"""Save-and-stop as a run's pump thread handles it (a part of ``pump.RunPump``, whose
state it reads): who asked (``run.stop(save=True)``, the dashboard, a signal to the
launching process, ``max_duration``), the ranks' ``RankStopped`` and ``CheckpointSaved``
messages, and the words the run ends with. The ranks only see a SIGUSR1 (the arbiter's), so
the end says who asked, when it was asked here; else the rank that was asked says why.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from nbaccel.config.schema import Config
from nbaccel.errors import ANOTHER_RANK
from nbaccel.events import CheckpointSaved, Event, Notice, RankStopped
from nbaccel.launcher.outcome.arbiter import Arbiter
from nbaccel.launcher.results import RankPipes


class SavedStops:
    """The pump's save-and-stop part (``pump.RunPump`` sets the state up)."""

    config: Config
    _arbiter: Arbiter
    _ranks: dict[int, RankPipes]
    _started: float
    _stopped: RankStopped | None
    _stop_reason: str | None  # who asked the ranks to save and stop, when it was asked here
    _handed_over: bool  # keep_workers: the run succeeded, its workers serve on
    _emit: Callable[[Event], None]
    _record: Callable[[dict[str, Any]], None]

    def _ask_to_save(self, why: str) -> None:
        """Every rank saves at a step they agree on, then ends (the first reason stays)."""
        self._stop_reason = self._stop_reason or why
        self._arbiter.save_and_stop(time.monotonic(), self.config.checkpoint.grace)

    def _check_max_duration(self, now: float) -> None:
        deadline = self._max_duration_deadline()
        if deadline is not None and now >= deadline:
            limit = self.config.max_duration
            self._emit(Notice(f"max_duration={limit:g} s passed: saving and stopping", time.time()))
            self._ask_to_save(f"max_duration={limit:g} s")

    def _max_duration_deadline(self) -> float | None:
        limit = self.config.max_duration
        if limit is None or self._arbiter.saving or self._arbiter.cancelled:
            return None
        if self._handed_over:
            return None  # the run succeeded; its kept workers have no training to save
        if self.config.detach:
            return None  # the supervisor keeps a detached run's time (supervisor_main.py)
        return self._started + limit

    def _on_rank_stopped(self, r: RankPipes, message: RankStopped) -> None:
        r.stopped = True
        if self._stopped is None or self._stopped.why == ANOTHER_RANK:
            self._stopped = message  # the rank that was asked says why
        self._record({"event": "stopped", "rank": r.rank, "step": message.completed_steps})

    def _on_checkpoint_saved(self, message: CheckpointSaved) -> None:
        self._record({"event": "checkpoint", **dataclasses.asdict(message)})
        self._emit(message)
        what = "saved before stopping" if message.stopping else "saved"
        self._emit(
            Notice(
                f"checkpoint {what} at step {message.completed_steps:,} "
                f"in {message.location} ({message.seconds:.1f} s)",
                time.time(),
            )
        )

    def _say_stopped(self, stopped: RankStopped) -> None:
        """The run ended stopped: name ranks that did not save, then say where it saved."""
        if self._stop_reason:
            stopped = self._stopped = dataclasses.replace(stopped, why=self._stop_reason)
        killed = [r.rank for r in self._ranks.values() if not r.stopped]
        if killed:  # they did not reach the save in the grace: the checkpoint may lack them
            grace = self.config.checkpoint.grace
            text = f"ranks {killed} did not save within checkpoint_grace={grace:g} s and were ended"
            self._emit(Notice(text, time.time()))
        self._emit(
            Notice(
                f"stopped ({stopped.why}), saved at step {stopped.completed_steps:,} in "
                f"{stopped.checkpoint_dir}: launch again with resume='auto' to go on",
                time.time(),
            )
        )
