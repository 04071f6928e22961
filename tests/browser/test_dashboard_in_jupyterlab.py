"""The live dashboard in a real JupyterLab: a 2-process ``nbaccel.launch`` from a cell.

The training function logs a loss every step and shows a tqdm bar for ~8 s. While it runs,
the dashboard must be rendered (no "Loading widget" / "Error displaying widget"), its
log and loss curve must change without any browser action, and a click on Stacks must show
where each rank is (in ``train``) while the run goes on; after the run, the header says
"succeeded" and the static summary (text and image) is in the cell output. Screenshots:
``browser-artifacts/test_dashboard_updates_live_and_leaves_a_summary/`` (``running.png``,
``final.png``: the page; ``final-output.png``: the launch cell's whole output;
``dashboard.png``: the dashboard alone at half the run, the README's picture).

The dashboard's parts are found by their CSS classes (``nbaccel-*``,
``nbaccel/ui/dashboard/widgets.py``); the summary by its text ("nbaccel run <id>: ...").
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import pytest

from .conftest import LabPage, wait_until

pytestmark = pytest.mark.timeout(180)

STEPS = 160
TRAIN = textwrap.dedent(f"""
    import nbaccel

    STEPS, DELAY = {STEPS}, 0.05  # ~8 s of training: long enough to watch it change


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
        # The cell's own output area (a panel's Output widget nests another one in it).
        self.output = lab_page.cell(cell).locator(".jp-OutputArea.jp-Cell-outputArea")
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


def _step(view: DashboardView) -> int:
    """The step the header shows ("step 61/120"), 0 before the first."""
    found = re.search(r"step (\d+)/", view.header.inner_text())
    return int(found.group(1)) if found else 0


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
    # Stacks: a click shows each rank's stack, its summary line naming the user's function.
    view.root.locator(".nbaccel-stacks-button").click()
    stacks = view.root.locator(".nbaccel-stacks")
    wait_until(lambda: "Stacks at" in stacks.inner_text(), 30, "the stacks after the click")
    stacks_text = stacks.inner_text()
    assert "where each rank is now" in stacks_text, stacks_text
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: in train \(", stacks_text), stacks_text
    lab_page.screenshot("stacks", stacks)
    lab_page.mark("stacks")
    text = view.output_text()
    assert not [word for word in BROKEN if word in text], text
    assert "loss = " in view.metric_value.inner_text()
    lab_page.screenshot("running")
    # The dashboard alone, mid-run (`make dashboard-image` makes it the README's picture):
    # taken once the curve has half the run, unless a slow machine ended the run first.
    wait_until(
        lambda: _step(view) >= STEPS // 2 or not view.header.inner_text().startswith("running"),
        60,
        "the run to reach half its steps",
    )
    if view.header.inner_text().startswith("running"):
        lab_page.screenshot("dashboard", view.root)

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


# ----- notebook 02's panel and the dashboard it launches (issue 16, parts 3 and 4) ---------
PANEL_SETUP = textwrap.dedent("""
    import tempfile

    import nbaccel
    from nbaccel.ui.attach import dashboard_for

    RUNS = tempfile.mkdtemp(prefix="nbaccel-runs-")  # both runs here: the second compares
    WIDTH, BLOCKS = 256, 4
    NUM_PARAMS = BLOCKS * (WIDTH * WIDTH + WIDTH) + (WIDTH + 1)


    def train(steps=30, lr=1e-3):  # notebook 02's function (lr: the runs differ)
        import torch
        from torch import nn

        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS)]
        model = nn.Sequential(*layers, nn.Linear(WIDTH, 1))
        acc = nbaccel.Accelerator()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        model, optimizer = acc.prepare(model, optimizer)
        x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(acc.process_index))
        for step in range(steps):
            loss = nn.functional.mse_loss(model(x), x[:, :1])
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            acc.log({"loss": loss.item()})
        acc.print(f"final loss {loss.item():.5f}")
    """).strip()
PANEL = (
    "panel = nbaccel.ConfigPanel(train, num_processes=2, num_params=NUM_PARAMS, runs_dir=RUNS)\n"
    "panel"
)
# The earlier run to compare with: blocking, as notebook 02's second launch.
EARLIER = (
    "earlier = nbaccel.notebook_launcher(train, args=(30, 1e-2), config=panel.config, "
    "dashboard='text')"
)
LATER = textwrap.dedent("""
    panel.launch_button.click()  # what a click on Launch does: a non-blocking run
    panel.run.wait(120)
    dash = dashboard_for(panel.run)
    assert dash is not None and dash.wait_finished(30)
    steps = [record["step"] for record in panel.run.metrics]
    print(f"steps {steps[0]}..{steps[-1]}; loss axis {dash.curve_xlim}")
    """).strip()


def test_the_panel_is_grouped_and_the_dashboard_sized_from_the_run(lab_page: LabPage) -> None:
    cells = [PANEL_SETUP, PANEL, EARLIER, LATER]
    notebook = lab_page.lab.write_notebook("panel.ipynb", cells)
    lab_page.open(notebook)
    lab_page.run_all()
    panel = lab_page.cell(1).locator(".nbaccel-config-panel")
    lab_page.wait_for_output(1, panel, 60)

    # The form in groups, as the wizard asks; "advanced" collapsed; nothing for a TPU here.
    titles = ["Processes and machines", "Precision", "Strategy and sharding"]
    titles += ["Training loop", "Logging", "Advanced"]
    groups = panel.locator(".nbaccel-panel-group")
    wait_until(lambda: groups.count() == 6, 30, "the six groups")
    shown_titles = [text.strip() for text in groups.all_inner_texts()]
    for title, text in zip(titles, shown_titles, strict=True):
        assert text.startswith(title), (title, text)
    assert panel.locator(".nbaccel-field-num_processes").is_visible()
    assert not panel.locator(".nbaccel-field-collective_timeout").is_visible()  # collapsed
    assert not panel.locator(".nbaccel-field-xla_start_method").is_visible()  # no TPU
    assert "xla_start_method" in panel.locator(".nbaccel-panel-hidden-note").inner_text()
    height = panel.evaluate("el => el.getBoundingClientRect().height")
    lab_page.mark(f"panel {height:.0f} px tall")
    lab_page.screenshot("panel", panel)
    panel.locator(".nbaccel-group-advanced .jupyter-widget-Collapse-header").click()
    advanced_field = panel.locator(".nbaccel-field-collective_timeout")
    wait_until(advanced_field.is_visible, 10, "the advanced group to open")
    lab_page.screenshot("panel-advanced-open", panel.locator(".nbaccel-group-advanced"))

    # The second run, launched from the panel, after the first (blocking) one.
    view = DashboardView(lab_page, 1)
    lab_page.wait_for_output(1, view.root, 180)
    printed = lab_page.cell(3).locator(".jp-OutputArea-output", has_text="loss axis")
    lab_page.wait_for_output(3, printed, 180)
    lab_page.mark("both runs ended")
    # The loss axis spans the steps logged (0..29), not a guessed total.
    match = re.search(
        r"steps (\d+)\.\.(\d+); loss axis \(([\d.]+), ([\d.]+)\)", printed.inner_text()
    )
    assert match, printed.inner_text()
    first, last, low, high = (float(group) for group in match.groups())
    assert (low, high) == (first, last) and last - first == 29, printed.inner_text()
    assert view.header.inner_text().startswith("succeeded")

    # The log box as tall as its lines (a line is 15.6 px, plus 10 px of padding and border).
    log_lines = len(view.log.inner_text().strip().splitlines())
    log_box = view.log.locator("div").first
    log_px = log_box.evaluate("el => el.getBoundingClientRect().height")
    assert abs(log_px - (min(log_lines, 12) * 15.6 + 10)) < 4, (log_lines, log_px)
    lab_page.mark(f"log box {log_px:.0f} px for {log_lines} lines")

    # Memory after the end: peak as the bar, the last reading as text, what each covers.
    memory_text = view.root.locator(".nbaccel-memory-text").inner_text()
    assert "peak (the bar)" in memory_text and " last" in memory_text, memory_text
    assert "0 B last" not in memory_text, memory_text
    assert "RSS = the whole worker process" in memory_text, memory_text
    assert re.search(r"A bare worker \(Python \+ torch, before the function\) holds", memory_text)
    assert "model states only (not activations, not the runtime)" in memory_text, memory_text
    lab_page.screenshot("dashboard-ended", view.root)

    # Compare runs: pick the earlier run; the legend names it, and the curve is redrawn.
    picker = view.root.locator(".nbaccel-compare select")
    wait_until(lambda: picker.locator("option").count() == 1, 30, "the earlier run listed")
    earlier_id = picker.locator("option").first.inner_text().strip()
    before = view.curve.get_attribute("src")
    picker.select_option(label=earlier_id)
    legend = view.root.locator(".nbaccel-curve-legend")
    wait_until(lambda: earlier_id in legend.inner_text(), 30, "the legend to name the earlier run")
    assert "(this run)" in legend.inner_text()
    wait_until(lambda: view.curve.get_attribute("src") != before, 30, "the curve with the overlay")
    text = view.output_text()
    assert not [word for word in BROKEN if word in text], text
    lab_page.screenshot("dashboard-compare", view.root)
    lab_page.mark("end")
