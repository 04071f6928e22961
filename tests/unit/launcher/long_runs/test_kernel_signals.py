"""The launching process's SIGUSR1/SIGTERM: a live run is asked to save and stop; handlers of
ended runs leave the chain; a run is not kept alive by its handler."""

from __future__ import annotations

import gc
import signal
import threading
import weakref
from collections.abc import Iterator

import pytest

from nbaccel.events import RunState
from nbaccel.launcher.long_runs.kernel_signals import SaveOnSignal


class FakeRun:
    def __init__(self) -> None:
        self.state = RunState.RUNNING
        self.asked = threading.Event()
        self.saves: list[bool] = []

    def stop(
        self, timeout: float | None = None, *, save: bool = False, why: str | None = None
    ) -> RunState:
        self.saves.append(save)
        self.state = RunState.STOPPED
        self.asked.set()
        return self.state


@pytest.fixture(autouse=True)
def _handlers_back() -> Iterator[None]:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def test_sigusr1_asks_the_live_run_to_save_and_the_process_stays() -> None:
    run = FakeRun()
    assert SaveOnSignal(run).install()
    signal.raise_signal(signal.SIGUSR1)
    assert run.asked.wait(10) and run.saves == [True]


def test_ended_runs_leave_the_chain_and_are_not_kept_alive() -> None:
    seen: list[int] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    old = FakeRun()
    SaveOnSignal(old).install()
    old.state = RunState.SUCCEEDED
    ref = weakref.ref(old)
    del old
    gc.collect()
    assert ref() is None  # the handler held it weakly
    new = FakeRun()
    SaveOnSignal(new).install()
    handler = signal.getsignal(signal.SIGUSR1)
    assert isinstance(getattr(handler, "__self__", None), SaveOnSignal)
    previous = handler.__self__._previous[signal.SIGUSR1]
    assert not isinstance(getattr(previous, "__self__", None), SaveOnSignal)  # dropped
    new.state = RunState.SUCCEEDED
    signal.raise_signal(signal.SIGUSR1)  # no live run: the handler before gets it
    assert seen == [signal.SIGUSR1]


def test_not_installed_off_the_main_thread() -> None:
    installed: list[bool] = []
    thread = threading.Thread(target=lambda: installed.append(SaveOnSignal(FakeRun()).install()))
    thread.start()
    thread.join(10)
    assert installed == [False]


def test_uninstall_puts_back_what_was_there_past_ended_runs() -> None:
    def before(signum: int, frame: object) -> None:
        """What the process had before the two runs."""

    signal.signal(signal.SIGUSR1, before)
    first, second = FakeRun(), FakeRun()
    one, two = SaveOnSignal(first), SaveOnSignal(second)
    one.install()
    two.install()
    first.state = RunState.SUCCEEDED
    one.uninstall()  # not the current handler: nothing changes
    assert getattr(signal.getsignal(signal.SIGUSR1), "__self__", None) is two
    second.state = RunState.SUCCEEDED
    two.uninstall()  # past the first run's ended handler, to what was there before both
    assert signal.getsignal(signal.SIGUSR1) == before
