"""A detached sweep in a real ipykernel: the cell that starts it shows its board, which
follows the supervisor's state file to the end and leaves its summary; ``nbaccel.attach``
of the sweep's id shows a board of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from jupyter_client import BlockingKernelClient, KernelManager

from tests.notebook.test_interactive_magic import expression, run_cell

pytestmark = pytest.mark.timeout(300)

START = """
import nbaccel

def trial(config):
    import nbaccel
    for step in range(3):
        nbaccel.log_metrics({{"loss": config["lr"] * (3 - step)}}, step=step)
    return config["lr"]

sweep = nbaccel.sweep(
    trial, [{{"lr": 0.1}}, {{"lr": 0.2}}], metric="loss", detach=True, use_cpu=True,
    runs_dir={runs!r},
)
"""


def test_a_detached_sweep_shows_its_board_live_here_and_when_attached(
    kernel: tuple[KernelManager, BlockingKernelClient], tmp_path: Path
) -> None:
    _, kc = kernel
    runs = str(tmp_path / "runs")
    reply, text = run_cell(kc, START.format(runs=runs), board="type(sweep.board).__name__")
    assert reply["status"] == "ok", text
    assert "runs detached" in text
    assert expression(reply, "board") == "'SweepBoard'"

    reply, text = run_cell(
        kc,
        "sweep.wait(120); finished = sweep.board.wait_finished(30)",
        finished="finished",
        closed="sweep.board.closed",
        states="[t.state for t in sweep.trials]",
        summary="sweep.board.summary_text",
    )
    assert reply["status"] == "ok", text
    assert expression(reply, "finished") == "True"  # the follower's last call: the summary
    assert expression(reply, "closed") == "True"
    assert expression(reply, "states") == "['succeeded', 'succeeded']"
    assert "succeeded" in expression(reply, "summary")

    # From any kernel (here the same one), attach shows the sweep, already ended: its
    # board goes straight to the summary.
    reply, text = run_cell(
        kc,
        f"again = nbaccel.attach(sweep.sweep_id, runs_dir={runs!r})\n"
        "finished = again.board.wait_finished(30)",
        finished="finished",
        best="again.best['config']",
    )
    assert reply["status"] == "ok", text
    assert expression(reply, "finished") == "True"
    assert expression(reply, "best") == "{'lr': 0.1}"


@pytest.mark.parametrize("how", ["detach=True", "wait=False"])
def test_the_saved_notebook_keeps_the_summary_of_a_sweep_that_ends_after_its_cell(
    cells: Any, kernel_dirs: Path, tmp_path: Path, how: str
) -> None:
    # The board's summary replaces it by display id once the sweep ends, by then under a
    # later cell: what nbclient saves (as a frontend shows) must have it in the first cell.
    start = START.format(runs=str(tmp_path / "runs")).replace("detach=True", how)
    nb = cells.notebook([("start", start), ("wait", "sweep.wait(120)\nlen(sweep.trials)")])
    cells.execute(nb, tmp_path)
    first = cells.cell(nb, "start")
    cells.assert_ok(first)
    html = [o.data["text/html"] for o in first.outputs if "text/html" in o.get("data", {})]
    assert len(html) == 1 and "2 trials: 2 succeeded" in html[0], first.outputs
    assert any("image/png" in o.get("data", {}) for o in first.outputs)
