"""A sweep's board in a real JupyterLab: a row per trial, every trial's loss in one plot, a
trial stopped from the browser, and the summary left in the cell.

A cell runs ``nbaccel.sweep(train, {"lr": [...]}, metric="loss", wait=False,
use_cpu=True)`` (the kernel stays free, so clicks reach it): four trials, three of them
short, one (lr=0.2) logging its loss until it is stopped (two minutes at most). Once the
board (``.nbaccel-sweep-board``, ``nbaccel/ui/sweep_board.py``) shows the short trials
succeeded, the long one running and the curves image, the test picks the long trial and
clicks "Stop trial". The board then gives way to its summary (``.nbaccel-sweep-summary``:
the table, and the curves as a PNG output). The next cell waits for the sweep and prints
``s.table``'s states (the stopped trial "stopped"); the summary is still in the sweep's
cell, and the saved notebook holds it (HTML table and PNG). Screenshots:
``browser-artifacts/test_sweep_board_stops_a_trial/`` (``running.png``: the board;
``ended.png``: the page).

A blocking sweep (``wait=True``, the default) keeps the kernel busy: its buttons are
disabled and say that interrupting the kernel stops it; the toolbar's ■ does, and the
running trial ends "cancelled" in the summary left in the cell.
"""

from __future__ import annotations

import json
import re
import textwrap
from typing import Any

import pytest

from .conftest import LabPage, wait_until
from .test_save_and_stop_in_jupyterlab import BROKEN, printed, run_cell

pytestmark = pytest.mark.timeout(300)

LONG = 0.2  # the trial that runs until stopped
SETUP = textwrap.dedent(f"""
    import json

    import nbaccel


    def train(config):
        import time

        import nbaccel

        steps = 10**6 if config["lr"] == {LONG} else 12
        deadline = time.monotonic() + 120  # never the test's wait: a failed test's bound
        step = 0
        for step in range(steps):
            nbaccel.log_metrics({{"loss": config["lr"] * 10 / (step + 1)}}, step=step)
            time.sleep(0.05)
            if time.monotonic() > deadline:
                break
        return step
    """).strip()
# Returns at once: the kernel stays free, so the clicks reach it.
LAUNCH = (
    's = nbaccel.sweep(train, {"lr": [0.1, 0.2, 0.3, 0.4]}, metric="loss", wait=False, '
    "use_cpu=True)"
)
CHECK = textwrap.dedent("""
    s.wait(60)
    print("ENDED " + json.dumps({
        "states": list(s.table["state"]), "best": s.best["config"], "repr": repr(s),
    }))
    """).strip()
ENDED_STATES = ["succeeded", "stopped", "succeeded", "succeeded"]


def board_of_second_cell(lab_page: LabPage, notebook: Any) -> tuple[Any, Any]:
    """Open ``notebook``, run its setup and its sweep cell; that cell's output area and the
    sweep board in it, once shown (60 s at most)."""
    lab_page.open(notebook)
    run_cell(lab_page, 0)
    run_cell(lab_page, 1)
    output = lab_page.cell(1).locator(".jp-OutputArea.jp-Cell-outputArea")
    board = output.locator(".nbaccel-sweep-board")
    lab_page.wait_for_output(1, board, 60)
    return output, board


def test_sweep_board_stops_a_trial(lab_page: LabPage) -> None:
    notebook = lab_page.lab.write_notebook("sweep_board.ipynb", [SETUP, LAUNCH, CHECK])
    output, board = board_of_second_cell(lab_page, notebook)
    lab_page.mark("board")
    table = board.locator(".nbaccel-sweep-table")
    rows = table.locator("tr.nbaccel-sweep-row")
    curves = board.locator(".nbaccel-sweep-curves")

    def states() -> list[str]:
        return [str(row.get_attribute("data-state")) for row in rows.all()]

    # The short trials ended, the long one runs (the first trials start nbaccel's helper:
    # seconds, more on a loaded machine), and every trial's curve is drawn.
    def short_ones_done() -> bool:
        now = states()
        assert "failed" not in now, table.inner_text()
        return now == ["succeeded", "running", "succeeded", "succeeded"]

    wait_until(short_ones_done, 120, "the short trials to end and the long one to run")
    lab_page.mark("short trials done")
    assert [row.get_attribute("data-trial") for row in rows.all()] == ["0", "1", "2", "3"]
    texts = [row.inner_text() for row in rows.all()]
    assert "0.1" in texts[0] and "CPU slot" in texts[0], texts
    best = table.locator("tr.nbaccel-sweep-best")
    assert best.count() == 1 and best.get_attribute("data-trial") == "0", texts  # least loss
    assert best.inner_text().startswith("★ 0"), texts
    header = board.locator(".nbaccel-sweep-header")
    assert "4 trials" in header.inner_text() and "best: trial 0" in header.inner_text()

    def curves_drawn() -> bool:
        width = curves.evaluate("image => image.naturalWidth") if curves.is_visible() else 0
        return bool(width)

    wait_until(curves_drawn, 30, "the curves image")
    box = curves.bounding_box()
    assert box is not None and box["width"] > 300 and box["height"] > 100, box

    # A sweep that does not block: the buttons work, and no note says to interrupt.
    stop_trial = board.locator("button.nbaccel-sweep-stop-trial")
    stop_all = board.locator("button.nbaccel-sweep-stop-all")
    assert stop_trial.is_enabled() and stop_all.is_enabled()
    assert board.locator(".nbaccel-sweep-stop-note").inner_text().strip() == ""
    picker = board.locator(".nbaccel-sweep-trial select")
    options = [text.replace("\xa0", " ") for text in picker.locator("option").all_inner_texts()]
    assert options == [f"trial 1: lr={LONG}"], options  # the running trials
    lab_page.screenshot("running", board)

    # The long trial's loss goes on while it runs: its step grows in its row.
    def long_step() -> int:
        cells = rows.nth(1).locator("td").all_inner_texts()
        return int(cells[3]) if cells[3].strip().isdigit() else -1

    first = long_step()
    wait_until(lambda: long_step() > first, 30, "the long trial's step to grow")
    picker.select_option(value=f"trial 1: lr={LONG}")  # ipywidgets: the label as the value
    stop_trial.click()
    lab_page.mark("clicked Stop trial")

    # The sweep ends: the board gives way to its summary, the table and the curves' PNG.
    summary = output.locator(".nbaccel-sweep-summary")
    lab_page.wait_for_output(1, summary, 60)
    lab_page.mark("summary")
    image = output.locator('.jp-OutputArea-output[data-mime-type="image/png"] img')
    wait_until(lambda: image.count() == 1 and image.is_visible(), 30, "the summary's picture")
    wait_until(lambda: board.count() == 0, 30, "the live board to close")
    summary_rows = summary.locator("tr.nbaccel-sweep-row")
    said = [str(row.get_attribute("data-state")) for row in summary_rows.all()]
    assert said == ENDED_STATES, summary.inner_text()
    assert "4 trials: 3 succeeded, 1 stopped; best trial 0: loss" in summary.inner_text()

    # The kernel's sweep: the stopped trial is "stopped", the best one lr=0.1.
    run_cell(lab_page, 2)
    ended = printed(lab_page, 2, "ENDED", 90)
    assert ended["states"] == ENDED_STATES, ended
    assert ended["best"] == {"lr": 0.1}, ended
    lab_page.mark("checked the table")

    # The summary stays in the sweep's cell, and a saved notebook keeps it.
    assert summary.count() == 1 and image.count() == 1 and image.is_visible()
    text = str(lab_page.panel.inner_text())
    assert not [word for word in BROKEN if word in text], text
    lab_page.screenshot("ended")
    lab_page.cell(2).locator(".jp-InputArea-editor").click()
    lab_page.page.keyboard.press("Control+s")
    path = lab_page.lab.root / notebook

    def saved_outputs() -> list[dict[str, Any]] | None:
        outputs = json.loads(path.read_text())["cells"][1].get("outputs", [])
        found = [out for out in outputs if "data" in out]
        html = [out for out in found if "nbaccel-sweep-summary" in str(out["data"])]
        pngs = [out for out in found if "image/png" in out["data"]]
        return found if html and pngs else None

    kept = wait_until(saved_outputs, 30, "the saved notebook to hold the summary")
    page = next("".join(out["data"]["text/html"]) for out in kept if "text/html" in out["data"])
    saved_states = re.findall(r"data-trial='\d+' data-state='([^']*)'", page)
    assert saved_states == ENDED_STATES, page[:2000]
    lab_page.mark("saved")


BLOCKING = 'nbaccel.sweep(train, {"lr": [0.1, 0.2]}, metric="loss", use_cpu=True)'


def test_a_blocking_sweeps_board_says_to_interrupt_and_the_interrupt_stops_it(
    lab_page: LabPage,
) -> None:
    notebook = lab_page.lab.write_notebook("sweep_board_blocking.ipynb", [SETUP, BLOCKING])
    output, board = board_of_second_cell(lab_page, notebook)
    rows = board.locator(".nbaccel-sweep-table tr.nbaccel-sweep-row")

    def states() -> list[str]:
        return [str(row.get_attribute("data-state")) for row in rows.all()]

    # Live while the cell runs (the kernel is busy in the sweep): the short trial ends, the
    # long one runs; no click could reach the kernel, so the buttons are disabled and say
    # what stops the sweep.
    wait_until(lambda: states() == ["succeeded", "running"], 120, "the long trial alone")
    lab_page.mark("long trial alone")
    for part in ("button.nbaccel-sweep-stop-trial", "button.nbaccel-sweep-stop-all"):
        button = board.locator(part)
        assert button.is_disabled(), part
        assert "interrupt the kernel" in str(button.get_attribute("title")), part
    assert board.locator(".nbaccel-sweep-trial select").is_disabled()
    assert "interrupt the kernel" in board.locator(".nbaccel-sweep-stop-note").inner_text()
    lab_page.screenshot("blocking", board)

    # The toolbar's ■ interrupts the kernel: the sweep stops its trial and leaves its summary.
    lab_page.panel.locator('[data-jp-item-name="interrupt"] button').click()
    lab_page.mark("interrupted")
    summary = output.locator(".nbaccel-sweep-summary")
    wait_until(lambda: summary.count() == 1, 60, "the interrupted sweep's summary")
    lab_page.mark("summary")
    said = [str(row.get_attribute("data-state")) for row in summary.locator("tr").all()[1:]]
    assert said == ["succeeded", "cancelled"], summary.inner_text()
    image = output.locator('.jp-OutputArea-output[data-mime-type="image/png"] img')
    wait_until(lambda: image.count() == 1 and image.is_visible(), 30, "the summary's picture")
    wait_until(lambda: board.count() == 0, 30, "the live board to close")
    wait_until(lambda: "KeyboardInterrupt" in output.inner_text(), 30, "the interrupt's error")
    text = str(lab_page.panel.inner_text())
    assert not [word for word in BROKEN if word in text], text
    lab_page.screenshot("interrupted")
