"""Kept workers in a real JupyterLab: ``keep_workers=True`` leaves the ranks alive under the
launching cell's dashboard, with a Release button that ends them.

A cell trains a tiny model on 2 CPU processes with ``notebook_launcher(...,
keep_workers=True)``; once the function returned, the cell shows the kept workers' panel
(``.nbaccel-kept-workers``, ``nbaccel/ui/kept_panel.py``) below the dashboard: a Release
button and the line "2 workers kept (run ...): rank 0: ... RAM · rank 1: ... RAM". The next
cell calls the kept group (``nbaccel.last_workers().run``) for each rank's pid, which the
test sees alive. Then the test clicks Release: the line says the workers are released and
the button is disabled. A last cell polls (with a deadline) until those pids are gone and
checks that a further call raises ``nbaccel.WorkersEnded``; the test checks the pids too.
Screenshots: ``browser-artifacts/test_release_ends_the_kept_workers/`` (``kept.png``,
``released.png``: the panel; ``ended.png``: the page).
"""

from __future__ import annotations

import re
import textwrap

import psutil
import pytest

from .conftest import LabPage, wait_until
from .test_save_and_stop_in_jupyterlab import BROKEN, printed, run_cell

pytestmark = pytest.mark.timeout(240)

SETUP = textwrap.dedent("""
    import json
    import time

    import psutil

    import nbaccel


    def train(steps):
        import torch
        from nbaccel import Accelerator

        acc = Accelerator()
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        return steps * 10 + 1


    def where():
        import os

        return os.getpid()
    """).strip()
LAUNCH = textwrap.dedent("""
    value = nbaccel.notebook_launcher(train, args=(3,), num_processes=2, use_cpu=True,
                                      keep_workers=True)
    print("TRAINED " + json.dumps({"value": value}))
    """).strip()
PIDS = textwrap.dedent("""
    pids = nbaccel.last_workers().run(where)
    print("PIDS " + json.dumps({"pids": pids, "run": nbaccel.last_workers().run_dir.name}))
    """).strip()
# After the click: the ranks' processes end (polled, with a deadline), and the group says so.
ENDED = textwrap.dedent("""
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids.values() if psutil.pid_exists(pid)]
    try:
        nbaccel.last_workers().run(where)
        raised = None
    except nbaccel.WorkersEnded as error:
        raised = str(error)
    print("ENDED " + json.dumps({"left": left, "raised": raised}))
    """).strip()
KEPT = re.compile(
    r"^2 workers kept \(run (?P<run>[\w.-]+); run\.workers, nbaccel\.last_workers\(\)\): "
    r"rank 0: [\d.]+ \w+ RAM · rank 1: [\d.]+ \w+ RAM$"
)


def gone(pid: int) -> bool:
    """``pid`` ended (a zombie not yet reaped counts as ended)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_release_ends_the_kept_workers(lab_page: LabPage) -> None:
    notebook = lab_page.lab.write_notebook("kept_workers.ipynb", [SETUP, LAUNCH, PIDS, ENDED])
    lab_page.open(notebook)
    run_cell(lab_page, 0)
    run_cell(lab_page, 1)

    # The launch returned rank 0's value, and its cell shows the panel under the dashboard.
    trained = printed(lab_page, 1, "TRAINED", 120)
    assert trained == {"value": 31}, trained
    output = lab_page.cell(1).locator(".jp-OutputArea.jp-Cell-outputArea")
    panel = output.locator(".nbaccel-kept-workers")
    lab_page.wait_for_output(1, panel, 30)
    lab_page.mark("kept panel")
    assert panel.count() == 1, panel.count()
    dashboard = output.locator(".nbaccel-dashboard")
    assert dashboard.count() == 1, dashboard.count()
    dashboard_box, panel_box = dashboard.bounding_box(), panel.bounding_box()
    assert dashboard_box is not None and panel_box is not None
    assert panel_box["y"] >= dashboard_box["y"] + dashboard_box["height"] - 1, (
        dashboard_box,
        panel_box,
    )
    button = panel.locator("button")
    label = panel.locator(".widget-html")
    assert button.count() == 1 and button.inner_text().strip() == "Release"
    assert button.is_enabled()
    assert "device memory" in str(button.get_attribute("title"))
    wait_until(lambda: KEPT.match(label.inner_text().strip()), 10, "the kept workers' line")

    # The kept group answers: each rank's pid, processes of this machine, alive.
    run_cell(lab_page, 2)
    told = printed(lab_page, 2, "PIDS", 60)
    pids = {int(rank): pid for rank, pid in told["pids"].items()}
    assert sorted(pids) == [0, 1] and len(set(pids.values())) == 2, told
    assert all(psutil.pid_exists(pid) and not gone(pid) for pid in pids.values()), told
    # The panel is updated after the call: still kept, the same run.
    kept = wait_until(lambda: KEPT.match(label.inner_text().strip()), 10, "the line after a call")
    assert kept.group("run") == told["run"], (kept.group(0), told)
    assert button.is_enabled()
    lab_page.screenshot("kept", panel)
    lab_page.mark("pids")

    # Release: the line says released, the button is disabled, the ranks end.
    button.click()
    lab_page.mark("clicked Release")
    released = f"the workers of run {told['run']} are released"

    def said_released() -> bool:
        text = label.inner_text().strip()
        assert not text.startswith("release failed"), text
        return text == released and button.is_disabled()

    wait_until(said_released, 60, "the panel to say released")
    lab_page.mark("released")
    lab_page.screenshot("released", panel)
    wait_until(lambda: all(gone(pid) for pid in pids.values()), 30, "the ranks' processes to end")

    # The kernel sees them gone, and the group refuses a call.
    run_cell(lab_page, 3)
    ended = printed(lab_page, 3, "ENDED", 60)
    assert ended["left"] == [], ended
    raised = ended["raised"]
    assert raised is not None and "the Release button" in raised, ended
    lab_page.mark("ended")
    # Nothing else changed in the launching cell: one panel, still released.
    assert panel.count() == 1 and label.inner_text().strip() == released
    text = str(lab_page.panel.inner_text())
    assert not [word for word in BROKEN if word in text], text
    lab_page.screenshot("ended")
