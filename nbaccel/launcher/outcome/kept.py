"""A run that keeps its workers (``keep_workers=True``): the pump's half that hands the ranks
over to a ``Workers`` group, and ``Run.workers``.

Each rank, once its function returned, prints a mark (``output.TRAINED_MARK``: everything it
printed is read before it), sends its value, then connects back to the kernel and serves
(``interactive.serve``). When every rank's mark and value are in and nothing failed, the run
*succeeds* as any run does (``RunEnded``; ``wait`` and ``result`` return), but its processes
go on: a thread of its own takes their connections (``accept_ranks``) and makes the group.
From then on a rank that dies is the group's failure (``kept_error``), not the run's; the
processes end when the group is closed (``_releasing``: their exits are expected), or when
the run is stopped.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from typing import Any

from nbaccel.errors import WorkersEnded
from nbaccel.events import Event, RunEnded, RunState
from nbaccel.launcher.outcome.arbiter import Arbiter

# A Run (run.py, which this room is below): its kept state is read here by name.
Run = Any

TAKE_OVER_TIMEOUT = 300.0  # how long run.workers waits for the ranks to connect back
# The last keep_workers run started in this process, weakly: the next one releases its
# workers, so that a training cell run again does not find the devices full.
_last_kept: weakref.ref[Run] | None = None


class HandOver:
    """What ``RunPump`` does for a run that keeps its workers (state set by ``Run.__init__``)."""

    run_id: str
    _keep: Any  # planned.KeptEnd, or None
    _handed_over: bool
    _releasing: bool
    _ranks: dict[int, Any]  # results.RankPipes by rank
    _arbiter: Arbiter
    _state: RunState
    _started: float
    _done: threading.Event
    _workers: Any
    _workers_ready: threading.Event
    _workers_failure: BaseException | None

    def _emit(self, event: Event) -> None: ...
    def _record(self, entry: dict[str, Any]) -> None: ...
    def _on_stall_message(self, message: dict[str, Any]) -> None: ...
    def _post(self, message: dict[str, Any]) -> None: ...

    def _maybe_hand_over(self) -> None:
        """On the pump thread, after a rank's mark or value: once every rank has sent both
        and nothing failed or was stopped, the run succeeded and its workers serve on."""
        if self._keep is None or self._handed_over:
            return
        if not all(r.has_result and r.trained for r in self._ranks.values()):
            return
        arbiter = self._arbiter
        if arbiter.failures or arbiter.cancelled or arbiter.saving:
            return  # the run ends as one does: the workers are not kept
        self._handed_over = True
        self._on_stall_message({"op": "watch_stalls", "seconds": None})  # idle is no stall
        self._record({"event": "ended", "state": RunState.SUCCEEDED.value, "workers_kept": True})
        self._state = RunState.SUCCEEDED
        self._emit(RunEnded(self._state, None, time.monotonic() - self._started, time.time()))
        self._done.set()
        name = f"nbaccel-keep-{self.run_id}"
        threading.Thread(target=self._take_over, name=name, daemon=True).start()

    def _take_over(self) -> None:
        """Make the workers' group (the ranks connect back now); on failure, stop them."""
        keep = self._keep
        assert keep is not None
        try:
            if keep.make is None:  # nbaccel.launch and notebook_launcher give one
                raise RuntimeError(
                    "keep_workers=True needs a kernel to serve the workers: launch with "
                    "nbaccel.launch or nbaccel.notebook_launcher"
                )
            self._workers = keep.make(self, keep)
        except BaseException as error:  # noqa: BLE001 - said by run.workers
            self._workers_failure = error
            keep.listener.close()
            self._post({"op": "stop", "save": False})
        finally:
            self._workers_ready.set()


def kept_workers(run: Run) -> Any:
    """``Run.workers``: the group a ``keep_workers`` run left (waits for the run to succeed
    and the ranks to connect back)."""
    if run._keep is None:
        raise ValueError(
            f"run {run.run_id} was launched without keep_workers=True, so its workers ended "
            "with the function. Launch with keep_workers=True to keep them (or use "
            "nbaccel.Workers from the start)."
        )
    state = run.wait()
    if not run._handed_over:
        raise WorkersEnded(
            f"run {run.run_id} ended {state.value}: workers are kept only when the function "
            "returns on every rank, so none were. "
            + ("Its error is run.error." if state is RunState.FAILED else "")
        )
    if not run._workers_ready.wait(TAKE_OVER_TIMEOUT):
        raise WorkersEnded(
            f"the workers of run {run.run_id} did not connect back within "
            f"{TAKE_OVER_TIMEOUT:g} s; see their logs in {run.run_dir}."
        )
    if run._workers_failure is not None:
        raise WorkersEnded(
            f"the workers of run {run.run_id} could not be kept: {run._workers_failure}"
        ) from run._workers_failure
    return run._workers


def release_kept(why: str) -> None:
    """A ``keep_workers`` launch is about to start (``api.start``): the workers the previous
    one kept are released first, one kept group at a time (a training cell run again must
    not find its devices full). A run still training is left alone."""
    previous = _last_kept() if _last_kept is not None else None
    if previous is None or not previous._handed_over or previous.processes_ended:
        return
    group = previous._workers if previous._workers_ready.is_set() else None
    if group is not None:
        group.close(why=why)
    else:
        previous.stop()
    print(
        f"nbaccel: released the workers kept by run {previous.run_id}: a keep_workers launch "
        "keeps one group at a time (close them yourself with workers.close()).",
        file=sys.stderr,
    )


def remember_kept(run: Run) -> None:
    """``run`` keeps its workers: the next ``keep_workers`` launch releases them."""
    global _last_kept
    _last_kept = weakref.ref(run)
