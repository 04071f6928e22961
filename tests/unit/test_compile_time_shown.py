"""The time the ranks spent in torch.compile, as the step-time breakdown carries it: sent
with each window, recorded, read back, and said by the step-time line and the dashboard."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import nbaccel
from nbaccel.config.files import as_nested
from nbaccel.events import RunEnded, StepBreakdown
from nbaccel.launcher.detached.attached import AttachedRun
from nbaccel.launcher.printer import TextPrinter
from nbaccel.step_board import StepBoard
from nbaccel.ui.dashboard.step_panel import StepPanel


def window(rank: int, compiling: float) -> StepBreakdown:
    return StepBreakdown(
        rank, 4, {"forward": 0.01, "backward": 0.02}, 32, None, None, 1.0, compiling
    )


def test_the_step_time_line_says_the_longest_ranks_compile() -> None:
    board = StepBoard()
    for rank, compiling in ((0, 12.0), (1, 30.0), (0, 31.24), (1, 30.5)):
        board.add(window(rank, compiling))
    assert board.compile_seconds() == 31.24  # rank 0's latest running total
    assert board.summary().endswith("; compile 31.2 s")
    assert board.total(0).compile_seconds == 31.24
    assert board.recent(1).compile_seconds == 30.5


def test_without_a_compile_nothing_is_said() -> None:
    board = StepBoard()
    board.add(window(0, 0.0))
    assert board.compile_seconds() == 0.0
    assert "compile" not in board.summary()
    panel = StepPanel()
    panel.handle(window(0, 0.0))
    assert "compile" not in panel.html()


def test_the_printed_step_time_line_at_the_end_has_it() -> None:
    out = io.StringIO()
    printer = TextPrinter(out, None, announce_end=False)
    printer(window(0, 31.24))
    printer(RunEnded(nbaccel.RunState.SUCCEEDED, None, 40.0, 2.0))
    (line,) = out.getvalue().splitlines()
    assert line.startswith("nbaccel: step time: step 7.5 ms")
    assert line.endswith("; compile 31.2 s")


def test_the_dashboards_step_time_area_has_it() -> None:
    panel = StepPanel()
    panel.handle(window(0, 31.24))
    assert '<span class="nbaccel-steps-compile">compile 31.2 s</span>' in panel.html()
    assert panel.summary().endswith("compile 31.2 s")


def test_events_of_older_workers_load_as_no_compile() -> None:
    # A window pickled by a worker that predates the field has no compile_seconds in its
    # state: unpickled here it reads as 0.0 (the dataclass's default).
    old = window(0, 5.0)
    object.__delattr__(old, "compile_seconds")
    back = pickle.loads(pickle.dumps(old))
    assert back.compile_seconds == 0.0
    StepBoard().add(back)


def test_a_detached_runs_folder_gives_it_back(tmp_path: Path) -> None:
    run_dir = tmp_path / "20261129-000000-abcdef"
    run_dir.mkdir()
    config = nbaccel.Config(num_processes=1, detach=True)
    (run_dir / "config.json").write_text(json.dumps({"config": as_nested(config), "sources": {}}))
    supervisor = {"pid": 2**22 + 3, "address": "\0nbaccel-attach-gone", "started": 1.0}
    (run_dir / "supervisor.json").write_text(json.dumps({**supervisor, "world_size": 1}))
    (run_dir / "rank0.log").write_bytes(b"")
    fields = {"steps": 4, "samples": 32, "phases": {"forward": 0.1}, "tokens": None}
    lines = [
        {"time": 2.0, "event": "step_breakdown", "rank": 0, **fields, "peak_memory": None},
        {"time": 3.0, "event": "step_breakdown", "rank": 0, **fields, "peak_memory": None}
        | {"compile_seconds": 31.24},
        {"time": 4.0, "event": "ended", "state": "succeeded"},
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = AttachedRun(run_dir)
    seen: list[object] = []
    run.subscribe(seen.append)
    run.connect()  # no supervisor answers: the folder tells
    windows = [e for e in seen if isinstance(e, StepBreakdown)]
    assert [w.compile_seconds for w in windows] == [0.0, 31.24]  # the first: an older record
