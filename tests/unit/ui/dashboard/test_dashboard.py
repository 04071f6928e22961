"""The live dashboard: synthetic events into the model and the widgets, no kernel, no run.

Widgets work without a frontend: the tests assert on their values, and count the messages
they would send (``Widget._send``). Time is simulated: a dashboard built with
``threaded=False`` writes only when ``tick(now)`` says it is due.
"""

from __future__ import annotations

import base64
import os
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

import ipywidgets

from nbaccel.config.schema import Config
from nbaccel.errors import ConfigError, RemoteTraceback, WorkerError
from nbaccel.events import (
    LogLine,
    Metric,
    RankExited,
    RunEnded,
    RunStarted,
    RunState,
    StallWarning,
    WorkerStarted,
)
from nbaccel.launcher.run import Run
from nbaccel.ui import choose
from nbaccel.ui.attach import attach_dashboard, dashboard_for
from nbaccel.ui.dashboard.board import Dashboard
from nbaccel.ui.dashboard.memory import (
    MemorySampler,
    NvmlMemory,
    ProcessMemory,
    ReportedMemory,
    memory_source,
)
from nbaccel.ui.dashboard.model import TOGETHER, DashboardModel, MemoryReading
from nbaccel.ui.dashboard.plots import CurvePlot, MemoryBars, render_summary

PNG = b"\x89PNG\r\n\x1a\n"


def line(
    rank: int, text: str, replace: bool = False, partial: bool = False, t: float = 0.0
) -> LogLine:
    return LogLine(rank, text, replace, partial, t)


def failed_run(rank: int = 1) -> RunEnded:
    error = WorkerError(f"rank {rank} raised ValueError: bad <input>", rank=rank)
    error.__cause__ = RemoteTraceback(
        f"Traceback from rank {rank}:\nTraceback (most recent call last):\n"
        '  File "cell", line 3, in train\nValueError: bad <input>'
    )
    return RunEnded(RunState.FAILED, error, 2.0, 2.0)


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Every widget message, as (widget class, message) pairs."""
    messages: list[tuple[str, dict[str, Any]]] = []
    original = ipywidgets.Widget._send

    def record(self: Any, msg: dict[str, Any], buffers: Any = None) -> None:
        messages.append((type(self).__name__, msg))
        original(self, msg, buffers)

    monkeypatch.setattr(ipywidgets.Widget, "_send", record)
    return messages


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_dashboard(world_size: int = 2, **options: Any) -> tuple[Dashboard, Clock]:
    clock = Clock()
    model = DashboardModel.for_config(Config(mixed_precision="bf16", strategy="ddp"), world_size)
    dash = Dashboard(model, threaded=False, clock=clock, wall_clock=clock, **options)
    return dash, clock


# ----- the model ----------------------------------------------------------------------
def test_progress_bar_is_one_updating_line_and_tails_are_bounded_per_rank() -> None:
    model = DashboardModel(world_size=2, tail_lines=3)
    model.handle(line(0, "epoch 1"))
    model.handle(line(0, " 10%", partial=True))
    model.handle(line(1, "rank one"))
    model.handle(line(0, " 50%", replace=True, partial=True))
    model.handle(line(0, "100%", replace=True))
    model.handle(line(0, "done"))
    assert model.tail(0) == ["epoch 1", "100%", "done"]
    assert model.tail(1) == ["rank one"]
    for i in range(10):
        model.handle(line(0, f"n{i}"))
    assert model.tail(0) == ["n7", "n8", "n9"]
    assert model.tail_state(0)[1] == 10  # lines dropped from the front


def test_a_replace_without_an_open_line_appends() -> None:
    model = DashboardModel()
    model.handle(line(0, "final"))
    model.handle(line(0, "redraw", replace=True))
    assert model.tail(0) == ["final", "redraw"]


def test_ranks_shown_together_are_labelled_live_and_in_the_summary() -> None:
    model = DashboardModel(world_size=3, together=[0, 1])
    dash = Dashboard(model, rank=TOGETHER, threaded=False)
    assert dash.rank_selector.options[0] == ("ranks 0, 1", TOGETHER)
    dash(RunStarted("r1", 3, "", 0.0))
    for event in (
        line(0, "loss 1.0"),
        line(1, " 5%", partial=True),
        line(1, "50%", replace=True, partial=True),  # redraws rank 1's own line
        line(0, "loss 0.5"),
        line(1, "99%", replace=True, partial=True),  # rank 0's line came between: a new line
        line(2, "not asked for"),
    ):
        dash(event)
    dash(RunEnded(RunState.SUCCEEDED, None, 1.0, 1.0))
    dash.tick()
    shown = ["loss 1.0", "[rank 1] 50%", "loss 0.5", "[rank 1] 99%"]
    assert dash.visible_log == shown and dash.rank_selector.value == TOGETHER
    assert "[rank 1] 50%" in dash.log.value
    summary = dash.summary_text.splitlines()
    assert summary[-5:] == [
        "ranks 0, 1, the last 4 lines (each rank's whole log: run.logs(rank)):",
        *(f"  {text}" for text in shown),
    ]
    assert model.tail(1) == ["99%"]  # each rank's own log is there too: one redrawn line


def test_header_rates_and_eta_from_metrics() -> None:
    model = DashboardModel.for_config(Config(mixed_precision="bf16", strategy="fsdp"), 4)
    model.handle(RunStarted("r1", 4, "/tmp/r1", 100.0))
    for step in range(0, 21, 5):
        model.handle(
            Metric(0, step, {"loss": 1.0, "total_steps": 100, "batch_size": 8}, 100 + step / 10)
        )
    head = model.header(now=103.0)
    assert (head.state, head.elapsed, head.step, head.total) == ("running", 3.0, 20, 100)
    assert head.step_rate == pytest.approx(10.0)
    assert head.samples_rate == pytest.approx(10.0 * 8 * 4)
    assert head.eta == pytest.approx(8.0)
    assert (head.world_size, head.strategy, head.precision) == (4, "fsdp", "bf16")
    assert model.metric_names == ["loss"]  # total_steps and batch_size are not curves
    model.handle(RunEnded(RunState.SUCCEEDED, None, 5.5, 106.0))
    head = model.header(now=500.0)
    assert (head.state, head.elapsed, head.eta) == ("succeeded", 5.5, None)


def test_header_eta_from_a_tqdm_bar_on_rank_0() -> None:
    model = DashboardModel(world_size=2)
    model.handle(RunStarted("r1", 2, "/tmp/r1", 0.0))
    model.handle(line(0, " 10%|#         | 10/100 [00:01<00:09, 10.00it/s]", partial=True, t=1.0))
    model.handle(line(1, " 90%|######### | 90/100 [00:01<00:00]", partial=True, t=1.5))
    model.handle(line(0, " 30%|###       | 30/100 [00:03<00:07, 10.00it/s]", True, True, 3.0))
    head = model.header(now=3.0)
    assert (head.step, head.total) == (30, 100)
    assert head.step_rate == pytest.approx(10.0)
    assert head.eta == pytest.approx(7.0)
    model.handle(Metric(0, 0, {"loss": 1.0}, 1.0))  # logged every 5 iterations: 2 steps/s
    model.handle(Metric(0, 4, {"loss": 1.0}, 3.0))
    head = model.header(now=3.0)
    assert head.step_rate == pytest.approx(2.0) and head.eta == pytest.approx(7.0)


def test_metric_series_stay_bounded_and_keep_their_shape() -> None:
    model = DashboardModel(max_points=100)
    for step in range(10_000):
        model.handle(Metric(0, step, {"loss": float(step)}, 0.0))
    model.handle(Metric(1, 0, {"other_rank": 1.0}, 0.0))
    steps, values = model.series("loss")
    assert len(steps) < 100
    assert steps[0] == 0 and steps[-1] > 9_800 and values == [float(s) for s in steps]
    assert model.metric_names == ["loss"]  # rank 0's records are the run's


def test_failure_shows_the_failing_ranks_traceback() -> None:
    model = DashboardModel(world_size=2)
    model.handle(RunStarted("r1", 2, "/tmp/r1", 0.0))
    model.handle(RankExited(1, -9, 1.0))
    assert model.errors[0].summary == "rank 1 was killed by SIGKILL"
    model.handle(RankExited(0, -15, 1.1))  # collateral: the first one stays
    assert model.errors[0].rank == 1
    model.handle(failed_run(rank=1))
    [error] = model.errors
    assert error.rank == 1 and "ValueError: bad" in error.summary
    assert error.traceback.startswith("Traceback from rank 1:")


def test_memory_peaks_are_the_highest_seen() -> None:
    model = DashboardModel()
    model.set_memory([MemoryReading("cuda:0", 5, None, 10)])
    model.set_memory([MemoryReading("cuda:0", 3, None, 10), MemoryReading("xla", None, None, None)])
    assert model.memory == [
        MemoryReading("cuda:0", 3, 5, 10),
        MemoryReading("xla", None, None, None),
    ]
    assert model.memory[0].last == 3
    model.set_memory([MemoryReading("cuda:0", None, None, 10)])  # the worker has gone
    assert model.memory[0] == MemoryReading("cuda:0", None, 5, 10)
    assert model.memory[0].last == 3  # the last known reading is kept for the end


def test_memory_bars_keep_the_sources_order_whichever_worker_was_read_first() -> None:
    model = DashboardModel(world_size=2)
    model.set_memory([MemoryReading("rank 1 (cpu)", 5, None, 10)])  # rank 1 started first
    model.set_memory([MemoryReading(f"rank {r} (cpu)", 5, None, 10) for r in (0, 1)])
    assert [r.device for r in model.memory] == ["rank 0 (cpu)", "rank 1 (cpu)"]


# ----- the widgets --------------------------------------------------------------------
def test_on_several_machines_the_header_counts_them_and_the_log_names_host_and_rank() -> None:
    dash, clock = make_dashboard(world_size=4)
    dash(RunStarted("run-1", 4, "/tmp/run-1", clock.now))
    dash.rank_selector.value = 3  # the user's choice survives the relabelling
    for rank, host in enumerate(["node1", "node1", "node2", "node2"]):
        dash(WorkerStarted(rank, 100 + rank, clock.now, host=host))
    dash(line(3, "from the second machine"))
    dash.tick()
    assert "4 processes on 2 machines" in dash.header.value
    assert dash.rank_selector.options == (
        ("node1:rank 0", 0),
        ("node1:rank 1", 1),
        ("node2:rank 2", 2),
        ("node2:rank 3", 3),
    )
    assert dash.rank_selector.value == 3
    assert "from the second machine" in dash.log.value
    assert dash.model.pids == {}  # pids on other hosts are never sampled here


def test_widgets_show_header_log_rank_selector_metrics_and_memory() -> None:
    dash, clock = make_dashboard()
    dash(RunStarted("run-1", 2, "/tmp/run-1", clock.now))
    dash(WorkerStarted(0, 123, clock.now))
    dash(line(0, "hello <b>"))
    dash(line(1, "from rank one"))
    dash(Metric(0, 1, {"acc": 0.5, "loss": 2.0}, clock.now))
    dash.post_memory([MemoryReading("rank 0 (cpu)", 2**30, 2**31, 2**34)])
    assert dash.curve.layout.display == "none"  # no broken image before the first frame
    clock.now += 65
    dash.tick()
    assert "running" in dash.header.value and "1:05" in dash.header.value
    assert "2 processes · ddp · bf16" in dash.header.value and "run-1" in dash.header.value
    assert "hello &lt;b&gt;" in dash.log.value and "rank one" not in dash.log.value
    assert dash.metric_selector.options == ("acc", "loss")
    assert dash.metric_selector.value == "loss"  # preferred when nobody chose
    assert "loss = 2 at step 1" in dash.metric_value.value
    assert bytes(dash.curve.value).startswith(PNG) and bytes(dash.memory.value).startswith(PNG)
    assert dash.curve.layout.display is None and dash.memory.layout.display is None
    assert "1.0 GiB now · 2.0 GiB peak · 16.0 GiB limit" in dash.memory_text.value
    assert dash.errors.value == ""

    dash.rank_selector.value = 1  # as the browser would
    dash.metric_selector.value = "acc"
    clock.now += 1
    dash.tick()
    assert dash.visible_log == ["from rank one"] and "from rank one" in dash.log.value
    assert "acc = 0.5 at step 1" in dash.metric_value.value
    dash(Metric(0, 2, {"acc": 0.7, "loss": 1.0, "new": 3.0}, clock.now))
    clock.now += 1
    dash.tick()
    assert dash.metric_selector.value == "acc"  # new options keep the user's choice
    assert dash.metric_selector.options == ("acc", "loss", "new")


def test_the_header_says_what_the_launch_waits_for_until_a_worker_starts() -> None:
    # "running · 0:02" while the helper imported torch said nothing (issue 39, item 19).
    from nbaccel.events import Waiting

    dash, clock = make_dashboard()
    dash(RunStarted("run-1", 2, "/tmp/run-1", clock.now))
    dash(Waiting("the helper imports torch (the first launch only)", clock.now))
    clock.now += 2
    dash.tick()
    assert "starting: the helper imports torch (the first launch only)</b> · 0:02" in (
        dash.header.value
    )
    dash(WorkerStarted(0, 123, clock.now))
    clock.now += 1
    dash.tick()
    assert ">running</b> · 0:03" in dash.header.value


def test_error_is_highlighted_with_escaped_traceback() -> None:
    dash, _clock = make_dashboard()
    dash(RunStarted("run-1", 2, "/tmp/run-1", 0.0))
    dash(line(1, "Traceback (most recent call last):"))
    dash(failed_run(rank=1))
    dash.tick()
    assert "failed" in dash.header.value
    assert "<b>rank 1 failed</b>" in dash.errors.value
    assert (
        "bad &lt;input&gt;" in dash.errors.value and 'File "cell", line 3' not in dash.errors.value
    )
    assert "File &quot;cell&quot;, line 3, in train" in dash.errors.value
    dash.rank_selector.value = 1
    dash.tick()
    assert "color:#c62828'>Traceback" in dash.log.value  # error lines stand out in the log


def test_a_burst_of_10000_lines_in_one_second_sends_few_messages(sent: list[Any]) -> None:
    dash, clock = make_dashboard()
    dash(RunStarted("run-1", 2, "/tmp/run-1", clock.now))
    start = clock.now
    sent.clear()
    for i in range(10_000):
        dash(line(0, f"line {i}"))
        if i % 100 == 0:
            dash(
                line(0, f"{i // 100:3d}%|#| {i // 100}/100 [00:01<00:01]", True, True)
            )  # a new line: the last one was not open
            dash(Metric(0, i, {"loss": 1 / (i + 1)}, clock.now))
        if i % 10 == 9:  # the UI thread wakes up often; writes only when due
            clock.now = start + (i + 1) / 10_000
            dash.tick()
    clock.now = start + 1.1  # the lines after the last write go out at the next one
    dash.tick()
    updates = [m for m in sent if m[1].get("method") == "update"]
    by_widget = {name: sum(1 for n, _ in updates if n == name) for name, _ in updates}
    # 1.1 s at <= 10 Hz text (header, log, metric value; options once) and 2 Hz frames.
    assert len(updates) <= 50, by_widget
    assert by_widget["Image"] <= 3
    assert dash.visible_log[-1] == "line 9999" and len(dash.visible_log) == 200
    # Where the rest is, for a notebook_launcher user too (no Run): the rank's file.
    assert "9900 earlier lines: /tmp/run-1/rank0.log" in dash.log.value
    assert len(dash.log.value) < 10_000  # a bounded tail, never the growing log


def test_stop_button_stops_a_non_blocking_run() -> None:
    calls: list[str] = []
    dash, _clock = make_dashboard(stop=lambda: calls.append("stop"))
    dash(RunStarted("run-1", 2, "/tmp/run-1", 0.0))
    dash.tick()
    assert not dash.stop_button.disabled
    dash.stop_button.click()
    dash.stop_button.click()  # a second click before the UI caught up does nothing more
    dash.flush()
    assert calls == ["stop"]
    assert dash.stop_button.disabled and dash.stop_button.description == "Stopping…"
    assert "stopping" in dash.header.value
    dash(RunEnded(RunState.CANCELLED, None, 1.0, 1.0))
    dash.flush()
    assert "cancelled" in dash.header.value and dash.errors.value == ""


def test_blocking_dashboard_says_the_kernel_interrupt_stops_it() -> None:
    dash, _clock = make_dashboard(blocking=True, stop=None)
    assert dash.stop_button.disabled
    assert "interrupt the kernel" in dash.stop_note.value
    assert "interrupt the kernel" in dash.stop_button.tooltip
    assert dash.stacks_button.disabled  # clicks wait for the cell: the stall warning shows
    assert "stall warning" in dash.stacks_button.tooltip and "stall warning" in dash.stop_note.value


def test_stacks_button_shows_every_ranks_stack_without_stopping_anything() -> None:
    import time

    asked: list[str] = []

    def stacks() -> dict[int, str]:
        asked.append("stacks")
        return {0: "rank 0: in train (t.py:3), waiting in all_reduce\nThread MainThread:"}

    dash, _clock = make_dashboard(stop=lambda: asked.append("stop"), stacks=stacks)
    dash(RunStarted("run-1", 2, "/tmp/run-1", 0.0))
    dash.tick()
    assert not dash.stacks_button.disabled and dash.stacks.value == ""
    dash.stacks_button.click()
    deadline = time.monotonic() + 10
    while "Stacks at" not in dash.stacks.value and time.monotonic() < deadline:
        dash.flush()  # the answer comes from a thread of its own
    assert asked == ["stacks"]  # nothing stopped
    assert "waiting in all_reduce" in dash.stacks.value and "Thread MainThread" in dash.stacks.value
    assert "Stacks" in dash.stacks_button.description and not dash.stacks_button.disabled
    dash(RunEnded(RunState.SUCCEEDED, None, 1.0, 1.0))
    dash.flush()
    assert dash.stacks_button.disabled  # the ranks are gone


def test_a_stall_warning_shows_the_stacks_and_the_collectives() -> None:
    dash, _clock = make_dashboard()
    dash(RunStarted("run-1", 2, "/tmp/run-1", 0.0))
    stacks = {0: "rank 0: in train (t.py:9)\n  File t.py", 1: "rank 1: waiting in barrier\n"}
    dash(StallWarning(121.0, stacks, {0: None, 1: "barrier"}, 1.0))
    dash.flush()
    assert "No rank printed, logged a metric or finished a step for 121 s" in dash.stacks.value
    assert (
        "rank 1: waiting in barrier" in dash.stacks.value and "The run goes on" in dash.stacks.value
    )


def test_final_summary_is_displayed_as_png_and_text(monkeypatch: pytest.MonkeyPatch) -> None:
    import IPython.display

    shown: list[Any] = []

    class Handle:
        def __init__(self) -> None:
            self.updates: list[Any] = []

        def update(self, data: Any, raw: bool = False) -> None:
            self.updates.append(data)

    def display(obj: Any, raw: bool = False, display_id: bool = False) -> Handle | None:
        shown.append(obj)
        return Handle() if display_id else None

    monkeypatch.setattr(IPython.display, "display", display)
    dash = Dashboard(DashboardModel(world_size=2), stop=None, blocking=True)
    dash.show()
    view = shown[0]["application/vnd.jupyter.widget-view+json"]
    assert view["model_id"] == dash.widget.model_id and "pending" in dash.header.value
    assert "dashboard" in shown[0]["text/plain"]
    text_out, image_out = dash._summary_outputs  # type: ignore[misc]
    dash(RunStarted("run-1", 2, "/tmp/run-1", 0.0))  # starts the UI thread
    dash(Metric(0, 0, {"loss": 2.0}, 0.0))
    for i in range(30):  # more than the summary keeps, and one line too long to keep whole
        dash(line(0, f"epoch {i}" if i < 29 else "x" * 1000))
    dash(line(1, "rank 1 is not shown"))
    dash.post_memory([MemoryReading("rank 0 (cpu)", 100, 200, 1000)])
    ended = threading.Thread(target=dash, args=(RunEnded(RunState.SUCCEEDED, None, 1.0, 1.0),))
    ended.start()  # as the run's pump thread: it returns once the summary is out
    ended.join(timeout=30)
    assert not ended.is_alive() and dash.wait_finished(timeout=0)
    assert dash.summary_png is not None and dash.summary_png.startswith(PNG)
    assert "loss: last 2 at step 0" in text_out.updates[0]["text/plain"]
    assert "<pre>nbaccel run run-1: succeeded" in text_out.updates[0]["text/html"]
    # What rank 0 printed last stays in the saved cell, bounded: 20 lines of <= 300 chars.
    saved = text_out.updates[0]["text/plain"].splitlines()
    log_start = saved.index("rank 0's last 20 lines (all of them: /tmp/run-1/rank0.log):")
    assert saved[log_start + 1 :] == [f"  epoch {i}" for i in range(10, 29)] + [
        "  " + "x" * 299 + "…"
    ]
    assert "rank 1 is not shown" not in text_out.updates[0]["text/plain"]
    assert base64.b64decode(image_out.updates[0]["image/png"]) == dash.summary_png
    assert dash._thread is not None
    dash._thread.join(timeout=10)
    assert not dash._thread.is_alive()


def test_the_ui_thread_writes_new_lines_without_being_asked() -> None:
    dash = Dashboard(DashboardModel(world_size=1))
    seen = threading.Event()
    dash.log.observe(lambda change: "line 999" in change["new"] and seen.set(), names="value")
    dash(RunStarted("run-1", 1, "/tmp/run-1", 0.0))  # starts the UI thread
    for i in range(1000):
        dash(line(0, f"line {i}"))
    assert seen.wait(timeout=10)
    dash(RunEnded(RunState.SUCCEEDED, None, 0.1, 0.1))
    assert dash.wait_finished(timeout=10)


def test_flush_applies_events_on_the_ui_thread() -> None:
    dash = Dashboard(DashboardModel(world_size=1))
    dash.start()
    dash(line(0, "queued"))
    dash.flush(timeout=10)
    assert dash.visible_log == ["queued"]
    dash(RunEnded(RunState.SUCCEEDED, None, 0.1, 0.1))
    assert dash.wait_finished(timeout=10)


# ----- choosing widgets or text ---------------------------------------------------------
def test_text_outside_a_kernel_and_when_asked() -> None:
    assert not choose.in_kernel()
    assert choose.wants_widgets("auto") is False
    assert choose.wants_widgets("text") is False and choose.wants_widgets(False) is False
    assert choose.wants_widgets(True) is True


def test_widgets_in_a_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    class ZMQInteractiveShell:
        pass

    class ColabShell(ZMQInteractiveShell):
        pass

    fake = types.ModuleType("IPython")
    fake.get_ipython = ColabShell  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", fake)
    assert choose.in_kernel() and choose.wants_widgets("auto")
    monkeypatch.setattr(choose, "widgets_installed", lambda: False)
    assert choose.wants_widgets("auto") is False  # text instead
    with pytest.raises(ConfigError, match=r"pip install nbaccel\[notebook\]"):
        choose.wants_widgets(True)


class FakeRun:
    shown_ranks = Run.shown_ranks  # the real one: it reads config and ranks only

    def __init__(self, world_size: int = 2, **config: Any) -> None:
        self.config = Config(**config)
        self.world_size = world_size
        self.ranks = tuple(range(world_size))
        self.worker_pids = {0: os.getpid()}
        self.xla_device: str | None = None  # as Run for launches not through torch_xla
        self.subscribers: list[Any] = []
        self.stops: list[float] = []

    def subscribe(self, subscriber: Any) -> None:
        self.subscribers.append(subscriber)

    def stop(self, timeout: float = 10.0) -> RunState:
        self.stops.append(timeout)
        raise TimeoutError("still stopping")


def test_attach_subscribes_and_can_be_found_again() -> None:
    run = FakeRun(log_ranks="1")
    dash = attach_dashboard(run, blocking=False, gpus=0)  # type: ignore[arg-type]
    assert dashboard_for(run) is dash and run.subscribers == [dash]  # type: ignore[arg-type]
    assert dash.rank_selector.value == 1  # the first rank log_ranks shows
    assert set(dash.model_ids) >= {"widget", "log", "curve", "memory"}
    dash.stop_button.click()
    assert run.stops == [0.0]  # asked, never waited for, on the kernel's thread
    blocking = attach_dashboard(FakeRun(), blocking=True, gpus=0)  # type: ignore[arg-type]
    assert blocking.stop_button.disabled


# ----- memory readings -------------------------------------------------------------------
class FakeNvml:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.calls = fail, []

    def nvmlInit(self) -> None:
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"index-{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return f"uuid-{uuid}"

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return types.SimpleNamespace(used=len(handle) * 2**20, total=80 * 2**30)


def test_nvml_reads_the_gpus_the_ranks_use() -> None:
    nvml = FakeNvml()
    env = {"CUDA_VISIBLE_DEVICES": "GPU-1234abcd-0000,3"}
    readings = NvmlMemory(2, env, nvml=nvml).read()
    assert [r.device for r in readings] == ["cuda:0 (GPU-1234abcd)", "cuda:1 (GPU 3)"]
    assert readings[1] == MemoryReading("cuda:1 (GPU 3)", len("index-3") * 2**20, None, 80 * 2**30)


def test_the_readings_follow_gpu_ids_among_the_kernels_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The kernel sees GPUs 4, 5, 6; gpu_ids="2,0" gives rank 0 GPU 6 and rank 1 GPU 4.
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    run = FakeRun(world_size=2, gpu_ids="2,0")
    dash = attach_dashboard(run, blocking=True, gpus=2, show=False)  # type: ignore[arg-type]
    assert dash._sampler is not None
    readings = dash._sampler.sample()
    assert [r.device for r in readings] == ["cuda:0 (GPU 6)", "cuda:1 (GPU 4)"]
    every = FakeRun(world_size=2)  # all: the kernel's own list
    dash = attach_dashboard(every, blocking=True, gpus=2, show=False)  # type: ignore[arg-type]
    assert dash._sampler is not None
    assert [r.device for r in dash._sampler.sample()] == ["cuda:0 (GPU 4)", "cuda:1 (GPU 5)"]


def test_without_nvml_gpu_runs_fall_back_to_process_memory() -> None:
    fallback = ProcessMemory(lambda: {0: os.getpid()})
    [reading] = NvmlMemory(1, {}, nvml=FakeNvml(fail=True), fallback=fallback).read()
    assert reading.device == "rank 0 (cpu)" and reading.current


def test_process_memory_of_a_gone_worker_is_na(tmp_path: Path) -> None:
    readings = ProcessMemory(lambda: {0: os.getpid(), 1: 2**22 + 12345}).read()
    assert readings[0].current and readings[0].peak and readings[0].limit
    assert (readings[1].device, readings[1].current) == ("rank 1 (cpu)", None)


def test_pss_and_uss_are_read_once_a_second_from_the_first_second_on() -> None:
    now = [0.0]
    source = ProcessMemory(lambda: {0: os.getpid()}, clock=lambda: now[0])
    [early] = source.read()  # as a worker starts: RSS and its peak, no page-table walk
    assert early.current and early.peak and early.private is None and early.proportional is None
    now[0] = 1.0
    [detailed] = source.read()
    assert detailed.private is not None and detailed.proportional is not None
    assert detailed.private <= detailed.proportional <= (detailed.current or 0)
    now[0] = 1.5  # a wake-up between two ticks (a worker started): cheap again
    assert source.read()[0].proportional is None
    now[0] = 2.0
    assert source.read()[0].proportional is not None


def test_sources_for_xla_gpu_and_cpu() -> None:
    assert [
        r.current
        for r in memory_source(world_size=2, gpus=0, strategy="xla", pids=dict, env={}).read()
    ] == [None, None]
    assert isinstance(
        memory_source(world_size=2, gpus=2, strategy="ddp", pids=dict, env={}), NvmlMemory
    )
    assert isinstance(
        memory_source(world_size=2, gpus=0, strategy="ddp", pids=dict, env={}), ProcessMemory
    )


def test_sampler_thread_samples_and_stops_closing_its_source() -> None:
    nvml = FakeNvml()
    got = threading.Event()
    readings: list[list[MemoryReading]] = []

    def on_readings(batch: list[MemoryReading]) -> None:
        readings.append(batch)
        if len(readings) >= 3:
            got.set()

    sampler = MemorySampler(NvmlMemory(1, {}, nvml=nvml), on_readings, interval=0.01)
    sampler.start()
    assert got.wait(timeout=10)
    sampler.stop(timeout=10)
    assert sampler._thread is not None and not sampler._thread.is_alive()
    assert nvml.calls[0] == "init" and nvml.calls[-1] == "shutdown"
    assert readings[0][0].device == "cuda:0 (GPU 0)"
    assert ReportedMemory(1).read()[0].current is None  # a device nothing reported: n/a


# ----- frames --------------------------------------------------------------------------
def test_curve_redraws_its_axes_rarely_as_the_series_grows() -> None:
    plot = CurvePlot()
    steps: list[int] = []
    values: list[float] = []
    for step in range(2000):
        steps.append(step)
        values.append(2.0 / (1 + step) ** 0.5)
        if step % 20 == 0:
            assert plot.render("loss", steps, values).startswith(PNG)
    assert plot.full_draws <= 40  # of 100 frames; the rest are blitted
    plot.render("acc", steps, values)
    assert plot.full_draws >= 2  # another metric gets its own axes
    assert plot.render("nan", [0, 1], [float("nan"), float("inf")]).startswith(PNG)


def test_memory_bars_and_summary_render() -> None:
    bars = MemoryBars()
    readings = [
        MemoryReading("cuda:0", 2**30, 2**31, 2**34),
        MemoryReading("xla", None, None, None),
    ]
    assert bars.render(readings).startswith(PNG)
    assert bars.render([*readings[:1], MemoryReading("xla", None, None, None)]).startswith(PNG)
    assert bars.full_draws == 1
    summary = render_summary({"loss": ([0, 1], [1.0, 0.5]), "empty": ([], [])}, readings, "t")
    assert summary.startswith(PNG)
    assert render_summary({}, [], "nothing").startswith(PNG)


def test_the_estimate_for_the_prepared_model_is_shown_next_to_the_readings() -> None:
    from nbaccel.events import ModelPrepared
    from nbaccel.ui.dashboard.text import memory_html, summary_text

    config = Config(num_processes=2, strategy="fsdp")
    model = DashboardModel.for_config(config, 2)
    model.handle(ModelPrepared(0, 10**6, 1.0))
    assert model.estimate is not None
    assert model.estimate.total == 8 * 10**6  # ZeRO-3, AdamW, fp32, 2 ranks: 16 B / 2
    model.set_memory([MemoryReading("rank 0", 2**30, 2**30, 2**34)])
    text = memory_html(model.memory, estimate=model.estimate)
    assert "model states only (not activations, not the runtime): 7.63 MiB per device" in text
    assert "model states only" in summary_text(model)


# ----- widget lifetime in a long-lived kernel --------------------------------------------
def live_widgets() -> int:
    from ipywidgets.widgets import widget

    return len(widget._instances)  # ipywidgets 8: every open widget (layouts and styles too)


def test_closing_a_dashboard_closes_every_widget_it_made() -> None:
    before = live_widgets()
    dash, _ = make_dashboard()
    assert live_widgets() - before >= 20  # parts, containers, their layouts and styles
    dash.close()
    assert live_widgets() == before and dash.closed
    dash(line(0, "after the close"))  # ignored, never written to a closed widget
    dash.tick(force=True)
    assert dash.visible_log == []


def test_closing_while_the_ui_thread_runs(sent: list[Any]) -> None:
    before = live_widgets()
    dash = Dashboard(DashboardModel(world_size=1))
    dash(RunStarted("run-1", 1, "/tmp/run-1", 0.0))  # starts the UI thread
    dash(line(0, "working"))
    closer = threading.Thread(target=dash.close)  # e.g. a finalizer on another thread
    closer.start()
    closer.join(timeout=10)
    assert dash.wait_finished(timeout=10)
    assert dash._thread is not None
    dash._thread.join(timeout=10)
    assert not dash._thread.is_alive() and live_widgets() == before
    dash(RunEnded(RunState.SUCCEEDED, None, 0.1, 0.1))  # returns at once: no summary to wait for


@pytest.fixture
def shown_in_a_kernel(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """attach_dashboard as in a kernel: shown (display itself is skipped), from a cell
    whose key the test sets by appending to the returned list."""
    from nbaccel.ui import attach

    cells: list[str | None] = ["cell-1"]
    monkeypatch.setattr(attach, "in_kernel", lambda: True)
    monkeypatch.setattr(attach, "_cell_key", lambda: cells[-1])
    monkeypatch.setattr(attach, "_SHOWN", attach.ShownDashboards(limit=8))
    monkeypatch.setattr(Dashboard, "show", lambda self, later=False: None)
    return cells


def test_twenty_launches_from_one_cell_keep_one_live_dashboard(
    shown_in_a_kernel: list[str | None],
) -> None:
    # Not blocking: widgets at once (a blocking call's come with its run: dashboard_after).
    before, runs = live_widgets(), [FakeRun() for _ in range(20)]
    dashboards = [attach_dashboard(run, blocking=False, gpus=0) for run in runs]  # type: ignore[arg-type]
    per_dashboard = live_widgets() - before
    assert [d.closed for d in dashboards] == [True] * 19 + [False]
    dashboards[-1].close()
    assert live_widgets() == before
    assert per_dashboard < 60  # one dashboard's worth, not twenty


def test_launches_from_many_cells_keep_at_most_eight_live(
    shown_in_a_kernel: list[str | None],
) -> None:
    before, runs = live_widgets(), [FakeRun() for _ in range(21)]
    first = attach_dashboard(runs[0], blocking=False, gpus=0)  # type: ignore[arg-type]
    per_dashboard = live_widgets() - before
    dashboards = [first]
    for i in range(20):
        shown_in_a_kernel.append(f"cell-{i + 2}")
        dashboards.append(attach_dashboard(runs[i + 1], blocking=False, gpus=0))  # type: ignore[arg-type]
    assert sum(not d.closed for d in dashboards) == 8
    assert live_widgets() - before == 8 * per_dashboard
    for dashboard in dashboards:
        dashboard.close()
    assert live_widgets() == before


def test_a_dropped_run_closes_its_non_blocking_dashboard() -> None:
    import gc

    before = live_widgets()
    run = FakeRun()
    dash = attach_dashboard(run, blocking=False, gpus=0)  # type: ignore[arg-type]
    assert live_widgets() > before and not dash.closed
    del run
    gc.collect()
    assert dash.closed and live_widgets() == before


def test_settings_from_the_workers_accelerator_relabel_the_header_and_estimate() -> None:
    from nbaccel.events import ModelPrepared, SettingsApplied

    model = DashboardModel.for_config(Config(mixed_precision="no", strategy="ddp"), 2)
    source = "plugin: FullyShardedDataParallelPlugin"
    changed = {"strategy": "fsdp", "mixed_precision": "bf16"}
    model.handle(SettingsApplied(0, changed, {"strategy": source}, 1.0))
    head = model.header(now=2.0)
    assert (head.strategy, head.precision) == ("fsdp", "bf16")
    assert model.settings_sources == {"strategy": source}
    model.handle(ModelPrepared(0, 1_000_000, 2.0))
    assert model.estimate is not None
    ddp = DashboardModel.for_config(Config(mixed_precision="bf16", strategy="ddp"), 2)
    ddp.handle(ModelPrepared(0, 1_000_000, 2.0))
    assert ddp.estimate is not None
    assert model.estimate.total < ddp.estimate.total  # sharded: the estimate follows the plugin


def test_a_machine_of_a_job_shows_its_own_ranks() -> None:
    # Machine 1 of a job launched from each machine's cell (num_nodes=2): ranks 2 and 3.
    run = FakeRun(world_size=4)
    run.ranks = (2, 3)
    dash = attach_dashboard(run, blocking=True, gpus=0)  # type: ignore[arg-type]
    assert dash.rank_selector.value == 2  # log_ranks "0" is elsewhere: its own first rank
    assert [value for _, value in dash.rank_selector.options] == [2, 3]
    assert run.shown_ranks() == {2}  # the text display's choice, the same
    run.config = Config(log_ranks="all")
    assert run.shown_ranks() is None
    run.config = Config(log_ranks="1,3")
    assert run.shown_ranks() == {3}
