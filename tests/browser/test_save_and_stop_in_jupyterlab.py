"""Save & stop in a real JupyterLab: a click saves a 2-process run and ends it; a relaunch
with ``resume="auto"`` goes on from the saved step.

A cell launches (``nbaccel.launch``, non-blocking: the kernel stays free for the click) a run
that would train for ever (two minutes at most) over a prepared DataLoader, with its
checkpoints in a temp folder. Once the dashboard shows it running, the test clicks "Save &
stop" (``.nbaccel-save-stop``, ``nbaccel/ui/dashboard/widgets.py``) and waits for the header
to say "stopped", the button "Ended", and the run's notices in the log. Then it runs the next
cells one by one, as a user would (click into the cell, Shift+Enter): the first prints what
the kernel's ``run`` says (state, ``saved_step``, exit code), checked here against the
checkpoint folder (``LATEST`` names a ``state-*`` folder whose ``meta.json`` has that step);
the second relaunches with ``resume="auto"`` and a total five steps further, which must
succeed with its first new step right after the saved one. Screenshots:
``browser-artifacts/test_save_and_stop_then_resume/`` (``running.png``, ``stopped.png``:
the dashboard; ``resumed.png``: the page).
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from .conftest import LabPage, wait_until

pytestmark = pytest.mark.timeout(300)

SETUP = textwrap.dedent("""
    import json

    import nbaccel

    CK = {checkpoints!r}


    def train(total, limit=120):
        import time

        import torch
        from nbaccel import Accelerator

        acc = Accelerator()
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        model, opt, loader = acc.prepare(model, opt, loader)
        deadline = time.monotonic() + limit  # never the test's wait: a failed test's bound
        while acc.completed_steps < total and time.monotonic() < deadline:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
                acc.log({{"loss": loss.item(), "at": acc.completed_steps}})
                if acc.completed_steps >= total:
                    break
        return acc.completed_steps
    """).strip()
# Returns at once: the kernel stays free, so the click reaches it.
LAUNCH = "run = nbaccel.launch(train, args=(10**9,), num_processes=2, checkpoint_dir=CK)"
CHECK = textwrap.dedent("""
    state = run.wait(60)  # ended already (the dashboard said so): returns at once
    print("STOPPED " + json.dumps(
        {"state": state.value, "saved_step": run.saved_step, "exit_code": run.exit_code}
    ))
    """).strip()
RESUME = textwrap.dedent("""
    saved = run.saved_step
    again = nbaccel.launch(
        train, args=(saved + 5,), num_processes=2, checkpoint_dir=CK, resume="auto"
    )
    state = again.wait(120)
    new = [record for record in again.metrics if record["at"] > saved]  # after the restore
    print("RESUMED " + json.dumps({
        "state": state.value, "result": again.result(), "first": new[0] if new else None,
        "new": len(new),
    }))
    """).strip()
BROKEN = ("Loading widget", "Error displaying widget")


def run_cell(lab_page: LabPage, index: int) -> None:
    """Run one cell as a user does: click into its editor, press Shift+Enter."""
    lab_page.cell(index).locator(".jp-InputArea-editor").click()
    lab_page.page.keyboard.press("Shift+Enter")
    lab_page.mark(f"ran cell {index}")


def printed(lab_page: LabPage, index: int, tag: str, timeout: float) -> dict[str, Any]:
    """The JSON a cell printed after ``tag``; fails at once if the cell raised."""
    line = re.compile(rf"^{tag} (\{{.*\}})$", re.MULTILINE)

    def found() -> dict[str, Any] | None:
        error = lab_page.cell_error(index)
        if error is not None:
            raise AssertionError(f"cell {index} raised:\n{error}")
        outputs = lab_page.cell(index).locator(".jp-OutputArea-output")
        match = line.search("\n".join(outputs.all_inner_texts()))
        return dict(json.loads(match.group(1))) if match else None

    value: dict[str, Any] = wait_until(found, timeout, f"{tag} in the output of cell {index}")
    return value


def test_save_and_stop_then_resume(lab_page: LabPage, tmp_path: Path) -> None:
    checkpoints = tmp_path / "ck"
    setup = SETUP.format(checkpoints=str(checkpoints))
    notebook = lab_page.lab.write_notebook("save_and_stop.ipynb", [setup, LAUNCH, CHECK, RESUME])
    lab_page.open(notebook)
    run_cell(lab_page, 0)
    run_cell(lab_page, 1)
    output = lab_page.cell(1).locator(".jp-OutputArea.jp-Cell-outputArea")
    root = output.locator(".nbaccel-dashboard")
    lab_page.wait_for_output(1, root, 60)
    header, log = root.locator(".nbaccel-header"), root.locator(".nbaccel-log")
    button = root.locator(".nbaccel-save-stop")
    lab_page.mark("dashboard")

    # Running, with steps done (the first launch in a kernel starts nbaccel's helper, which
    # imports torch: seconds, more on a loaded machine): then the button is armed.
    def stepping() -> bool:
        text = header.inner_text()
        if text.startswith(("failed", "cancelled", "succeeded")):
            raise AssertionError(f"the run ended before the click: {text}\n{log.inner_text()}")
        return text.startswith("running") and re.search(r"step \d+", text) is not None

    wait_until(stepping, 90, "the dashboard to show the run stepping")
    assert button.inner_text().strip() == "Save & stop" and button.is_enabled()
    assert "resume='auto'" in str(button.get_attribute("title"))
    lab_page.screenshot("running", root)
    button.click()
    lab_page.mark("clicked Save & stop")
    # "Saving…" while the ranks save (often shorter than one 0.25 s write of the widgets),
    # then "stopped", the buttons "Ended", and the run's notices in the log.
    wait_until(
        lambda: (
            button.inner_text().strip() == "Saving…" or header.inner_text().startswith("stopped")
        ),
        30,
        "Saving… or stopped after the click",
    )

    def stopped() -> bool:
        text = header.inner_text()
        if text.startswith(("failed", "cancelled", "succeeded")):
            raise AssertionError(f"the run did not stop as asked: {text}\n{log.inner_text()}")
        return text.startswith("stopped") and button.inner_text().strip() == "Ended"

    wait_until(stopped, 60, "the dashboard to show the run stopped")
    lab_page.mark("stopped")
    assert button.is_disabled() and root.locator(".nbaccel-stop").is_disabled()
    log_text = log.inner_text()
    saved_in_log = re.search(r"checkpoint saved before stopping at step (\d+)", log_text)
    assert saved_in_log, log_text
    assert "launch again with resume='auto' to go on" in log_text, log_text
    assert root.locator(".nbaccel-errors").inner_text().strip() == ""
    lab_page.screenshot("stopped", root)

    # The kernel's run: stopped, saved at the step the log named; the folder holds it.
    run_cell(lab_page, 2)
    told = printed(lab_page, 2, "STOPPED", 60)
    saved = told["saved_step"]
    assert told["state"] == "stopped" and told["exit_code"] == 0, told
    assert isinstance(saved, int) and saved > 0, told
    assert saved == int(saved_in_log.group(1)), (told, log_text)
    latest = (checkpoints / "LATEST").read_text().strip()
    assert re.fullmatch(r"state-[\w-]+", latest), latest
    meta = json.loads((checkpoints / latest / "meta.json").read_text())
    assert meta["progress"]["completed_steps"] == saved, meta
    lab_page.mark(f"saved at step {saved}")

    # Relaunched with resume="auto": five steps more, from the saved one on.
    run_cell(lab_page, 3)
    resumed = printed(lab_page, 3, "RESUMED", 150)
    assert resumed["state"] == "succeeded" and resumed["result"] == saved + 5, resumed
    first = resumed["first"]
    assert first is not None and first["at"] == saved + 1, resumed
    assert first["step"] == saved and resumed["new"] == 5, resumed  # its log goes on, too
    lab_page.mark("resumed")
    text = str(lab_page.panel.inner_text())
    assert not [word for word in BROKEN if word in text], text
    lab_page.screenshot("resumed")
