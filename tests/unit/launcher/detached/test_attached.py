"""A detached run read back from its folder, and the supervisor's bounded replay."""

from __future__ import annotations

import json
from pathlib import Path

import nbaccel
from nbaccel.config.files import as_nested
from nbaccel.events import LogLine, Metric, RunEnded, StepBreakdown
from nbaccel.launcher.detached.attach_server import LOG_LINES_KEPT, STEP_WINDOWS_KEPT, History
from nbaccel.launcher.detached.attached import AttachedRun


def window(rank: int, time: float) -> StepBreakdown:
    return StepBreakdown(rank, 4, {"forward": 0.1, "backward": 0.2}, 32, None, None, time)


def test_the_replay_is_bounded_and_ends_with_the_end() -> None:
    history = History()
    for i in range(100):
        history.add(window(i % 2, float(i)))
        history.add(LogLine(0, f"line {i}", False, False, float(i)))
    history.add(Metric(0, 1, {"loss": 1.0}, 1.0))
    history.add(RunEnded(nbaccel.RunState.SUCCEEDED, None, 1.0, 2.0))
    replay = history.replay()
    assert sum(isinstance(e, StepBreakdown) for e in replay) == 2 * STEP_WINDOWS_KEPT
    assert sum(isinstance(e, LogLine) for e in replay) == min(100, LOG_LINES_KEPT)
    assert isinstance(replay[-1], RunEnded)


def test_a_finished_run_is_read_back_from_its_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "20261125-000000-abcdef"
    run_dir.mkdir()
    config = nbaccel.Config(num_processes=2, detach=True)
    (run_dir / "config.json").write_text(json.dumps({"config": as_nested(config), "sources": {}}))
    record = {
        "pid": 2**22 + 3,
        "address": "\0nbaccel-attach-gone",
        "started": 100.0,
        "world_size": 2,
    }
    (run_dir / "supervisor.json").write_text(json.dumps(record))
    (run_dir / "rank0.log").write_bytes(b"hello\n")
    (run_dir / "rank1.log").write_bytes(b"")
    lines = [
        {"time": 101.0, "event": "metric", "rank": 0, "step": 0, "values": {"loss": 2.0}},
        {
            "time": 101.5,
            "event": "step_breakdown",
            "rank": 1,
            "steps": 4,
            "samples": 32,
            "phases": {"forward": 0.1},
            "tokens": None,
            "peak_memory": None,
        },
        {"time": 102.0, "event": "exited", "rank": 0, "exitcode": 0},
        {"time": 110.0, "event": "ended", "state": "succeeded"},
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run_dir / "result-rank0.pkl").write_bytes(__import__("pickle").dumps({"ok": 1}))
    run = AttachedRun(run_dir)
    seen: list[object] = []
    run.subscribe(seen.append)
    run.connect()  # no supervisor answers: the folder tells
    assert run.config == config and run.world_size == 2
    assert run.result(5) == {"ok": 1} and run.results(5) == {0: {"ok": 1}, 1: None}
    assert run.metrics == [{"loss": 2.0, "step": 0}] and run.exit_code == 0
    assert [type(e).__name__ for e in seen] == [
        "RunStarted",
        "Metric",
        "StepBreakdown",
        "RankExited",
        "LogLine",
        "RunEnded",
    ]
    ended = seen[-1]
    assert isinstance(ended, RunEnded) and ended.elapsed == 10.0


def test_a_run_whose_supervisor_vanished_is_failed_and_says_so(tmp_path: Path) -> None:
    run_dir = tmp_path / "lost"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(
        json.dumps({"config": as_nested(nbaccel.Config()), "sources": {}})
    )
    (run_dir / "supervisor.json").write_text(
        json.dumps({"pid": 2**22 + 5, "address": "\0gone", "started": 1.0, "world_size": 1})
    )
    (run_dir / "rank0.log").write_bytes(b"")
    run = AttachedRun(run_dir)
    run.connect()
    assert run.state is nbaccel.RunState.FAILED
    assert "ended before the run did" in str(run.error)
