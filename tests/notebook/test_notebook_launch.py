"""notebook_launcher in a real ipykernel, driven by nbclient: what a notebook user sees.

These tests read the text a launch streams into the cell, so their launches ask for
``dashboard="text"`` (``OUT``); the widget dashboard has its own tests
(tests/unit/ui/dashboard/test_dashboard.py, the example notebooks, the browser test).

One notebook is executed once per module (a kernel start and the helper's ``import torch``
are the slow part); each test asserts on its own cells. Errors are allowed at execution so
that every test reports on its cells even when another cell failed.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from nbclient import NotebookClient
from nbformat import NotebookNode
from traitlets import Unicode

pytestmark = pytest.mark.timeout(300)


def _src(text: str) -> str:
    return textwrap.dedent(text).strip()


def _notebook(cells: Any, runs_dir: Path) -> NotebookNode:
    return cells.notebook(
        [
            ("kernel", "import os, sys\nsys.prefix, sys.executable"),
            (
                "setup",
                _src(f"""
                import nbaccel

                RUNS = {str(runs_dir)!r}
                OUT = {{"runs_dir": RUNS, "dashboard": "text"}}
                SCALE = 3


                def scaled(value):
                    return value * SCALE


                def make_offset(k):
                    def offset(value):
                        return value + k

                    return offset


                OFFSET = make_offset(0.5)
                "torch" in sys.modules
                """),
            ),
            (
                "train",
                _src("""
                def train(x):
                    import torch
                    import torch.distributed as dist

                    rank = dist.get_rank()
                    t = torch.tensor([float(rank + 1)])
                    dist.all_reduce(t)
                    print(f"rank {rank} sum {t.item()}")
                    return OFFSET(scaled(t.item() * x)) + 100 * rank
                """),
            ),
            (
                "launch",
                "nbaccel.notebook_launcher(train, args=(2,), num_processes=2, **OUT)",
            ),
            (
                "launch-all",
                _src("""
                nbaccel.notebook_launcher(
                    train, args=(2,), num_processes=2, **OUT, log_ranks="all"
                )
                """),
            ),
            (
                "launch-run",
                _src("""
                run = nbaccel.launch(train, args=(2,), num_processes=2, **OUT)
                run.wait(timeout=120)
                (
                    run.results(),
                    os.path.dirname(run.run_dir) == os.path.realpath(RUNS),
                    run.logs(1).strip(),
                )
                """),
            ),
            (
                "fail-def",
                _src("""
                def fail_on_rank_1():
                    import torch.distributed as dist

                    if dist.get_rank() == 1:
                        raise ValueError("boom from the cell")
                    return "rank 0 finished"
                """),
            ),
            (
                "fail",
                "nbaccel.notebook_launcher(fail_on_rank_1, num_processes=2, **OUT)",
                ["raises-exception"],
            ),
            (
                "unsendable",
                _src("""
                import threading

                LOCK = threading.Lock()


                def holds_the_lock():
                    with LOCK:
                        pass


                nbaccel.notebook_launcher(holds_the_lock, num_processes=2, **OUT)
                """),
                ["raises-exception"],
            ),
            (
                "exits",
                _src("""
                def leaves_on_rank_1():
                    import os

                    import torch.distributed as dist

                    dist.barrier()
                    if dist.get_rank() == 1:
                        print("rank 1 leaves: the disk is full", flush=True)
                        os._exit(3)
                    dist.barrier()


                nbaccel.notebook_launcher(leaves_on_rank_1, num_processes=2, **OUT)
                """),
                ["raises-exception"],
            ),
            (
                "read-the-log",
                _src("""
                import pathlib
                import re

                # What the error says to type, as a user copies it from the message.
                said = str(sys.last_value)
                exec(re.search(r"print\\(open\\(.+?\\)\\.read\\(\\)\\)", said)[0])
                sys.last_value.run_dir.parent == pathlib.Path(RUNS).resolve()
                """),
            ),
            (
                "after-fail",
                "nbaccel.notebook_launcher(train, args=(1,), num_processes=2, **OUT)",
            ),
            (
                "progress",
                _src("""
                def progress():
                    import torch.distributed as dist
                    from tqdm import tqdm

                    total = 0
                    for i in tqdm(range(5), mininterval=0, ascii=True,
                                  disable=dist.get_rank() != 0):
                        total += i
                    return total


                nbaccel.notebook_launcher(progress, num_processes=2, **OUT)
                """),
            ),
            (
                "widgets-one",
                _src("""
                from ipywidgets.widgets import widget as widget_module

                BEFORE = len(widget_module._instances)
                # At once: these runs end before the default dashboard_after.
                WIDGETS = {"runs_dir": RUNS, "dashboard": True, "dashboard_after": 0}
                nbaccel.notebook_launcher(train, args=(2,), num_processes=2, **WIDGETS)
                ONE = len(widget_module._instances) - BEFORE
                ONE
                """),
            ),
            (
                "widgets-loop",
                _src("""
                START = len(widget_module._instances)
                for _ in range(10):
                    nbaccel.notebook_launcher(train, args=(2,), num_processes=2, **WIDGETS)
                len(widget_module._instances) - START
                """),
            ),
            (
                "widgets-short",
                _src("""
                BEFORE = len(widget_module._instances)
                nbaccel.notebook_launcher(
                    train, args=(2,), num_processes=2, runs_dir=RUNS, dashboard=True,
                    dashboard_after=60,  # the run surely ends first
                )
                len(widget_module._instances) - BEFORE
                """),
            ),
            (
                "widgets-later",
                _src("""
                def goes_on(seconds):
                    import time

                    print("started")
                    time.sleep(seconds)  # a run 20x as long as dashboard_after
                    return "done"


                nbaccel.notebook_launcher(
                    goes_on, args=(1.0,), num_processes=2, runs_dir=RUNS, dashboard=True,
                    dashboard_after=0.05,
                )
                """),
            ),
            ("torch-free", '"torch" in sys.modules'),
        ]
    )


@pytest.fixture(scope="module")
def executed(
    cells: Any, kernel_dirs: Path, tmp_path_factory: pytest.TempPathFactory
) -> NotebookNode:
    work = tmp_path_factory.mktemp("nb-launch")
    nb = _notebook(cells, work / "runs")
    return cells.execute(nb, work, allow_errors=True)


def test_kernel_is_this_venv(executed: NotebookNode, cells: Any) -> None:
    cell = cells.cell(executed, "kernel")
    cells.assert_ok(cell)
    # jupyter_client runs the native kernelspec's "python" as sys.executable: this venv.
    assert cells.result(cell) == repr((sys.prefix, sys.executable))


def test_rank0_output_streams_into_the_cell_and_its_value_returns(
    executed: NotebookNode, cells: Any
) -> None:
    setup, launch = cells.cell(executed, "setup"), cells.cell(executed, "launch")
    cells.assert_ok(setup)
    assert cells.result(setup) == "False", "importing nbaccel imported torch in the kernel"
    cells.assert_ok(launch)
    # all_reduce of 1 + 2 = 3; then the notebook global SCALE and the closure OFFSET apply;
    # rank 1 would have returned 118.5.
    assert cells.result(launch) == "18.5"
    lines = cells.stream(launch).splitlines()
    assert "rank 0 sum 3.0" in lines
    assert not any("rank 1" in line for line in lines), "rank 1 shown with log_ranks='0'"


def test_log_ranks_all_labels_other_ranks(executed: NotebookNode, cells: Any) -> None:
    cell = cells.cell(executed, "launch-all")
    cells.assert_ok(cell)
    assert cells.result(cell) == "18.5"
    lines = cells.stream(cell).splitlines()
    assert "rank 0 sum 3.0" in lines
    assert "[rank 1] rank 1 sum 3.0" in lines


def test_launch_returns_a_run_with_every_rank_and_its_logs(
    executed: NotebookNode, cells: Any
) -> None:
    cell = cells.cell(executed, "launch-run")
    cells.assert_ok(cell)
    assert cells.result(cell) == "({0: 18.5, 1: 118.5}, True, 'rank 1 sum 3.0')"


def test_failing_rank_raises_its_exception_with_the_cell_source(
    executed: NotebookNode, cells: Any
) -> None:
    cell = cells.cell(executed, "fail")
    [error] = cells.errors(cell)
    assert error.ename == "ValueError"
    assert error.evalue.startswith("[rank 1] ")
    assert "boom from the cell" in error.evalue
    text = cells.strip_ansi("\n".join(error.traceback))
    assert "Traceback from rank 1" in text, text
    remote = text[text.index("Traceback from rank 1") :]
    # The worker's frame in the cell-defined function, with the cell's own source line: the
    # cell's source only exists in the kernel's linecache, so it must travel to the workers.
    assert "in fail_on_rank_1" in remote, text
    assert 'raise ValueError("boom from the cell")' in remote, text


def test_errors_show_the_cells_frames_not_nbaccels(executed: NotebookNode, cells: Any) -> None:
    # A SerializationError showed ~12 frames of nbaccel and its pickler, a worker's error
    # 3 (issue 39, item 18): the cell's frame and the message say what is wrong.
    [error] = cells.errors(cells.cell(executed, "unsendable"))
    assert error.ename == "SerializationError"
    assert "'LOCK'" in error.evalue
    text = cells.strip_ansi("\n".join(error.traceback))
    assert "/nbaccel/" not in text, text
    [error] = cells.errors(cells.cell(executed, "fail"))
    local = cells.strip_ansi("\n".join(error.traceback)).split("Traceback from rank 1")[-1]
    assert "/nbaccel/" not in local, local  # the kernel's side, after the worker's traceback


def test_a_ranks_exit_says_how_to_read_its_log_from_the_cell(
    executed: NotebookNode, cells: Any
) -> None:
    # notebook_launcher's caller has no run: "see run.logs(1)" was nothing to type (issue 39,
    # item 17). The error names the log in the run folder and a line that reads it.
    [error] = cells.errors(cells.cell(executed, "exits"))
    assert error.ename == "WorkerError"
    assert "rank 1 exited with code 3" in error.evalue
    assert "print(open(" in error.evalue and "rank1.log" in error.evalue, error.evalue
    cell = cells.cell(executed, "read-the-log")
    cells.assert_ok(cell)
    assert "rank 1 leaves: the disk is full" in cells.stream(cell)
    assert cells.result(cell) == "True"  # error.run_dir is the run's folder under RUNS


def test_next_launch_after_a_failure_works(executed: NotebookNode, cells: Any) -> None:
    cell = cells.cell(executed, "after-fail")
    cells.assert_ok(cell)
    assert cells.result(cell) == "9.5"


def test_progress_bar_reaches_its_end_on_one_line(executed: NotebookNode, cells: Any) -> None:
    cell = cells.cell(executed, "progress")
    cells.assert_ok(cell)
    assert cells.result(cell) == "10"
    text = cells.stream(cell)
    assert "5/5" in text, repr(text)
    # tqdm redraws with "\r": the cell shows one bar line, at its final state.
    bars = [line for line in cells.screen_lines(text) if "/5" in line]
    assert len(bars) == 1, repr(text)
    assert "100%" in bars[0] and "5/5" in bars[0], repr(text)


def test_kernel_never_imports_torch(executed: NotebookNode, cells: Any) -> None:
    cell = cells.cell(executed, "torch-free")
    cells.assert_ok(cell)
    assert cells.result(cell) == "False"


class _GoWhenShown(NotebookClient):  # type: ignore[misc]
    """Creates ``go_file`` as soon as the kernel sends the line "waiting for go"."""

    go_file = Unicode("")

    def output(self, outs: list[NotebookNode], msg: dict[str, Any], *args: Any) -> Any:
        out = super().output(outs, msg, *args)
        if msg["msg_type"] == "stream" and "waiting for go" in msg["content"]["text"]:
            Path(self.go_file).touch()
        return out


@pytest.mark.timeout(300)
def test_output_is_streamed_while_the_ranks_still_run(
    cells: Any, kernel_dirs: Path, tmp_path: Path
) -> None:
    # Rank 0 prints, then waits until the test has seen that line arrive in the notebook:
    # output that only showed up when the run ended would make rank 0 time out.
    go_file = tmp_path / "go"
    nb = cells.notebook(
        [
            (
                "wait",
                _src(f"""
                import nbaccel


                def wait_for_go(go_file):
                    import os
                    import time

                    import torch.distributed as dist

                    if dist.get_rank() == 0:
                        print("waiting for go", flush=True)
                        deadline = time.monotonic() + 60
                        while not os.path.exists(go_file):
                            if time.monotonic() > deadline:
                                raise TimeoutError("the line never reached the notebook")
                            time.sleep(0.02)
                    dist.barrier()
                    return "went"


                nbaccel.notebook_launcher(
                    wait_for_go, args=({str(go_file)!r},), num_processes=2,
                    runs_dir={str(tmp_path / "runs")!r}, dashboard="text",
                )
                """),
            )
        ]
    )
    cells.execute(nb, tmp_path, client_class=_GoWhenShown, go_file=str(go_file))
    cell = cells.cell(nb, "wait")
    cells.assert_ok(cell)
    assert cells.result(cell) == "'went'"
    assert go_file.exists()


def test_launches_in_a_loop_do_not_pile_up_widgets(executed: NotebookNode, cells: Any) -> None:
    # Each dashboard is ~40 widgets (parts, containers, layouts, styles) that ipywidgets
    # keeps until closed; a newer launch from the same cell closes the previous dashboard
    # (its static summary stays in the cell).
    one, loop = cells.cell(executed, "widgets-one"), cells.cell(executed, "widgets-loop")
    cells.assert_ok(one)
    cells.assert_ok(loop)
    per_dashboard = int(cells.result(one))
    assert per_dashboard >= 20
    assert int(cells.result(loop)) == per_dashboard  # the loop's last dashboard, not ten


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _display_outputs(cell: NotebookNode) -> list[dict[str, Any]]:
    return [dict(out.data) for out in cell.outputs if out.output_type == "display_data"]


def test_a_run_shorter_than_dashboard_after_shows_only_its_summary(
    executed: NotebookNode, cells: Any
) -> None:
    short = cells.cell(executed, "widgets-short")
    cells.assert_ok(short)
    assert int(cells.result(short)) == 0  # not one widget model was made
    shown = _display_outputs(short)
    assert not [data for data in shown if WIDGET_VIEW in data], shown
    summary = [data["text/plain"] for data in shown if data.get("text/plain", "").startswith(
        "nbaccel run ")]  # fmt: skip
    assert len(summary) == 1 and "succeeded" in summary[0], shown
    assert "rank 0 sum 3.0" in summary[0]  # the log's tail, as the widgets would have shown


def test_a_run_that_goes_on_fills_the_place_kept_for_its_widgets(
    executed: NotebookNode, cells: Any
) -> None:
    later = cells.cell(executed, "widgets-later")
    cells.assert_ok(later)
    assert cells.result(later) == "'done'"
    shown = _display_outputs(later)
    # The first output (kept empty at the start) now holds the dashboard, above the summary.
    assert WIDGET_VIEW in shown[0], shown
    state = executed.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    root = state[shown[0][WIDGET_VIEW]["model_id"]]["state"]
    assert "nbaccel-dashboard" in root["_dom_classes"]
    logs = [m["state"].get("value", "") for m in state.values()
            if "nbaccel-log" in m["state"].get("_dom_classes", [])]  # fmt: skip
    assert any("started" in str(log) for log in logs), logs
    assert any(data.get("text/plain", "").startswith("nbaccel run ") for data in shown[1:])
