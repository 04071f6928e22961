"""A blocking ``notebook_launcher``'s dashboard in a real JupyterLab: its widgets come into
the output kept for them once the run has gone on ``dashboard_after`` s (an
``update_display_data`` from the kernel's UI thread), render live above the summary while
the cell still runs; a run shorter than that leaves its summary alone, and nothing broken.
Screenshots: ``browser-artifacts/test_a_blocking_call_shows_its_widgets_once_its_run_goes_on/``.
"""

from __future__ import annotations

import textwrap

import pytest

from .conftest import LabPage, wait_until
from .test_dashboard_in_jupyterlab import BROKEN, DashboardView

pytestmark = pytest.mark.timeout(180)

TRAIN = textwrap.dedent("""
    import nbaccel


    def train(steps):
        import time

        import torch.distributed as dist

        for step in range(steps):
            nbaccel.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
            time.sleep(0.05)  # ~3 s of work: long enough to see it live
        print(f"rank {dist.get_rank()} done")
        return steps
    """).strip()
BLOCKING = "nbaccel.notebook_launcher(train, args=(60,), num_processes=2)"
SHORT = "nbaccel.notebook_launcher(train, args=(0,), num_processes=2, dashboard_after=60)"


def test_a_blocking_call_shows_its_widgets_once_its_run_goes_on(lab_page: LabPage) -> None:
    notebook = lab_page.lab.write_notebook("blocking.ipynb", [TRAIN, BLOCKING, SHORT])
    lab_page.open(notebook)
    lab_page.run_all()
    view = DashboardView(lab_page, 1)
    lab_page.wait_for_output(1, view.root, 60)  # the first launch starts the helper

    # Live while the cell still runs (the kernel is busy with it): running, steps moving.
    first = wait_until(
        lambda: (state := view.read())["header"].startswith("running") and state,
        60,
        "the blocking call's dashboard to show its running run",
    )
    wait_until(
        lambda: view.read()["header"] != first["header"], 30, "the header to change while running"
    )
    lab_page.screenshot("running")
    wait_until(lambda: view.header.inner_text().startswith("succeeded"), 60, "the run to succeed")

    # The summary comes below the widgets (their output was kept above it at the start).
    summary = view.output.locator(".jp-OutputArea-output", has_text="nbaccel run ")
    wait_until(lambda: summary.count() == 1, 30, "the summary text below the dashboard")
    order = view.output.evaluate(
        """area => {
            const dash = area.querySelector('.nbaccel-dashboard');
            const texts = [...area.querySelectorAll('.jp-OutputArea-output')]
                .filter(o => o.innerText.startsWith('nbaccel run '));
            return dash.compareDocumentPosition(texts[0]) & Node.DOCUMENT_POSITION_FOLLOWING;
        }"""
    )
    assert order, "the summary is above the dashboard"
    assert "rank 0 done" in view.read()["log"]
    assert not [word for word in BROKEN if word in view.output_text()]
    lab_page.screenshot("blocking-output", view.output)

    # A run that ends before dashboard_after: its summary alone, no widget, nothing broken.
    short = DashboardView(lab_page, 2)
    short_summary = short.output.locator(".jp-OutputArea-output", has_text="nbaccel run ")
    wait_until(lambda: short_summary.count() == 1, 90, "the short run's summary")
    assert "succeeded" in short_summary.inner_text()
    assert short.root.count() == 0
    assert not [word for word in BROKEN if word in short.output_text()]
    lab_page.screenshot("short-output", short.output)
