"""The step-time panel of the live dashboard in a real JupyterLab (issue 16, part 3).

A 2-process DDP training over a prepared DataLoader of ``input_ids`` batches runs from a
cell (``nbaccel.launch``) until the test releases it (a file the ranks look for after each
epoch, agreeing through a reduce; 120 s at most): the panel is inspected while the run is
certainly running, however long JupyterLab took to start. While it runs, the dashboard's step
panel (``.nbaccel-steps``, ``nbaccel/ui/dashboard/step_panel.py``) must show a row per rank with its
step time and a bar stacked by phase, throughput in samples/s and tokens/s, and the straggler
line; at the end the static summary names the step time. Screenshots:
``browser-artifacts/test_the_dashboard_explains_the_step/`` (``steps-running.png``: the
panel; ``running.png``: the page; ``final-output.png``: the launch cell's output).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from .conftest import LabPage, wait_until

pytestmark = pytest.mark.timeout(180)

TRAIN = textwrap.dedent("""
    import nbaccel


    def train(release, limit=120):
        import os
        import time

        import torch
        from torch import nn
        from torch.utils.data import DataLoader

        torch.manual_seed(0)
        acc = nbaccel.Accelerator()
        samples = [
            {"input_ids": torch.randint(0, 100, (16,)), "labels": torch.tensor(i % 4)}
            for i in range(50 * 8 * acc.num_processes)
        ]
        model = nn.Sequential(nn.Embedding(100, 32), nn.Flatten(), nn.Linear(512, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(samples, batch_size=8, shuffle=True)
        model, optimizer, loader = acc.prepare(model, optimizer, loader)
        deadline = time.monotonic() + limit
        while True:  # epochs, until the test releases the run
            for batch in loader:
                loss = nn.functional.cross_entropy(model(batch["input_ids"]), batch["labels"])
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                acc.log({"loss": loss.item()})
            done = os.path.exists(release) or time.monotonic() > deadline
            # Every rank stops after the same epoch: any rank's "done" ends it for all.
            if acc.reduce(torch.tensor([float(done)]), reduction="sum").item() > 0:
                break
        if not os.path.exists(release):
            raise TimeoutError(f"the test did not release the run within {limit} s")
        return loss.item()
    """).strip()
# Returns at once: the kernel stays free.
LAUNCH = "run = nbaccel.launch(train, args=({release!r},), num_processes=2)"
BROKEN = ("Loading widget", "Error displaying widget")
ROW = re.compile(r"rank (\d)\s+([\d.]+) ms\s+([\d,]+) samples/s, ([\d,]+) tokens/s")


def test_the_dashboard_explains_the_step(lab_page: LabPage) -> None:
    release = lab_page.lab.root / "steps.release"
    release.unlink(missing_ok=True)
    launch = LAUNCH.format(release=str(release))
    notebook = lab_page.lab.write_notebook("steps.ipynb", [TRAIN, launch])
    try:
        check_the_running_panel_then_release(lab_page, notebook, release)
    finally:
        release.touch()  # a failed check must not leave the run training until its limit


def check_the_running_panel_then_release(lab_page: LabPage, notebook: str, release: Path) -> None:
    lab_page.open(notebook)
    lab_page.run_all()
    output = lab_page.cell(1).locator(".jp-OutputArea")
    root = output.locator(".nbaccel-dashboard")
    lab_page.wait_for_output(1, root, 30)
    steps = root.locator(".nbaccel-steps")
    header = root.locator(".nbaccel-header")

    def both_ranks_shown() -> bool:
        if header.inner_text().startswith(("failed", "cancelled")):
            raise AssertionError(f"the run ended: {header.inner_text()}")
        return steps.is_visible() and len(ROW.findall(steps.inner_text())) == 2

    wait_until(both_ranks_shown, 90, "the step panel to show both ranks")
    lab_page.mark("steps shown")
    text = steps.inner_text()
    rows = {
        int(rank): (float(ms), samples, tokens) for rank, ms, samples, tokens in ROW.findall(text)
    }
    assert sorted(rows) == [0, 1], text
    assert all(ms > 0 for ms, _, _ in rows.values()), text
    assert re.search(r"throughput: [\d,]+ samples/s, [\d,]+ tokens/s", text), text
    assert "ranks keep together" in text or "straggler: rank" in text, text
    for phase in ("data", "forward", "backward", "communication", "optimizer", "other"):
        assert phase in text, (phase, text)  # the legend
    # The stacked bars: one segment per measured phase, titled with its milliseconds.
    segments = steps.locator("div[title]")
    assert segments.count() >= 2 * 5, text
    assert header.inner_text().startswith("running"), header.inner_text()
    lab_page.screenshot("steps-running", steps)
    lab_page.screenshot("running")
    assert not [word for word in BROKEN if word in output.inner_text()]

    release.touch()  # the ranks stop after their current epoch
    wait_until(lambda: header.inner_text().startswith("succeeded"), 120, "the run to succeed")
    summary = output.locator(".jp-OutputArea-output", has_text="step time: step ")
    wait_until(lambda: summary.count() == 1, 30, "the step-time line in the summary")
    assert "samples/s" in summary.inner_text()
    lab_page.screenshot("final-output", output)
    lab_page.mark("end")
