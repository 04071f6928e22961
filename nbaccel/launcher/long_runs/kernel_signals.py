"""SIGTERM or SIGUSR1 to the process that launched a run (a kernel, a script) saves it first.

A notebook server shutting a kernel down, a container's stop, a scheduler's notice: they
signal the launching process, not the ranks, and its workers would die with it unsaved. While
a run started here is live, ``SaveOnSignal`` answers the signal by asking the run to save
at a step every rank agrees on and stop (``Run.stop(save=True)``, in a thread: the kernel's
loop is not held). SIGTERM then goes on to what it did before (the process ends, as asked),
once the run has ended or its ``checkpoint_grace`` has passed; SIGUSR1 leaves the process up.

Python lets only the main thread set handlers, and the run ends on its pump thread: the
handlers before are put back when the main thread next waits on the ended run
(``Run.wait``, ``result``, ``stop``), so a launch leaves the process as it found it. Until
then an ended run's handler hands the signal straight to the one before. Runs that overlap
chain their handlers, each answering for its own run; ended ones leave the chain.
"""

from __future__ import annotations

import os
import signal
import threading
import weakref
from types import FrameType
from typing import Any, Protocol

from nbaccel.events import SAVE_AND_STOP_SIGNALS, RunState


class Stoppable(Protocol):
    @property
    def state(self) -> RunState: ...

    def stop(
        self, timeout: float | None = None, *, save: bool = False, why: str | None = None
    ) -> RunState: ...


class SaveOnSignal:
    """This process's SIGTERM / SIGUSR1 handler for one run (see the module's docstring)."""

    def __init__(self, run: Stoppable) -> None:
        # Weakly: a handler outlives its run, which must not keep the run (its result
        # buffers, its pipes) alive.
        self._run = weakref.ref(run)
        self._previous: dict[int, Any] = {}

    @property
    def live(self) -> bool:
        run = self._run()
        return run is not None and not run.state.done

    def install(self) -> bool:
        """Install the handlers; False where Python forbids it (not the main thread).
        Handlers of runs that have ended are dropped from the chain here."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in SAVE_AND_STOP_SIGNALS:
            self._previous[signum] = _live_or_first(signal.getsignal(signum), signum)
            signal.signal(signum, self._on_signal)
        return True

    def uninstall(self) -> None:
        """Put back the handlers before, ended runs' skipped (main thread only; elsewhere,
        and where another handler was set since, nothing changes)."""
        if threading.current_thread() is not threading.main_thread() or not self._previous:
            return
        for signum, previous in self._previous.items():
            # Kept either way: a handler installed over this one may still lead back here.
            if getattr(signal.getsignal(signum), "__self__", None) is self:
                signal.signal(signum, _live_or_first(previous, signum))

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if not self.live:
            self._pass_on(signum, previous, frame)
            return
        if signum == signal.SIGTERM:
            # Restored now (only the main thread may): a second SIGTERM acts at once.
            signal.signal(signum, previous)
            threading.Thread(target=self._save_then_end, args=(signum,), daemon=True).start()
        else:
            threading.Thread(target=self._save, args=(signum,), daemon=True).start()

    def _save(self, signum: int) -> None:
        run = self._run()
        if run is None:
            return
        try:
            run.stop(save=True, why=f"{signal.Signals(signum).name} to the launching process")
        except TimeoutError:
            pass  # the grace ran out: the run's own escalation ends what is left

    def _save_then_end(self, signum: int) -> None:
        self._save(signum)
        os.kill(os.getpid(), signum)  # what the signal would have done, now with a checkpoint

    @staticmethod
    def _pass_on(signum: int, previous: Any, frame: FrameType | None) -> None:
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _live_or_first(handler: Any, signum: int) -> Any:
    """``handler``, or past the handlers of runs that have ended, the first one before them."""
    while isinstance(owner := getattr(handler, "__self__", None), SaveOnSignal):
        if owner.live:
            break
        handler = owner._previous.get(signum, signal.SIG_DFL)
    return handler
