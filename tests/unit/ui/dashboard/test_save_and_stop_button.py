"""The dashboard's Save & stop button: ``run.stop(save=True)`` asked from a click.

Synthetic events, no kernel, no run (as ``test_dashboard.py``): the button's wiring (the
given request, or the launched run's, found through ``nbaccel.ui.attach``'s registry and held
weakly), its states (armed like Stop, "Saving…" while the ranks save, "Ended"), and the
header's "saving" then "stopped" with the run's Notice lines in the log.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from typing import Any

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from nbaccel.config.schema import Config
from nbaccel.events import Notice, RunEnded, RunStarted, RunState
from nbaccel.launcher.run import Run
from nbaccel.ui.attach import attach_dashboard
from nbaccel.ui.dashboard.board import Dashboard
from nbaccel.ui.dashboard.clicks import request_save_stop
from nbaccel.ui.dashboard.model import DashboardModel
from nbaccel.ui.dashboard.text import BLOCKING_NOTE, SAVE_STOP_TOOLTIP, summary_text

SAVED = "checkpoint saved before stopping at step 218 in /tmp/ck (0.1 s)"
STOPPED = (
    "stopped (SIGTERM), saved at step 218 in /tmp/ck: launch again with resume='auto' to go on"
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_dashboard(**options: Any) -> Dashboard:
    clock = Clock()
    model = DashboardModel.for_config(Config(strategy="ddp"), 2)
    return Dashboard(model, threaded=False, clock=clock, wall_clock=clock, **options)


def started(dash: Dashboard) -> Dashboard:
    dash(RunStarted("run-1", 2, "/tmp/run-1", 0.0))
    dash.tick()
    return dash


def test_save_and_stop_asks_once_says_saving_then_stopped_with_the_runs_notices() -> None:
    calls: list[str] = []
    dash = started(
        make_dashboard(stop=lambda: calls.append("stop"), save_stop=lambda: calls.append("save"))
    )
    button = dash.save_stop_button
    assert not button.disabled and button.description == "Save & stop"
    assert button.tooltip == SAVE_STOP_TOOLTIP and "resume='auto'" in button.tooltip
    assert "nbaccel-save-stop" in button._dom_classes
    assert dash.model_ids["save_stop_button"] == button.model_id
    button.click()
    button.click()  # a second click before the UI caught up asks nothing more
    dash.stop_button.click()  # nor does Stop: one stop is asked, once
    assert calls == ["save"]  # asked on the clicking thread, as Stop asks
    dash.flush()
    assert button.disabled and button.description == "Saving…"
    assert dash.stop_button.disabled and dash.stop_button.description == "Stop"
    assert dash.stacks_button.disabled
    assert "<b style='color:#1565c0'>saving</b>" in dash.header.value
    dash(Notice(SAVED, 1.0))
    dash(Notice(STOPPED, 1.1))
    dash.flush()
    assert button.description == "Saving…"  # until the run has ended
    assert dash.visible_log[-2:] == [f"nbaccel: {SAVED}", f"nbaccel: {STOPPED}"]
    dash(RunEnded(RunState.STOPPED, None, 2.0, 2.0))
    dash.flush()
    assert "<b style='color:#6a1b9a'>stopped</b>" in dash.header.value
    assert dash.errors.value == ""  # a stop that saved is no failure
    for ended in (button, dash.stop_button):
        assert ended.disabled and ended.description == "Ended" and ended.button_style == ""
    assert dash.summary_text.startswith("nbaccel run run-1: stopped")
    assert f"note: {STOPPED}" in dash.summary_text


def test_stop_first_leaves_save_and_stop_disabled_and_unasked() -> None:
    calls: list[str] = []
    dash = started(
        make_dashboard(stop=lambda: calls.append("stop"), save_stop=lambda: calls.append("save"))
    )
    dash.stop_button.click()
    dash.save_stop_button.click()
    dash.flush()
    assert calls == ["stop"]
    assert dash.stop_button.description == "Stopping…" and "stopping" in dash.header.value
    assert dash.save_stop_button.disabled and dash.save_stop_button.description == "Save & stop"


def test_disabled_like_stop_in_a_blocking_call_and_before_and_after_the_run() -> None:
    blocking = make_dashboard(blocking=True, stop=None, save_stop=lambda: None)
    assert blocking.save_stop_button.disabled and blocking.save_stop_button.tooltip == BLOCKING_NOTE
    assert "Save & stop" in blocking.stop_note.value
    started(blocking)
    assert blocking.save_stop_button.disabled
    # No request and no launched run to find (a dashboard built on its own): nothing to ask.
    alone = started(make_dashboard(stop=lambda: None))
    assert alone.save_stop_button.disabled and not alone.stop_button.disabled
    alone.save_stop_button.click()
    alone.flush()
    assert alone.save_stop_button.description == "Save & stop"
    ended = started(make_dashboard(stop=lambda: None, save_stop=lambda: None))
    ended(RunEnded(RunState.SUCCEEDED, None, 1.0, 1.0))
    ended.flush()
    assert ended.save_stop_button.disabled and ended.save_stop_button.description == "Ended"


def test_a_cancelled_save_and_stop_ends_as_cancelled() -> None:
    # Ranks that could not save within checkpoint_grace were ended: the header says so.
    dash = started(make_dashboard(stop=lambda: None, save_stop=lambda: None))
    dash.save_stop_button.click()
    dash(RunEnded(RunState.CANCELLED, None, 1.0, 1.0))
    dash.flush()
    assert "cancelled" in dash.header.value and dash.save_stop_button.description == "Ended"


class FakeRun:
    shown_ranks = Run.shown_ranks  # the real one: it reads config and ranks only

    def __init__(self) -> None:
        self.config = Config()
        self.world_size = 2
        self.ranks = (0, 1)
        self.worker_pids = {0: os.getpid()}
        self.xla_device: str | None = None
        self.stops: list[tuple[float | None, bool]] = []

    def subscribe(self, subscriber: Any) -> None:
        pass

    def stop(
        self, timeout: float | None = None, *, save: bool = False, why: str | None = None
    ) -> RunState:
        self.stops.append((timeout, save))
        raise TimeoutError("still stopping")


def test_a_launched_dashboard_asks_its_run_to_save_without_waiting_and_holds_it_weakly() -> None:
    run = FakeRun()
    dash = attach_dashboard(run, blocking=False, gpus=0)  # type: ignore[arg-type]
    assert not dash.save_stop_button.disabled
    dash.save_stop_button.click()
    assert run.stops == [(0.0, True)]  # asked, never waited for: the click's thread goes on
    dash.flush()
    assert dash.save_stop_button.description == "Saving…"
    # The request holds the run weakly: a dropped run is freed, and asking it does nothing.
    other = FakeRun()
    other_dash = attach_dashboard(other, blocking=False, gpus=0)  # type: ignore[arg-type]
    ask = other_dash._save_stop
    assert ask is not None
    ref = weakref.ref(other)
    del other
    gc.collect()
    assert ref() is None
    ask()  # nothing to ask any more, and no error
    blocking = attach_dashboard(FakeRun(), blocking=True, gpus=0)  # type: ignore[arg-type]
    assert blocking.save_stop_button.disabled


def test_request_save_stop_asks_with_save_and_no_wait() -> None:
    run = FakeRun()
    request_save_stop(weakref.ref(run))
    assert run.stops == [(0.0, True)]
    request_save_stop(lambda: None)  # the run is gone: nothing happens


def test_stopped_reads_as_stopped_in_the_summary_and_header() -> None:
    model = DashboardModel(world_size=2)
    model.handle(RunStarted("run-2", 2, "/tmp/run-2", 0.0))
    model.handle(Notice(STOPPED, 1.0))
    model.handle(RunEnded(RunState.STOPPED, None, 3.0, 3.0))
    assert model.state.done and model.header().state == "stopped"
    assert summary_text(model).startswith("nbaccel run run-2: stopped · 0:03")
    assert model.errors == []


def test_the_dashboard_modules_keep_the_kernel_torch_free() -> None:
    code = (
        "import sys\n"
        "import nbaccel.ui.attach, nbaccel.ui.dashboard.clicks, nbaccel.ui.dashboard.board\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False", out.stderr
