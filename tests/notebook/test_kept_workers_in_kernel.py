"""``keep_workers`` in a real ipykernel with the widget dashboard: the training cell's ranks
answer the next ``%%nbaccel`` cell with the model they trained, the kept workers' panel shows
them, the training cell run again releases the old group first, and Release ends them."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest
from jupyter_client import BlockingKernelClient, KernelManager

from tests.notebook.test_interactive_magic import expression, run_cell

pytestmark = pytest.mark.timeout(300)


def wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise AssertionError(f"workers {pids} still alive after {timeout} s")
        time.sleep(0.02)


TRAIN = """
%load_ext nbaccel
import os, sys, nbaccel

def train():
    import torch
    from nbaccel import Accelerator
    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    for _ in range(3):
        acc.backward(model(torch.ones(2, 4)).pow(2).mean())
        opt.step(); opt.zero_grad()
    return {"pid": os.getpid(), "model": acc.unwrap_model(model)}
"""

LAUNCH = """
value = nbaccel.notebook_launcher(
    train, num_processes=2, use_cpu=True, keep_workers=True, runs_dir={runs!r}
)
PIDS = sorted(nbaccel.last_workers().pids.values())
"""


def test_kept_workers_evaluate_in_the_next_cell_and_release_from_the_panel(
    kernel: tuple[KernelManager, BlockingKernelClient], tmp_path: Path
) -> None:
    _, kc = kernel
    runs = str(tmp_path / "runs")
    reply, text = run_cell(kc, TRAIN + LAUNCH.format(runs=runs), pids="PIDS")
    assert reply["status"] == "ok", text
    first = [int(p) for p in expression(reply, "pids").strip("[]").split(",")]
    assert len(first) == 2

    reply, text = run_cell(
        kc,
        """
        %%nbaccel
        import torch
        out = result["model"](torch.ones(1, 4)).item()   # the trained model, on every rank
        print(f"evaluated on {os.getpid()}")
        round(out, 6)
        """,
        check="value['pid'] in PIDS",
        out="nbaccel.last_workers().pull('out')",
    )
    assert reply["status"] == "ok", text
    assert expression(reply, "check") == "True"  # the ranks that trained answered
    evaluated = expression(reply, "out")
    assert evaluated.startswith("{0: ") and evaluated.count(evaluated[4:12]) == 2, evaluated

    # The panel under the dashboard shows the kept group.
    reply, text = run_cell(
        kc,
        "panel = nbaccel.last_workers()._watchers[0].__self__",
        label="panel.label.value",
        button="panel.button.description",
    )
    assert reply["status"] == "ok", text
    assert "2 workers kept" in expression(reply, "label")
    assert expression(reply, "button") == "'Release'"

    # The training cell, run again: the old group is released before the new one trains.
    reply, text = run_cell(kc, LAUNCH.format(runs=runs), pids="PIDS")
    assert reply["status"] == "ok", text
    assert "released the workers kept by run" in text
    wait_gone(first, 10)
    second = [int(p) for p in expression(reply, "pids").strip("[]").split(",")]
    assert not set(second) & set(first)
    assert "released" in expression(*run_cell(kc, "", label="panel.label.value")[:1], "label")

    # Release from the new panel: its processes end, the next call says so.
    reply, text = run_cell(
        kc,
        """
        panel = nbaccel.last_workers()._watchers[0].__self__
        panel.button.click()
        try:
            nbaccel.last_workers().run(os.getpid)
        except nbaccel.WorkersEnded as ended:
            said = str(ended)
        """,
        said="said",
        disabled="panel.button.disabled",
    )
    assert reply["status"] == "ok", text
    assert "Release button" in expression(reply, "said")
    assert expression(reply, "disabled") == "True"
    wait_gone(second, 10)
