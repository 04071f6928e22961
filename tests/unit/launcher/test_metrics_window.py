"""run.metrics keeps a bounded window in memory and reads the rest back from events.jsonl."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nbaccel.config.schema import Config
from nbaccel.events import Metric
from nbaccel.launcher.pump import RankPipes
from nbaccel.launcher.run import Run
from nbaccel.launcher.run_folder import private_file


def logged(run: Run, rank: int, step: int, values: dict[str, float]) -> None:
    """What the pump does with a worker's metric message."""
    pipes = RankPipes(rank, log_file=None, log_fd=-1, event_fd=-1)
    run._on_worker_message(pipes, Metric(rank, step, values, 0.0))


def test_a_long_run_keeps_a_window_and_still_returns_every_metric(tmp_path: Path) -> None:
    run = Run("r", tmp_path, Config(metrics_in_memory=5), world_size=2)
    run._events_file = private_file(tmp_path / "events.jsonl", "a")
    expected = []
    for step in range(12):
        # Names that events.jsonl's own fields use must survive the round trip.
        values = {"loss": 1 / (step + 1), "rank": 0.0, "step": -1.0, "time": 9.0}
        logged(run, 0, step, values)
        logged(run, 1, step, {"loss": 5.0})
        expected.append({**values, "step": step})
        assert run.metrics == expected  # while running: flushed and read back
        assert len(run._metrics) == min(step + 1, 5)
    run._events_file.close()
    run._events_file = None
    assert run.metrics == expected  # after the run: from the file


def test_within_the_window_nothing_is_read_from_disk(tmp_path: Path) -> None:
    run = Run("r", tmp_path, Config(), world_size=1)
    run._events_file = private_file(tmp_path / "events.jsonl", "a")
    logged(run, 0, 0, {"loss": 1.0})
    (tmp_path / "events.jsonl").unlink()  # would fail a read
    assert run.metrics == [{"loss": 1.0, "step": 0}]
    run._events_file.close()


def test_a_zero_window_keeps_nothing_in_memory(tmp_path: Path) -> None:
    run = Run("r", tmp_path, Config(metrics_in_memory=0), world_size=1)
    run._events_file = private_file(tmp_path / "events.jsonl", "a")
    for step in range(3):
        logged(run, 0, step, {"loss": float(step)})
    assert len(run._metrics) == 0
    assert [m["loss"] for m in run.metrics] == [0.0, 1.0, 2.0]
    run._events_file.close()


def test_a_worker_cannot_speak_for_another_rank(tmp_path: Path) -> None:
    # The pipe a message came on says whose it is, whatever rank the message names.
    run = Run("r", tmp_path, Config(), world_size=2)
    run._events_file = private_file(tmp_path / "events.jsonl", "a")
    seen: list[Any] = []
    run.subscribe(seen.append)
    pipes = RankPipes(1, log_file=None, log_fd=-1, event_fd=-1)
    run._on_worker_message(pipes, Metric(0, 7, {"loss": 1.0}, 0.0))  # claims rank 0
    run._on_worker_message(pipes, {"kind": "metric", "step": 8})  # not nbaccel's: ignored
    assert [(e.rank, e.step) for e in seen] == [(1, 7)]
    assert run.metrics == []  # rank 0's curve is rank 0's alone


def test_a_run_that_is_never_started_holds_no_file_descriptor(tmp_path: Path) -> None:
    # An error between the Run and its start (a host that fails, a display that raises)
    # leaves nothing open; an attached run never starts one: its events come to it.
    before = set(os.listdir("/proc/self/fd"))
    runs = [Run("r", tmp_path, Config(), world_size=2) for _ in range(3)]
    assert set(os.listdir("/proc/self/fd")) == before
    assert all(run._wake_read == run._wake_write == -1 for run in runs)


def test_a_wait_said_after_a_worker_started_is_not_shown(tmp_path: Path) -> None:
    # The starter's "waiting" comes on the helper's channel, a worker's start on its own
    # pipe: read in the other order, the dashboard said "starting: the helper imports ..."
    # for the whole run (seen in the browser test at step 70, 500 steps/s).
    from nbaccel.events import Waiting, WorkerStarted

    run = Run("r", tmp_path, Config(), world_size=2)
    run._events_file = private_file(tmp_path / "events.jsonl", "a")
    shown: list[Any] = []
    run.subscribe(shown.append)
    run._ranks = {rank: RankPipes(rank, log_file=None, log_fd=-1, event_fd=-1) for rank in (0, 1)}
    run._handle({"op": "waiting", "text": "the helper imports torch"}, selector=None)  # type: ignore[arg-type]
    run._on_worker_message(run._ranks[0], WorkerStarted(0, os.getpid(), 0.0))
    run._handle({"op": "waiting", "text": "the helper imports yaml first"}, selector=None)  # type: ignore[arg-type]
    assert [e.text for e in shown if isinstance(e, Waiting)] == ["the helper imports torch"]
    run._events_file.close()
    recorded = (tmp_path / "events.jsonl").read_text()
    assert "the helper imports yaml first" in recorded  # the run folder keeps what was said
