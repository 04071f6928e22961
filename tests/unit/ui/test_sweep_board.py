"""The sweep's widget board (``nbaccel/ui/sweep_board.py``), without processes: a ``Sweep``
of hand-made ``Trial`` objects, the board called as the scheduler calls its watcher.

Checked: a row per trial with its config, state, step, metric, seconds and device, the best
one starred; the curves as a PNG; the buttons disabled (with the interrupt note) while a
blocking sweep runs, and calling ``sweep.stop`` / ``sweep.stop_trial`` otherwise; the
summary (HTML table and PNG) written into the reserved outputs at the end, then the widgets
closed; with a UI thread, the scheduler's calls return at once, writes are throttled, and
the last call returns once the summary is out.
"""

from __future__ import annotations

import io
import itertools
import re
import threading
import time
from typing import Any

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from PIL import Image

from nbaccel.sweeps import _display
from nbaccel.sweeps.packing import Packer, Slot
from nbaccel.sweeps.trials import Sweep, Trial
from nbaccel.ui import sweep_board
from nbaccel.ui.sweep_board import SWEEP_BLOCKING_NOTE, SweepBoard

PNG = b"\x89PNG\r\n\x1a\n"
ROW = re.compile(r"<tr class='([^']*)' data-trial='(\d+)' data-state='([^']*)'")


class Handle:
    """A display handle: what was shown, then each update."""

    def __init__(self, bundle: dict[str, Any]) -> None:
        self.bundles = [bundle]

    def update(self, bundle: dict[str, Any], raw: bool = False) -> None:
        assert raw
        self.bundles.append(bundle)


class Shown:
    """A stand-in for IPython's ``display`` (raw bundles with display ids)."""

    def __init__(self) -> None:
        self.handles: list[Handle] = []
        self.threads: list[str] = []

    def __call__(self, bundle: dict[str, Any], raw: bool = False, display_id: bool = False) -> Any:
        assert raw and display_id
        self.threads.append(threading.current_thread().name)
        handle = Handle(bundle)
        self.handles.append(handle)
        return handle


def make_sweep(mode: str = "min") -> tuple[Sweep, list[int | None]]:
    now = time.monotonic()
    trials = [
        Trial(0, {"lr": 0.1}, "succeeded", Slot(0), started=now - 4, ended=now - 1,
              metrics={"loss": [(0, 1.0), (1, 0.6), (2, 0.4)]}),
        Trial(1, {"lr": 0.01}, "succeeded", Slot(1), started=now - 4, ended=now - 2,
              metrics={"loss": [(0, 1.0), (1, 0.3), (2, 0.2)], "acc": [(2, 0.9)]}),
        Trial(2, {"lr": 1.0}, "running", Slot(0), started=now - 1,
              metrics={"loss": [(0, 2.0), (1, 1.5)]}),
        Trial(3, {"lr": 3.0}),
    ]  # fmt: skip
    sweep = Sweep(trials, "loss", mode)
    asked: list[int | None] = []
    sweep._stop = asked.append  # what Scheduler._ask_stop would get
    return sweep, asked


def rows_of(table: str) -> list[tuple[str, int, str]]:
    return [(tags, int(number), state) for tags, number, state in ROW.findall(table)]


def end(sweep: Sweep) -> None:
    for trial in sweep.trials:
        if trial.state == "running":
            trial.state, trial.ended = "stopped", time.monotonic()
        elif trial.state == "pending":
            trial.state = "cancelled"
    sweep._done.set()


def test_rows_best_and_curves() -> None:
    sweep, _ = make_sweep()
    board = SweepBoard(sweep, 2, blocking=False, threaded=False)
    board(sweep)
    board.tick(force=True)
    table = board.table.value
    assert rows_of(table) == [
        ("nbaccel-sweep-row", 0, "succeeded"),
        ("nbaccel-sweep-row nbaccel-sweep-best", 1, "succeeded"),  # loss 0.2: the least
        ("nbaccel-sweep-row", 2, "running"),
        ("nbaccel-sweep-row", 3, "pending"),
    ]
    headers = re.findall(r"<th[^>]*>([^<]*)</th>", table)
    assert headers == ["trial", "lr", "state", "step", "loss", "best loss", "seconds", "device"]
    assert "★ 1" in table and "★ 0" not in table
    for said in ("0.01", "CPU slot 1", "0.2", "1.5", "2.0"):
        assert f">{said}</td>" in table, said
    header = board.header.value
    assert "4 trials" in header and "2 at a time" in header and "1 running" in header
    assert "best: trial 1, loss 0.2" in header
    png = bytes(board.curves.value)
    assert png.startswith(PNG) and board.curves.layout.display is None
    assert Image.open(io.BytesIO(png)).size == (720, 280)
    assert board.frames == 1
    assert "nbaccel-sweep-board" in board.widget._dom_classes
    for part, name in (
        (board.table, "nbaccel-sweep-table"),
        (board.curves, "nbaccel-sweep-curves"),
        (board.stop_all_button, "nbaccel-sweep-stop-all"),
        (board.stop_trial_button, "nbaccel-sweep-stop-trial"),
        (board.trial_picker, "nbaccel-sweep-trial"),
    ):
        assert name in part._dom_classes


def test_max_mode_and_no_metric_named() -> None:
    sweep, _ = make_sweep(mode="max")
    board = SweepBoard(sweep, 2, threaded=False)
    board.tick(force=True)
    best = [number for tags, number, _ in rows_of(board.table.value) if "best" in tags]
    assert best == [0]  # last loss 0.4 is the highest of the succeeded ones
    sweep.metric = None  # no metric named: "loss" is shown, nothing is starred
    board(sweep)
    board.tick(force=True)
    assert all("best" not in tags for tags, _, _ in rows_of(board.table.value))
    assert ">loss</th>" in board.table.value


def test_the_curves_are_redrawn_only_when_values_change() -> None:
    sweep, _ = make_sweep()
    board = SweepBoard(sweep, 2, threaded=False)
    board.tick(force=True)
    board(sweep)
    board.tick(force=True)
    assert board.frames == 1
    sweep.trials[2].metrics["loss"].append((2, 1.2))
    board(sweep)
    board.tick(force=True)
    assert board.frames == 2


def test_a_blocking_sweep_disables_its_buttons_and_says_to_interrupt() -> None:
    sweep, asked = make_sweep()
    board = SweepBoard(sweep, 2, blocking=True, threaded=False)
    board.tick(force=True)
    assert board.stop_all_button.disabled and board.stop_trial_button.disabled
    assert board.trial_picker.disabled
    assert "interrupt the kernel" in board.stop_note.value
    assert board.stop_all_button.tooltip == SWEEP_BLOCKING_NOTE
    board.stop_all_button.click()  # (no click reaches a busy kernel; none acts either)
    board.stop_trial_button.click()
    assert asked == []


def test_stop_buttons_call_the_sweep() -> None:
    sweep, asked = make_sweep()
    now = time.monotonic()
    sweep.trials[3].state, sweep.trials[3].slot, sweep.trials[3].started = "running", Slot(1), now
    board = SweepBoard(sweep, 2, blocking=False, threaded=False)
    board.tick(force=True)
    assert not board.stop_all_button.disabled and not board.stop_trial_button.disabled
    assert board.stop_note.value == ""
    assert [number for _, number in board.trial_picker.options] == [2, 3]
    assert board.trial_picker.options[0][0] == "trial 2: lr=1.0"
    board.trial_picker.value = 3  # the user's pick (a frontend change)
    board.stop_trial_button.click()
    assert asked == [3]
    sweep.trials[3].ending = "stopped"  # what Scheduler._stop_trial marks
    board.tick(force=True)
    assert [number for _, number in board.trial_picker.options] == [2]
    assert (3, "stopping") in [(number, state) for _, number, state in rows_of(board.table.value)]
    board.stop_all_button.click()
    board.stop_all_button.click()  # once
    assert asked == [3, None]
    board.tick(force=True)
    assert board.stop_all_button.disabled and board.stop_all_button.description == "Stopping…"
    assert "stopping every trial" in board.header.value


def test_the_picked_trial_stays_picked_when_others_start() -> None:
    sweep, _ = make_sweep()
    board = SweepBoard(sweep, 3, blocking=False, threaded=False)
    board.tick(force=True)
    sweep.trials[3].state, sweep.trials[3].started = "running", time.monotonic()
    board.trial_picker.value = 2
    board.tick(force=True)
    assert [number for _, number in board.trial_picker.options] == [2, 3]
    assert board.trial_picker.value == 2


def test_the_end_leaves_the_summary_and_closes_the_widgets() -> None:
    sweep, _ = make_sweep()
    sweep.trials[0].config["note"] = "<b>bold</b>"
    shown = Shown()
    board = SweepBoard(sweep, 2, blocking=True, threaded=False, display=shown)
    widgets_out, image_out = shown.handles
    live = widgets_out.bundles[0]
    assert live["application/vnd.jupyter.widget-view+json"]["model_id"] == board.widget.model_id
    assert "final summary follows" in live["text/plain"]
    assert image_out.bundles == [{"text/plain": ""}]
    board.tick(force=True)
    end(sweep)
    board(sweep)
    board.tick()
    assert board.closed and board.wait_finished(0)
    assert board.widget.comm is None and board.table.comm is None
    summary = widgets_out.bundles[-1]
    page = summary["text/html"]
    assert page.startswith("<div class='nbaccel-sweep-summary'>")
    assert "4 trials: 2 succeeded, 1 stopped, 1 cancelled; best trial 1: loss 0.2" in page
    assert "&lt;b&gt;bold&lt;/b&gt;" in page and "<b>bold</b>" not in page
    assert [(n, s) for _, n, s in rows_of(page)] == [
        (0, "succeeded"), (1, "succeeded"), (2, "stopped"), (3, "cancelled"),
    ]  # fmt: skip
    text = summary["text/plain"].splitlines()
    assert text[0].startswith("nbaccel sweep: 4 trials") and text[2].startswith("0 ")
    assert text[3].startswith("★ 1")
    picture = image_out.bundles[-1]
    assert picture["text/plain"] == "nbaccel sweep: loss of every trial"
    assert board.summary_png is not None and board.summary_png.startswith(PNG)
    assert board.summary_html == page
    board(sweep)  # a late call changes nothing
    assert len(widgets_out.bundles) == 2


def test_a_sweep_without_metrics_leaves_its_table_only() -> None:
    sweep = Sweep([Trial(0, {"x": 1}, "failed", Slot(0), error="ValueError: no")], None, "min")
    shown = Shown()
    board = SweepBoard(sweep, 1, threaded=False, display=shown)
    sweep._done.set()
    board(sweep)
    board.tick()
    widgets_out, image_out = shown.handles
    assert ">error</th>" in widgets_out.bundles[-1]["text/html"]
    assert "ValueError: no" in widgets_out.bundles[-1]["text/html"]
    assert image_out.bundles == [{"text/plain": ""}] and board.summary_png is None


def test_with_its_thread_the_scheduler_never_waits_and_writes_are_throttled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow = threading.Event()
    drawn: list[float] = []
    real = sweep_board.render_curves

    def render(*args: Any, **kwargs: Any) -> bytes:
        drawn.append(time.monotonic())
        slow.wait(0.2)  # a slow matplotlib: the scheduler must not feel it
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep_board, "render_curves", render)
    sweep, _ = make_sweep()
    shown = Shown()
    board = SweepBoard(sweep, 2, blocking=False, display=shown, interval=0.5)
    running = sweep.trials[2].metrics["loss"]
    began = time.monotonic()
    slowest = 0.0
    for step in range(2, 62):  # a metric every 20 ms for 1.2 s
        running.append((step, 1.0 / step))
        called = time.monotonic()
        board(sweep)
        slowest = max(slowest, time.monotonic() - called)
        time.sleep(0.02)
    assert slowest < 0.15, slowest  # never the 0.2 s of a frame
    elapsed = time.monotonic() - began
    assert 1 <= len(drawn) <= elapsed / 0.5 + 2, (len(drawn), elapsed)
    gaps = [later - earlier for earlier, later in itertools.pairwise(drawn)]
    assert all(gap >= 0.4 for gap in gaps), gaps
    end(sweep)
    board(sweep)  # the last call returns once the summary is out
    assert board.closed and board.wait_finished(0)
    assert shown.handles[1].bundles[-1]["image/png"]
    assert shown.threads == ["MainThread", "MainThread"]


def test_display_chooses_the_board_in_a_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    sweep, _ = make_sweep()
    packer = Packer((), 1, cpu_slots=2)
    watch = _display("text", sweep, packer, 4, True)
    assert type(watch).__name__ == "TextLines"
    monkeypatch.setattr("nbaccel.ui.choose.in_kernel", lambda: True)
    monkeypatch.setattr("nbaccel.ui.sweep_board.in_kernel", lambda: False)  # shown nowhere
    board = _display("auto", sweep, packer, 4, False)
    assert isinstance(board, SweepBoard)
    assert board.capacity == 2 and not board.blocking and board.total == 4
    end(sweep)
    board(sweep)
    assert board.closed
