"""What the dashboard shows is sized from what the run knows (issue 16, part 4): the loss
axis, the log box, the memory bars after the end and what each memory number covers; and
earlier runs of the same runs_dir overlaid on the curve (part 3). Synthetic events, no run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from nbaccel.config.schema import Config
from nbaccel.events import LogLine, Metric, RunEnded, RunStarted, RunState
from nbaccel.ui.dashboard.board import Dashboard
from nbaccel.ui.dashboard.compare import EarlierRuns, earlier_runs
from nbaccel.ui.dashboard.memory import ProcessMemory
from nbaccel.ui.dashboard.model import DashboardModel, MemoryReading
from nbaccel.ui.dashboard.plots import CurvePlot, MemoryBars
from nbaccel.ui.dashboard.text import (
    LOG_MAX_LINES,
    covers_text,
    log_height,
    memory_html,
    size_text,
)

MiB = 2**20


def dashboard(run_dir: Path | None = None, world_size: int = 2) -> Dashboard:
    model = DashboardModel.for_config(Config(strategy="ddp"), world_size)
    dash = Dashboard(model, threaded=False, clock=lambda: 0.0, wall_clock=lambda: 0.0)
    if run_dir is not None:
        dash(RunStarted(run_dir.name, world_size, str(run_dir), 0.0))
    return dash


def plots_of(dash: Dashboard) -> tuple[CurvePlot, MemoryBars]:
    """The dashboard's plots; once it finished, the pair it gave back to its pool."""
    if dash._plots is not None:
        return dash._plots[1], dash._plots[2]
    curve, bars = dash._pool._free[-1]
    return curve, bars


def curve_of(dash: Dashboard) -> CurvePlot:
    return plots_of(dash)[0]


def log_metrics(dash: Dashboard, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        dash(Metric(0, step, {"loss": 10.0 / (step + 1)}, float(step)))


# ----- the loss axis ------------------------------------------------------------------------
def test_a_30_step_run_without_a_known_total_ends_with_its_axis_on_its_steps() -> None:
    dash = dashboard()
    log_metrics(dash, 10)
    dash.tick(force=True)
    low, high = curve_of(dash).xlim
    assert low == 0.0 and 9 < high <= 18  # a few steps ahead, not a guessed 110
    log_metrics(dash, 20, start=10)
    dash.tick(force=True)
    assert curve_of(dash).xlim[1] <= 29 * 1.5 + 1  # grows with the run, never to 100+
    dash(RunEnded(RunState.SUCCEEDED, None, 3.0, 3.0))
    dash.tick()
    assert curve_of(dash).xlim == (0.0, 29.0)  # the final frame fits the steps logged
    low, high = curve_of(dash).ylim
    assert 10.0 / 30 - 0.6 < low < 10.0 / 30 and 10.0 < high < 10.6  # 5 % padding


def test_a_known_total_fixes_the_axis_while_running() -> None:
    dash = dashboard()
    dash(LogLine(0, "train:  10%|#         | 3/30 [00:01<00:09,  3.00it/s]", False, True, 0.0))
    log_metrics(dash, 3)
    dash.tick(force=True)
    assert curve_of(dash).xlim == (0.0, 30.0)
    dash(Metric(0, 3, {"total_steps": 50}, 1.0))  # a total_steps metric wins over the bar
    log_metrics(dash, 1, start=4)
    dash.tick(force=True)
    assert curve_of(dash).xlim == (0.0, 50.0)


def test_the_curve_redraws_its_axes_only_a_few_times_without_a_total() -> None:
    plot = CurvePlot()
    steps: list[int] = []
    values: list[float] = []
    for step in range(1000):
        steps.append(step)
        values.append(1.0)
        plot.render("loss", steps, values)
    assert plot.full_draws <= 12  # ~log_1.5(1000 / 8) + 1, not one per step


# ----- the log box ------------------------------------------------------------------------------
def box_height(value: str) -> str:
    return value.split("height:", 1)[1].split(";", 1)[0]


def test_the_log_box_is_as_tall_as_its_lines() -> None:
    dash = dashboard()
    dash(LogLine(0, "one line", False, False, 0.0))
    dash.tick(force=True)
    assert box_height(dash.log.value) == log_height(1) == "calc(15.6px + 10px)"
    for index in range(3):
        dash(LogLine(0, f"line {index}", False, False, 0.0))
    dash.tick(force=True)
    assert box_height(dash.log.value) == log_height(4)
    for index in range(300):
        dash(LogLine(0, f"more {index}", False, False, 0.0))
    dash.tick(force=True)
    assert box_height(dash.log.value) == log_height(LOG_MAX_LINES)  # then it scrolls
    assert "overflow:auto" in dash.log.value


# ----- memory after the end ----------------------------------------------------------------
def test_after_the_end_the_bars_show_the_peak_and_the_text_the_last_reading() -> None:
    dash = dashboard()
    limit = 16 * 2**30
    dash.post_memory([MemoryReading("rank 0 (cpu)", 280 * MiB, 290 * MiB, limit)])
    dash.tick(force=True)
    assert "280.0 MiB now" in dash.memory_text.value
    dash.post_memory([MemoryReading("rank 0 (cpu)", None, None, limit)])  # the worker ended
    dash(RunEnded(RunState.SUCCEEDED, None, 3.0, 3.0))
    dash.tick()
    text = dash.memory_text.value
    assert "280.0 MiB last · 290.0 MiB peak (the bar)" in text, text
    assert "0 B" not in text and "n/a" not in text
    bars = plots_of(dash)[1]
    assert bars._bars[0].get_width() == pytest.approx(290.0)  # MiB: the peak, not 0
    assert bars.texts == ["peak 290.0 MiB"]
    assert "290.0 MiB peak, 280.0 MiB last" in dash.summary_text


def test_a_zombie_worker_reads_na_not_zero() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the child did not exit within 30 s"
            time.sleep(0.01)
        [reading] = ProcessMemory(lambda: {0: child.pid}).read()
        assert reading.current is None  # not 0 B: it is no reading of the run
    finally:
        child.wait(10)


# ----- what each memory number covers --------------------------------------------------------
def test_the_text_says_what_rss_and_the_estimate_cover() -> None:
    from nbaccel.hardware.memory_estimate import estimate_for_config

    reading = MemoryReading("rank 0 (cpu)", 281 * MiB, 290 * MiB, 2**34, baseline=250 * MiB)
    estimate = estimate_for_config(Config(num_processes=2), 131_841)
    text = memory_html([reading], estimate=estimate)
    assert "RSS = the whole worker process" in text
    assert "A bare worker (Python + torch, before the function) holds 250.0 MiB" in text
    assert "the run adds 40.0 MiB at its peak" in text
    assert "model states only (not activations, not the runtime): 2.51 MiB per device" in text
    gpu = MemoryReading("cuda:0 (GPU 0)", 2**30, 2**30, 2**34)
    assert "whole device" in covers_text([gpu], None)


def test_the_bare_worker_is_a_workers_rss_as_it_reports_itself_started() -> None:
    # A stand-in worker that grows by 64 MiB after it started (as a run's model would).
    script = (
        "import sys, time; print('ready', flush=True); sys.stdin.readline(); "
        "b = bytearray(64 << 20); time.sleep(60)"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline() == b"ready\n"  # the interpreter is up: a bare worker
        source = ProcessMemory(lambda: {0: worker.pid})
        at_start = psutil.Process(worker.pid).memory_info().rss
        source.worker_started(worker.pid)  # what the dashboard does on WorkerStarted
        assert worker.stdin is not None
        worker.stdin.write(b"go\n")
        worker.stdin.flush()
        process = psutil.Process(worker.pid)
        deadline = time.monotonic() + 30
        while process.memory_info().rss < at_start + 60 * MiB:
            assert time.monotonic() < deadline, "the stand-in worker did not grow in 30 s"
            time.sleep(0.01)
        [reading] = source.read()
        assert reading.baseline == pytest.approx(at_start, abs=2 * MiB)  # not the later RSS
        assert reading.current is not None and reading.current >= at_start + 60 * MiB
        assert reading.peak is not None and reading.peak - at_start > 60 * MiB
        text = covers_text([reading], None)
        added = size_text(reading.peak - reading.baseline)  # ~64 MiB above the bare worker
        assert f"holds {size_text(reading.baseline)}; the run adds {added} at its peak" in text
    finally:
        worker.kill()
        worker.wait(10)


# ----- compare runs -----------------------------------------------------------------------------
def write_run(runs_dir: Path, run_id: str, losses: list[float]) -> Path:
    run_dir = runs_dir / run_id
    run_dir.mkdir(parents=True)
    records = [{"time": 0.0, "event": "started", "rank": 0}]
    records += [
        {"time": 0.0, "event": "metric", "rank": rank, "step": step, "values": {"loss": loss}}
        for step, loss in enumerate(losses)
        for rank in (0, 1)
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_a_runs_dir_of_many_runs_costs_a_listing_not_a_look_into_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for day in range(1, 29):
        for hour in range(10):  # 280 earlier runs
            write_run(tmp_path, f"202601{day:02d}-{hour:02d}0000-aaaaaa", [1.0])
    current = tmp_path / "20270101-000000-cccccc"
    looked: list[Path] = []
    original = Path.is_file

    def counted(path: Path) -> bool:
        looked.append(path)
        return original(path)

    monkeypatch.setattr(Path, "is_file", counted)
    listed = earlier_runs(current, limit=5)
    assert listed[0] == "20260128-090000-aaaaaa" and len(listed) == 5
    assert len(looked) == 5  # the newest five, not all 280


def test_earlier_runs_are_listed_newest_first_and_overlaid(tmp_path: Path) -> None:
    write_run(tmp_path, "20260101-000000-aaaaaa", [4.0, 3.0, 2.0])
    write_run(tmp_path, "20260102-000000-bbbbbb", [5.0, 4.0, 3.0, 2.0, 1.5, 1.0])
    (tmp_path / "20260102-120000-nolog").mkdir()  # no events.jsonl: not a run to compare
    current = tmp_path / "20260103-000000-cccccc"
    current.mkdir()
    write_run(tmp_path, "20260104-000000-later", [1.0])  # started after this one
    assert earlier_runs(current) == ["20260102-000000-bbbbbb", "20260101-000000-aaaaaa"]

    dash = dashboard(current)
    log_metrics(dash, 3)
    dash.tick(force=True)
    assert dash.compare.options == ("20260102-000000-bbbbbb", "20260101-000000-aaaaaa")
    assert dash.compare.layout.display is None and dash.compare.rows == 2
    assert dash.curve_legend.value == ""
    dash.compare.value = ("20260102-000000-bbbbbb",)  # what a pick in the browser does
    dash.tick(force=True)
    legend = dash.curve_legend.value
    assert "20260103-000000-cccccc (this run)" in legend and "20260102-000000-bbbbbb" in legend
    plot = curve_of(dash)
    assert [line.get_label() for line in plot._overlay_lines] == ["20260102-000000-bbbbbb"]
    assert list(plot._overlay_lines[0].get_xdata()) == [0, 1, 2, 3, 4, 5]  # rank 0 only
    assert plot.xlim[1] >= 5  # the axes hold the earlier run too
    assert plot.ylim[1] > 5.0


def test_a_pick_after_the_run_ended_redraws_at_once(tmp_path: Path) -> None:
    write_run(tmp_path, "20260101-000000-aaaaaa", [4.0, 3.0, 2.0, 1.0])
    dash = dashboard(tmp_path / "20260103-000000-cccccc")
    (tmp_path / "20260103-000000-cccccc").mkdir()
    log_metrics(dash, 3)
    dash(RunEnded(RunState.SUCCEEDED, None, 3.0, 3.0))
    dash.tick()
    assert dash.wait_finished(0)  # the UI's work is over: nothing else would draw
    before = dash.curve.value
    dash.compare.value = ("20260101-000000-aaaaaa",)
    assert dash.curve.value != before
    assert "20260101-000000-aaaaaa" in dash.curve_legend.value
    assert curve_of(dash).xlim == (0.0, 3.0)  # final: fitted to both runs' steps


def test_a_run_without_the_metric_or_unreadable_says_so(tmp_path: Path) -> None:
    write_run(tmp_path, "r1", [1.0])
    bad = tmp_path / "r2"
    bad.mkdir()
    (bad / "events.jsonl").write_text('{"event": "metric", broken\n')
    runs = EarlierRuns(tmp_path / "r3")
    runs.pick(["r1", "r2"])
    assert runs.overlays("accuracy") == []
    legend = runs.legend_html("accuracy", "r3")
    assert "r1 (no accuracy)" in legend and "r2 (unreadable:" in legend


def test_listing_earlier_runs_costs_little_with_many_runs(tmp_path: Path) -> None:
    for index in range(200):
        write_run(tmp_path, f"20260101-{index:06d}-aaaaaa", [1.0])
    current = tmp_path / "20270101-000000-zzzzzz"
    started = time.perf_counter()
    listed: Any = earlier_runs(current)
    elapsed = time.perf_counter() - started
    assert len(listed) == 20 and listed[0] == "20260101-000199-aaaaaa"
    assert elapsed < 0.5  # ~5 ms measured for 200 runs: 100x headroom on a loaded machine
