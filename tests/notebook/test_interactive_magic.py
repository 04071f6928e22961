"""``%%nbaccel`` in a real ipykernel (jupyter_client): state kept between cells on the same
pids, a failing rank named, an interrupt that stops the cell and not the workers, and a
dying kernel that takes its workers with it."""

from __future__ import annotations

import ast
import os
import queue
import signal
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client import BlockingKernelClient, KernelManager

from tests.notebook.conftest import cell_output, strip_ansi

pytestmark = pytest.mark.timeout(300)


def _reply(kc: BlockingKernelClient, msg_id: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_shell_msg(timeout=0.2)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_reply":
            return msg["content"]  # type: ignore[no-any-return]
    raise AssertionError(f"no reply within {timeout} s")


def run_cell(
    kc: BlockingKernelClient, code: str, timeout: float = 120, **expressions: str
) -> tuple[dict[str, Any], str]:
    """Run ``code``; its execute_reply and all it printed (errors' tracebacks included)."""
    msg_id = kc.execute(textwrap.dedent(code), stop_on_error=False, user_expressions=expressions)
    reply = _reply(kc, msg_id, timeout)
    text, errors, _ = cell_output(kc, msg_id, time.monotonic() + 10)
    text += "".join(strip_ansi("\n".join(e["traceback"])) for e in errors)
    if reply.get("status") == "ok" and "result" in expressions:
        text += "\nOut: " + expression(reply, "result")
    return reply, text


def expression(reply: dict[str, Any], name: str) -> str:
    return str(reply["user_expressions"][name]["data"]["text/plain"])


def gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(pid) for pid in pids)


def wait_for(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def test_cells_keep_state_fail_by_rank_take_interrupts_and_die_with_the_kernel(
    kernel: tuple[KernelManager, BlockingKernelClient], tmp_path: Path
) -> None:
    km, kc = kernel
    reply, text = run_cell(
        kc,
        f"""
        %load_ext nbaccel
        import nbaccel
        workers = nbaccel.Workers(
            num_processes=2, dashboard="text", runs_dir={str(tmp_path / "runs")!r}
        )
        PIDS = sorted(workers.pids.values())
        import os
        """,
        pids="PIDS",
        kernel_pid="os.getpid()",
    )
    assert reply["status"] == "ok", text
    pids = [int(p) for p in expression(reply, "pids").strip("[]").split(",")]
    kernel_pid = int(expression(reply, "kernel_pid"))

    reply, text = run_cell(
        kc,
        """
        %%nbaccel
        import os, torch
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        built_by = os.getpid()
        print("built on rank", torch.distributed.get_rank())
        """,
    )
    assert reply["status"] == "ok", text
    assert "built on rank 0" in text and "rank 1" not in text  # rank 0's output, as a launch

    reply, text = run_cell(
        kc,
        """
        %%nbaccel --ranks all
        print("same process", built_by == os.getpid())
        tuple(model.weight.shape)
        """,
        result="_",
    )
    assert reply["status"] == "ok", text
    assert "same process True" in text and "[rank 1] same process True" in text
    assert "Out: (1, 4)" in text  # the last line's value, rank 0's, as the cell's Out

    reply, text = run_cell(
        kc,
        """
        %%nbaccel
        if torch.distributed.get_rank() == 1:
            raise ValueError("rank one is unhappy")
        """,
    )
    assert reply["status"] == "error" and reply["ename"] == "ValueError", text
    assert "[rank 1] rank one is unhappy" in reply["evalue"]
    assert 'raise ValueError("rank one is unhappy")' in text  # the cell's line, remote

    started = tmp_path / "started"
    msg_id = kc.execute(
        f"%%nbaccel\nimport pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(600)",
        stop_on_error=False,
    )
    wait_for(started.exists, 60, "the long cell to start")
    km.interrupt_kernel()
    reply = _reply(kc, msg_id, 60)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply

    reply, text = run_cell(kc, "%%nbaccel\nos.getpid() == built_by", result="_")
    assert reply["status"] == "ok", text
    assert "Out: True" in text  # the next cell ran on the same processes, state intact
    assert not gone(pids)

    os.kill(kernel_pid, signal.SIGKILL)  # a dying kernel: no clean-up of its own
    wait_for(lambda: gone(pids), 30, "the workers to end with their kernel")


STATE = "(threading.active_count(), psutil.Process().num_fds(), len(psutil.Process().children()))"


def test_twenty_cells_with_dashboards_leak_nothing_in_the_kernel(
    kernel: tuple[KernelManager, BlockingKernelClient], tmp_path: Path
) -> None:
    _, kc = kernel
    reply, text = run_cell(
        kc,
        f"""
        %load_ext nbaccel
        import threading, psutil, nbaccel
        workers = nbaccel.Workers(num_processes=2, runs_dir={str(tmp_path / "runs")!r})
        """,
    )
    assert reply["status"] == "ok", text
    cell = "%%nbaccel\nimport torch\nx = torch.ones(4)\nprint('step', x.sum().item())"
    for _ in range(2):  # warm: the first dashboards load ipywidgets and matplotlib
        assert run_cell(kc, cell)[0]["status"] == "ok"
    reply, _ = run_cell(kc, "pass", state=STATE)
    before = ast.literal_eval(expression(reply, "state"))
    for index in range(20):
        reply, text = run_cell(kc, cell if index % 5 else "%%nbaccel\n1 / 0")
        assert reply["status"] == ("ok" if index % 5 else "error"), text
    deadline = time.monotonic() + 15  # the last dashboards' threads end after their summary
    while True:  # none more than before (a file the first dashboards opened may be closed)
        after = ast.literal_eval(expression(run_cell(kc, "pass", state=STATE)[0], "state"))
        if all(a <= b for a, b in zip(after, before, strict=True)):
            break
        assert time.monotonic() < deadline, f"threads, fds, children: {before} -> {after}"
    reply, text = run_cell(kc, "sorted(workers.run(lambda: 1))", result="_")
    assert "Out: [0, 1]" in text, text
