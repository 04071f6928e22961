"""The live dashboard in a real JupyterLab: a 2-process ``nbaccel.launch`` from a cell.

The training function logs a loss every step and shows a tqdm bar for ~6 s. While it runs,
the dashboard must be rendered (no "Loading widget" / "Error displaying widget"), and its
log and loss curve must change without any browser action; after the run, the header says
"succeeded" and the static summary (text and image) is in the cell output. Screenshots:
``browser-artifacts/test_dashboard_updates_live_and_leaves_a_summary/`` (``running.png``,
``final.png``: the page; ``final-output.png``: the launch cell's whole output).

The dashboard's parts are found by their CSS classes (``nbaccel-*``,
``nbaccel/ui/dashboard_widgets.py``); the summary by its text ("nbaccel run <id>: ...").
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import pytest

from .conftest import LabPage, wait_until

pytestmark = pytest.mark.timeout(180)

STEPS = 120
TRAIN = textwrap.dedent(f"""
    import nbaccel

    STEPS, DELAY = {STEPS}, 0.05  # ~6 s of training: long enough to watch it change


    def train():
        import time

        import torch
        import torch.distributed as dist
        from tqdm import tqdm

        rank = dist.get_rank()
        weight = torch.zeros(1, requires_grad=True)
        optimizer = torch.optim.SGD([weight], lr=0.02)
        for step in tqdm(range(STEPS), desc="train", mininterval=0, disable=rank != 0):
            loss = (weight - 3.0).pow(2).sum()
            optimizer.zero_grad()
            loss.backward()
            dist.all_reduce(weight.grad)
            optimizer.step()
            nbaccel.log_metrics({{"loss": loss.item()}}, step=step)
            time.sleep(DELAY)
        print(f"rank {{rank}} done")
        return loss.item()
    """).strip()
LAUNCH = "run = nbaccel.launch(train, num_processes=2)  # returns at once: the kernel stays free"
BROKEN = ("Loading widget", "Error displaying widget")


class DashboardView:
    """The dashboard's parts in the launch cell's output, read from the DOM."""

    def __init__(self, lab_page: LabPage, cell: int) -> None:
        self.output = lab_page.cell(cell).locator(".jp-OutputArea")
        self.root = self.output.locator(".nbaccel-dashboard")
        self.header = self.root.locator(".nbaccel-header")
        self.log = self.root.locator(".nbaccel-log")
        self.curve = self.root.locator("img.nbaccel-curve")
        self.metric_value = self.root.locator(".nbaccel-metric-value")
        self.errors = self.root.locator(".nbaccel-errors")

    def read(self) -> dict[str, Any]:
        """What the dashboard shows now; the curve as its image's ``src`` (a new blob URL
        per frame, None while hidden). A failed or cancelled run fails the test at once."""
        state = {
            "header": self.header.inner_text(),
            "log": self.log.inner_text(),
            "curve": self.curve.get_attribute("src") if self.curve.is_visible() else None,
            "metric": self.metric_value.inner_text(),
        }
        if state["header"].startswith(("failed", "cancelled")):
            raise AssertionError(f"the run ended: {state['header']}\n{self.errors.inner_text()}")
        return state

    def output_text(self) -> str:
        return str(self.output.inner_text())


def test_dashboard_updates_live_and_leaves_a_summary(lab_page: LabPage) -> None:
    notebook = lab_page.lab.write_notebook("dashboard.ipynb", [TRAIN, LAUNCH])
    lab_page.open(notebook)
    lab_page.run_all()
    view = DashboardView(lab_page, 1)
    lab_page.wait_for_output(1, view.root, 30)
    lab_page.mark("dashboard")

    # Running, with a first log line (the first launch in a kernel starts nbaccel's helper
    # process, which imports torch: a few seconds, more on a loaded machine).
    def started() -> dict[str, Any] | None:
        state = view.read()
        return state if state["header"].startswith("running") and state["log"].strip() else None

    first = wait_until(started, 60, "the dashboard to show a running run with a log")
    lab_page.mark("running")
    # Live: while the run goes on, with no browser action, the log changes and the curve
    # shows at least two different frames.
    seen: list[dict[str, Any]] = []

    def changed_while_running() -> bool:
        seen.append(view.read())
        if not seen[-1]["header"].startswith("running"):
            raise AssertionError(f"the run ended before the dashboard changed: {seen}")
        frames = {state["curve"] for state in seen} - {None}
        return seen[-1]["log"] != first["log"] and len(frames) >= 2

    wait_until(changed_while_running, 30, "the log and the curve to change while running")
    lab_page.mark("changed")
    text = view.output_text()
    assert not [word for word in BROKEN if word in text], text
    assert "loss = " in view.metric_value.inner_text()
    lab_page.screenshot("running")

    # The end: the header's state, the whole loss series, and the static summary left in the
    # cell output (text and image) so that a saved notebook keeps them.
    wait_until(lambda: view.header.inner_text().startswith("succeeded"), 60, "the run to succeed")
    lab_page.mark("succeeded")
    summary = view.output.locator(".jp-OutputArea-output", has_text="nbaccel run ")
    wait_until(lambda: summary.count() == 1, 30, "the summary text in the cell output")
    summary_text = summary.inner_text()
    assert "succeeded" in summary_text, summary_text
    assert re.search(rf"loss: last [-\d.e]+ at step {STEPS - 1}", summary_text), summary_text
    summary_image = view.output.locator(".jp-RenderedImage img")
    wait_until(lambda: summary_image.count() == 1, 30, "the summary image in the cell output")
    assert summary_image.evaluate("img => img.complete && img.naturalWidth > 0")

    lab_page.mark("summary")
    final = view.read()
    assert f"at step {STEPS - 1}" in final["metric"], final
    assert "rank 0 done" in final["log"], final["log"]
    # tqdm's carriage-return redraws are one updating line, not one line per step.
    bars = [line for line in final["log"].splitlines() if line.startswith("train:")]
    assert len(bars) == 1 and "100%" in bars[0], final["log"]
    text = view.output_text()
    assert not [word for word in BROKEN if word in text], text
    lab_page.screenshot("final")
    lab_page.screenshot("final-output", view.output)  # the whole output, summary included
    lab_page.mark("end")
