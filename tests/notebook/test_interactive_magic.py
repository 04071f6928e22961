"""``%%nbaccel`` in a real ipykernel (jupyter_client): state kept between cells on the same
pids, a failing rank named, an interrupt that stops the cell and not the workers, and a
dying kernel that takes its workers with it."""

from __future__ import annotations

import ast
import html
import os
import queue
import re
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
        workers = nbaccel.Workers(
            num_processes=2, runs_dir={str(tmp_path / "runs")!r}, dashboard_after=0
        )
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


def test_errors_name_the_cell_hide_nbaccel_and_refuse_what_cannot_run(
    kernel: tuple[KernelManager, BlockingKernelClient], tmp_path: Path
) -> None:
    _, kc = kernel
    reply, text = run_cell(
        kc,
        f"""
        %load_ext nbaccel
        import nbaccel
        workers = nbaccel.Workers(
            num_processes=2, dashboard="text", runs_dir={str(tmp_path / "runs")!r}
        )
        """,
    )
    assert reply["status"] == "ok", text

    reply, text = run_cell(kc, "%%nbaccel\nx = 1\nif x:\n    1 / 0\n")
    assert reply["status"] == "error" and reply["ename"] == "ZeroDivisionError", text
    number = reply["execution_count"]  # the In [N] the user sees
    # The worker's traceback names the cell as the user knows it...
    assert f'File "<nbaccel cell {number}>", line 3, in <module>' in text, text
    assert f"<nbaccel cell {number + 1}>" not in text, text
    # ...and then the cell's line, and the line that failed on the rank: no frame of nbaccel.
    after = text.split("The above exception was the direct cause")[-1]
    assert after.index(f"Cell In[{number}], line 1") < after.index(f"<nbaccel cell {number}>:3")
    assert "----> 3     1 / 0" in after, text
    for own in ("magic.py", "workers.py", "calls.py", "nbaccel/"):
        assert own not in after, text

    # workers.run(f) from a cell: the traceback ends at f's line that failed on the rank.
    reply, text = run_cell(kc, "def f():\n    return 1 / 0\n\nworkers.run(f)\n")
    assert reply["status"] == "error" and reply["ename"] == "ZeroDivisionError", text
    after = text.split("The above exception was the direct cause")[-1]
    number = reply["execution_count"]
    assert after.count(f"Cell In[{number}]") == 2, text  # the call, then f's line
    assert after.index("----> 4 workers.run(f)") < after.index("----> 2     return 1 / 0"), text
    for own in ("workers.py", "calls.py", "nbaccel/"):
        assert own not in after, text

    # Refused before anything is sent: IPython syntax, ranks the workers do not have.
    ran = tmp_path / "ran"
    touch = f"import pathlib\npathlib.Path({str(ran)!r}).touch()\n"
    for cell, said in (
        (f"%%nbaccel\n{touch}!ls\n", "line 3 of the cell, `!ls`, is IPython syntax (a shell"),
        (f"%%nbaccel\n{touch}for i in range(2):\n    %time i\n", "`%time i`, is IPython syntax"),
        (f"%%nbaccel\n{touch}help = len?\n", "(a help request (?))"),
        (f"%%nbaccel --ranks 5\n{touch}", "names rank 5, but these workers have ranks 0 and 1"),
        (f"%%nbaccel --ranks one\n{touch}", "--ranks one: expected 'all' or a comma list"),
    ):
        reply, text = run_cell(kc, cell)
        assert reply["status"] == "error" and reply["ename"] == "UsageError", text
        assert said in text, text
    assert "does not run on the ranks" in run_cell(kc, "%%nbaccel\n!ls\n")[1]
    assert not ran.exists()

    reply, text = run_cell(kc, "lr = 0.1")
    reply, text = run_cell(kc, "%%nbaccel\nprint(lr)\n")
    assert reply["status"] == "error" and reply["ename"] == "NameError", text
    assert "'lr' is defined in this kernel, but not on the ranks" in text, text
    assert "workers.push(lr=lr)" in text, text


def test_cell_shows_every_asked_rank_in_its_widget_dashboard(
    cells: Any, kernel_dirs: Path, tmp_path: Path
) -> None:
    nb = cells.notebook(
        [
            (
                "setup",
                "%load_ext nbaccel\nimport nbaccel\n"
                "workers = nbaccel.Workers(num_processes=2, dashboard_after=0, "
                f"runs_dir={str(tmp_path / 'r')!r})",  # widgets at once: these calls are short
            ),
            (
                "all",
                "%%nbaccel --ranks all\nimport torch.distributed as dist\n"
                "print('hello from rank', dist.get_rank())",
            ),
            ("default", "%%nbaccel\nprint('again from rank', dist.get_rank())"),
            ("close", "workers.close()"),
        ]
    )
    cells.execute(nb, tmp_path)
    for cell in nb.cells:
        cells.assert_ok(cell)
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    logs = [
        html.unescape(re.sub(r"<[^>]+>", "", str(model["state"].get("value", ""))))
        for model in state.values()
        if "nbaccel-log" in model["state"].get("_dom_classes", [])
    ]
    asked = [log for log in logs if "hello from rank" in log]
    assert len(asked) == 1, logs  # the --ranks all cell's dashboard
    assert "hello from rank 0" in asked[0] and "[rank 1] hello from rank 1" in asked[0], asked
    default = [log for log in logs if "again from rank" in log]
    assert default and "again from rank 1" not in default[0], logs  # log_ranks: rank 0's
    summaries = [  # the summary's text (its image says the first line again)
        out.data["text/plain"]
        for out in cells.cell(nb, "all").outputs
        if out.output_type == "display_data"
        and "image/png" not in out.data
        and out.data.get("text/plain", "").startswith("nbaccel run ")
    ]
    assert len(summaries) == 1 and "[rank 1] hello from rank 1" in summaries[0], summaries
