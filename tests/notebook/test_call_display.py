"""What a call of interactive workers (and a launch) leaves in its cell, in a real ipykernel:
the summary holds every metric the call logged and its stall warning; a quiet, short call in
a loop displays nothing; a finished dashboard shows its pictures once and its Stop button
ended (issue 39, items 14, 15, 16 and 23).

Read from the kernel's iopub messages (jupyter_client), or from the notebook nbclient saves
(its outputs after every ``update_display_data``, and the widgets' stored state)."""

from __future__ import annotations

import queue
import re
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import BlockingKernelClient, KernelManager

pytestmark = pytest.mark.timeout(300)

DISPLAY = ("display_data", "update_display_data")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def cell_messages(
    kc: BlockingKernelClient, code: str, timeout: float = 120
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``code``; its execute_reply, and every iopub message it caused, in order."""
    msg_id = kc.execute(textwrap.dedent(code), stop_on_error=False)
    messages: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    idle = False
    while not idle:
        assert time.monotonic() < deadline, f"the cell did not end within {timeout} s: {code}"
        try:
            msg = kc.get_iopub_msg(timeout=0.2)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status":
            idle = msg["content"]["execution_state"] == "idle"
        elif msg["msg_type"] != "execute_input":
            messages.append(msg)
    while True:
        reply = kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"], messages


def final_outputs(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cell's display outputs as the frontend ends with them: each ``display_data``,
    replaced by the later updates of its display_id."""
    outputs: list[dict[str, Any]] = []
    where: dict[str, int] = {}
    for msg in messages:
        content = msg["content"]
        display_id = content.get("transient", {}).get("display_id")
        if msg["msg_type"] == "display_data":
            if display_id is not None:
                where[display_id] = len(outputs)
            outputs.append(dict(content["data"]))
        elif msg["msg_type"] == "update_display_data" and display_id in where:
            outputs[where[display_id]] = dict(content["data"])
    return outputs


def summaries(messages: list[dict[str, Any]]) -> list[str]:
    """The summary texts a cell ends with (the picture's output repeats only the first line)."""
    return [
        str(data["text/plain"])
        for data in final_outputs(messages)
        if str(data.get("text/plain", "")).startswith("nbaccel run ") and "image/png" not in data
    ]


def errors(messages: list[dict[str, Any]]) -> str:
    return "\n".join(
        "\n".join(m["content"]["traceback"]) for m in messages if m["msg_type"] == "error"
    )


def start_workers(kc: BlockingKernelClient, runs: Path, **options: Any) -> None:
    settings = "".join(f", {name}={value!r}" for name, value in options.items())
    reply, messages = cell_messages(
        kc,
        f"""
        %load_ext nbaccel
        import nbaccel
        workers = nbaccel.Workers(num_processes=2, runs_dir={str(runs)!r}{settings})
        """,
    )
    assert reply["status"] == "ok", errors(messages)


# ----- item 14: every metric the call logged is in its summary --------------------------
def test_a_cell_summary_holds_every_metric_the_cell_logged_and_no_other_cells(
    kernel: tuple[KernelManager, BlockingKernelClient], tmp_path: Path
) -> None:
    _, kc = kernel
    start_workers(kc, tmp_path / "runs", dashboard_after=60)  # these calls: summaries only
    # 42 metrics in a few ms: they leave the rank in one batch, after the call's output.
    reply, messages = cell_messages(
        kc,
        """
        %%nbaccel
        import nbaccel
        for step in range(42):
            nbaccel.log_metrics({"loss": 100.0 - step}, step=step)
        print("logged", step)
        """,
    )
    assert reply["status"] == "ok", errors(messages)
    texts = summaries(messages)
    assert len(texts) == 1, final_outputs(messages)
    assert "loss: last 59 at step 41, min 59 at step 41" in texts[0], texts[0]

    reply, messages = cell_messages(kc, "%%nbaccel\nprint('logs nothing')")
    assert reply["status"] == "ok", errors(messages)
    texts = summaries(messages)
    assert len(texts) == 1 and "logs nothing" in texts[0], final_outputs(messages)
    assert "loss:" not in texts[0], texts[0]  # nothing of the call before arrives here


# ----- item 15: a quiet short call in a loop displays nothing -----------------------------
def test_a_loop_of_quiet_calls_adds_nothing_but_a_call_that_prints_or_goes_on_shows(
    kernel: tuple[KernelManager, BlockingKernelClient], tmp_path: Path
) -> None:
    _, kc = kernel
    start_workers(kc, tmp_path / "runs")  # the widget dashboard, dashboard_after as default
    reply, messages = cell_messages(
        kc,
        """
        def quiet():
            return 1

        def talks():
            print("hello from a call")
            return 2

        workers.run(quiet), workers.run(talks)  # warm: the first calls' imports
        """,
    )
    assert reply["status"] == "ok", errors(messages)

    reply, messages = cell_messages(
        kc, "values = [workers.run(quiet) for _ in range(20)]\nvalues[-1]"
    )
    assert reply["status"] == "ok", errors(messages)
    kinds = [m["msg_type"] for m in messages]
    assert kinds == ["execute_result"], kinds  # nothing but the cell's value
    assert messages[0]["content"]["data"]["text/plain"] == "{0: 1, 1: 1}"

    # A call that printed keeps what it printed (its summary), as text would have.
    reply, messages = cell_messages(kc, "_ = workers.run(talks)")
    assert reply["status"] == "ok", errors(messages)
    texts = summaries(messages)
    assert len(texts) == 1 and "hello from a call" in texts[0], final_outputs(messages)
    assert not [m for m in messages if m["msg_type"] == "comm_open"]  # short: no widgets

    # A quiet call that goes on past dashboard_after gets its live widgets, then a summary.
    reply, messages = cell_messages(kc, "%%nbaccel\nimport time\ntime.sleep(1.5)")
    assert reply["status"] == "ok", errors(messages)
    outputs = final_outputs(messages)
    assert any(WIDGET_VIEW in data for data in outputs), outputs
    assert len(summaries(messages)) == 1, outputs


# ----- item 16: the stall warning stays in the summary, its duration as set ----------------
def test_the_stall_warning_is_in_the_saved_summary_with_its_own_duration(
    cells: Any, kernel_dirs: Path, tmp_path: Path
) -> None:
    nb = cells.notebook(
        [
            (
                "setup",
                "%load_ext nbaccel\nimport nbaccel\n"
                f"workers = nbaccel.Workers(num_processes=2, runs_dir={str(tmp_path / 'r')!r}, "
                "stall_warning=0.5, dashboard_after=60)",
            ),
            ("stall", "%%nbaccel\nimport time\ntime.sleep(2.5)\nprint('woke')"),
            ("close", "workers.close()"),
        ]
    )
    cells.execute(nb, tmp_path)
    for cell in nb.cells:
        cells.assert_ok(cell)
    texts = [
        str(out.data["text/plain"])
        for out in cells.cell(nb, "stall").outputs
        if out.output_type == "display_data"
        and "image/png" not in out.data
        and str(out.data.get("text/plain", "")).startswith("nbaccel run ")
    ]
    assert len(texts) == 1, cells.cell(nb, "stall").outputs
    # The quiet time as measured, rounded down: 0.5 s and a late pump's tenths, never "1 s".
    assert re.search(r"finished a step for 0\.[5-9] s \(stall_warning\)", texts[0]), texts[0]
    assert "rank 0: in <module> (<nbaccel cell " in texts[0], texts[0]  # where it was


# ----- item 23: a finished dashboard shows its pictures once, its Stop button ended --------
FINISHED = """
import nbaccel
from nbaccel.ui.attach import dashboard_for


def train(steps):
    import time

    for step in range(steps):
        nbaccel.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
        time.sleep(0.02)
    print("trained")


run = nbaccel.launch(train, args=(30,), num_processes=2, runs_dir=RUNS)
run.wait(120)
assert dashboard_for(run).wait_finished(30)
"""


def test_a_finished_dashboard_shows_its_pictures_once_and_its_stop_button_ended(
    cells: Any, kernel_dirs: Path, tmp_path: Path
) -> None:
    nb = cells.notebook(
        [
            ("setup", f"RUNS = {str(tmp_path / 'r')!r}"),
            ("launch", FINISHED.strip()),
        ]
    )
    cells.execute(nb, tmp_path)
    for cell in nb.cells:
        cells.assert_ok(cell)
    outputs = [dict(out.data) for out in cells.cell(nb, "launch").outputs if "data" in out]
    assert any(WIDGET_VIEW in data for data in outputs), outputs  # the live dashboard
    # The saved notebook keeps the summary: its text and its picture.
    assert any("image/png" in data for data in outputs), outputs
    assert any(str(data.get("text/plain", "")).startswith("nbaccel run ") for data in outputs)
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]

    def part(dom_class: str) -> dict[str, Any]:
        found = [
            m["state"] for m in state.values() if dom_class in m["state"].get("_dom_classes", [])
        ]
        assert len(found) == 1, (dom_class, found)
        return found[0]

    def shown(dom_class: str) -> bool:
        layout = part(dom_class)["layout"].removeprefix("IPY_MODEL_")
        return state[layout]["state"].get("display") != "none"

    # The curve and the memory bars once: in the summary's picture, not in the widgets too.
    assert not shown("nbaccel-curve") and not shown("nbaccel-memory")
    assert "succeeded" in part("nbaccel-header")["value"]
    stop = part("nbaccel-stop")
    assert stop["disabled"] and stop["button_style"] == "" and stop["description"] == "Ended", stop
