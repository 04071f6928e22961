"""The browser set-up itself, without nbaccel: a widget updated from a thread renders and
updates live in JupyterLab. When this fails, the dashboard test's failure is not nbaccel's."""

from __future__ import annotations

import textwrap

import pytest

from .conftest import LabPage, wait_until

pytestmark = pytest.mark.timeout(120)

CELL = textwrap.dedent("""
    import threading
    import time

    import ipywidgets as widgets
    from IPython.display import display

    bar = widgets.IntProgress(value=0, max=50, description="ticks")
    label = widgets.Label("started")
    label.add_class("test-thread-label")
    box = widgets.VBox([bar, label])
    box.add_class("test-thread-widgets")
    display(box)


    def tick():
        for i in range(1, 51):
            time.sleep(0.1)
            bar.value = i
            label.value = f"tick {i}"
        label.value = "finished"


    threading.Thread(target=tick, daemon=True).start()
    """).strip()


def test_thread_updates_a_widget_live(lab_page: LabPage) -> None:
    notebook = lab_page.lab.write_notebook("thread_widgets.ipynb", [CELL])
    lab_page.open(notebook)
    lab_page.run_all()

    box = lab_page.panel.locator(".test-thread-widgets")
    lab_page.wait_for_output(0, box, 30)
    lab_page.mark("widget")
    label = box.locator(".test-thread-label")
    bar = box.locator(".widget-hprogress .progress-bar")
    first = label.inner_text()

    def updated_midway() -> str | None:
        text, width = label.inner_text(), bar.evaluate("el => el.style.width")
        return width if text not in (first, "finished") and width != "100%" else None

    # Live: the label and the bar change while the thread runs, without any browser action.
    width = wait_until(updated_midway, 10, "a live update")
    lab_page.screenshot("running")
    wait_until(lambda: label.inner_text() == "finished", 20, "the thread to finish")
    lab_page.screenshot("final")
    lab_page.mark("end")
    text = lab_page.body_text()
    assert "Loading widget" not in text
    assert "Error displaying widget" not in text
    assert bar.evaluate("el => el.style.width") == "100%" != width
