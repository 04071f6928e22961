"""A detached sweep's board in a kernel (``sweeps/detached.py``: ``follow``,
``show_attached``), without processes: the state file written as the supervisor writes it,
read back by ``AttachedSweep``, and the board called as ``follow`` calls it.

Checked: each change of the file reaches the board (rows, states, devices, metrics); the
board's buttons ask the supervisor through its stop files; the follower's last call comes
once the sweep is done, or once its supervisor is gone, and then it ends; outside a kernel
nothing is shown.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from nbaccel.sweeps.detached import AttachedSweep, follow, show_attached, write_state
from nbaccel.sweeps.packing import Slot
from nbaccel.sweeps.trials import Sweep, Trial
from nbaccel.ui.sweep_board import SweepBoard

ROW = re.compile(r"<tr class='[^']*' data-trial='(\d+)' data-state='([^']*)'")
WAIT_S = 10.0


class Calls:
    """What ``follow`` hands its watcher: each call's trial states, and a way to wait for one."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []
        self._changed = threading.Condition()

    def __call__(self, sweep: Sweep) -> None:
        with self._changed:
            self.seen.append([t.state for t in sweep.trials])
            self._changed.notify_all()

    def wait_for(self, states: list[str]) -> None:
        with self._changed:
            ok = self._changed.wait_for(lambda: states in self.seen, WAIT_S)
        assert ok, f"never saw {states}: {self.seen}"


@pytest.fixture
def supervisor() -> Iterator[int]:
    """A stand-in supervisor's pid: alive, deaf to SIGUSR1 (the stop buttons' wake-up),
    gone when the test ends (its stdin closes)."""
    code = (
        "import signal, sys; signal.signal(signal.SIGUSR1, signal.SIG_IGN); print(); "
        "sys.stdin.read()"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert process.stdout is not None and process.stdin is not None
    process.stdout.readline()  # its handler is set
    try:
        yield process.pid
    finally:
        process.stdin.close()
        process.wait(WAIT_S)


def supervised(tmp_path: Path, pid: int) -> tuple[Sweep, Path]:
    """The supervisor's side: its sweep, and the folder its state is written to."""
    sweep = Sweep([Trial(0, {"lr": 0.1}), Trial(1, {"lr": 1.0})], "loss", "min", "sweep-t")
    folder = tmp_path / "sweep-t"
    folder.mkdir()
    write_state(folder, sweep, pid, capacity=2, total=2)
    return sweep, folder


def test_each_change_of_the_state_file_reaches_the_board_until_the_sweep_is_done(
    tmp_path: Path, supervisor: int
) -> None:
    sweep, folder = supervised(tmp_path, supervisor)
    attached = AttachedSweep(folder)
    assert (attached.capacity, attached.total) == (2, 2)
    board = SweepBoard(attached, attached.capacity, blocking=False, total=2, threaded=False)
    calls = Calls()

    def watch(changed: Sweep) -> None:
        board(changed)
        calls(changed)

    thread = follow(attached, watch, every=0.01)
    calls.wait_for(["pending", "pending"])

    first = sweep.trials[0]
    first.state, first.slot, first.started = "running", Slot(1), 0.0
    first.metrics = {"loss": [(0, 2.0), (5, 0.5)]}
    write_state(folder, sweep, supervisor, capacity=2, total=2)
    calls.wait_for(["running", "pending"])
    board.tick(force=True)
    assert ROW.findall(board.table.value) == [("0", "running"), ("1", "pending")]
    assert "CPU slot 1" in board.table.value and "0.5" in board.table.value

    # The buttons ask the supervisor through its files, as attach's stop_trial/stop do.
    board.trial_picker.value = 0
    board.stop_trial_button.click()
    board.stop_all_button.click()
    assert (folder / "stop-0").exists() and (folder / "stop").exists()

    first.state, first.ended = "stopped", 3.0
    sweep.trials[1].state = "cancelled"
    sweep._done.set()
    write_state(folder, sweep, supervisor, capacity=2, total=2)
    thread.join(WAIT_S)
    assert not thread.is_alive()  # its last call made, it ended
    assert calls.seen[-1] == ["stopped", "cancelled"]
    board.tick()
    assert board.closed and "stopped" in board.summary_html


def test_a_gone_supervisor_ends_the_following_with_what_it_last_wrote(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    _, folder = supervised(tmp_path, int(done.stdout))  # a pid whose process has exited
    calls = Calls()
    thread = follow(AttachedSweep(folder), calls, every=0.01)
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert calls.seen == [["pending", "pending"]]


def test_outside_a_kernel_nothing_is_shown(tmp_path: Path, supervisor: int) -> None:
    _, folder = supervised(tmp_path, supervisor)
    before = {t.name for t in threading.enumerate()}
    for dashboard in ("auto", "text", False):
        attached: Any = show_attached(AttachedSweep(folder), dashboard)
        assert attached.board is None
    assert {t.name for t in threading.enumerate()} == before  # no follower started
