"""Interrupting the kernel while notebook_launcher blocks: every process goes, quickly.

A real ipykernel (jupyter_client) runs a cell that launches 2 ranks; each rank starts a
DataLoader worker (a grandchild of the launch) and records the pids, then spins in
all_reduce. The test interrupts the kernel as a user's ■ button would, then checks the
cell's KeyboardInterrupt, that every recorded process is gone, and that the next launch
runs at once on the same (still warm) helper.
"""

from __future__ import annotations

import json
import queue
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client import BlockingKernelClient, KernelManager

from tests.notebook.conftest import cell_output

STOP_SECONDS = 3.0  # interrupt -> every worker and DataLoader worker gone

SPIN_CELL = """
import nbaccel


class WorkerPids:
    # A map-style dataset whose items are the pid of the DataLoader worker that made them.
    def __len__(self):
        return 1 << 30

    def __getitem__(self, index):
        import os

        return os.getpid()


def spin(pid_dir):
    import json
    import os
    import time

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    items = iter(DataLoader(WorkerPids(), batch_size=None, num_workers=1))
    loader_pid = int(next(items))
    rank = dist.get_rank()
    record = {{"pid": os.getpid(), "ppid": os.getppid(), "loader_pids": [loader_pid]}}
    tmp = os.path.join(pid_dir, f".rank{{rank}}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(pid_dir, f"rank{{rank}}.json"))
    while True:
        next(items)
        dist.all_reduce(torch.ones(1))
        time.sleep(0.01)


nbaccel.notebook_launcher(spin, args=({pid_dir!r},), num_processes=2, runs_dir={runs!r})
"""

QUICK_CELL = """
import time as _time


def quick(x):
    import os

    import torch
    import torch.distributed as dist

    t = torch.tensor([float(x)])
    dist.all_reduce(t)
    return t.item(), os.getppid()


_started = _time.perf_counter()
QUICK = nbaccel.notebook_launcher(quick, args=(21,), num_processes=2, runs_dir={runs!r})
QUICK_SECONDS = _time.perf_counter() - _started
"""


def _reply(kc: BlockingKernelClient, msg_id: str, deadline: float) -> dict[str, Any] | None:
    """The execute_reply for ``msg_id``, or None if it has not come by ``deadline``."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        try:
            msg = kc.get_shell_msg(timeout=min(remaining, 0.2))
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_reply":
            return msg["content"]  # type: ignore[no-any-return]


def _iopub_text(kc: BlockingKernelClient, msg_id: str, timeout: float = 10) -> str:
    """The cell's stream and error output, read until the kernel goes idle after it."""
    text, errors, _ = cell_output(kc, msg_id, time.monotonic() + timeout)
    return text + "".join("\n".join(error["traceback"]) for error in errors)


def _running(pid: int) -> bool:
    """True while ``pid`` is a live process (a zombie has already exited)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for_records(
    kc: BlockingKernelClient, msg_id: str, pid_dir: Path, timeout: float
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        files = sorted(pid_dir.glob("rank*.json"))
        if len(files) == 2:
            return [json.loads(f.read_text()) for f in files]
        reply = _reply(kc, msg_id, min(deadline, time.monotonic() + 0.1))
        if reply is not None:
            pytest.fail(
                f"the spinning cell ended before both ranks started ({reply['status']}):\n"
                + _iopub_text(kc, msg_id)
            )
        if time.monotonic() >= deadline:
            pytest.fail(f"ranks wrote {len(files)} of 2 pid records within {timeout} s")


@pytest.mark.timeout(300)
def test_interrupt_stops_every_process_and_the_next_launch_is_warm(
    kernel: tuple[KernelManager, BlockingKernelClient], tmp_path: Path
) -> None:
    km, kc = kernel
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    runs = str(tmp_path / "runs")
    pids: list[int] = []
    try:
        # stop_on_error=False: after a failed request ipykernel aborts the requests it receives
        # until a "stop aborting" message it queues for itself comes through, so the next
        # cell, sent as soon as this reply arrives, could be answered "aborted" under load.
        msg_id = kc.execute(
            textwrap.dedent(SPIN_CELL).format(pid_dir=str(pid_dir), runs=runs),
            stop_on_error=False,
        )
        records = _wait_for_records(kc, msg_id, pid_dir, timeout=180)
        helper_pids = {r["ppid"] for r in records}
        pids = [r["pid"] for r in records] + [p for r in records for p in r["loader_pids"]]
        assert len(helper_pids) == 1, records
        assert len(set(pids)) == 4, records
        assert all(_running(pid) for pid in pids), "a worker died before the interrupt"

        km.interrupt_kernel()
        interrupted = time.monotonic()

        while any(_running(pid) for pid in pids) and time.monotonic() < interrupted + 30:
            time.sleep(0.01)
        elapsed = time.monotonic() - interrupted
        left = [pid for pid in pids if _running(pid)]
        assert not left, f"still running 30 s after the interrupt: {left} of {records}"
        assert elapsed <= STOP_SECONDS, f"workers took {elapsed:.2f} s to stop"

        reply = _reply(kc, msg_id, interrupted + 60)
        assert reply is not None, "the cell did not return within 60 s of the interrupt"
        assert reply["status"] == "error", reply
        assert reply["ename"] == "KeyboardInterrupt", _iopub_text(kc, msg_id)
        # It says what nbaccel did (a bare KeyboardInterrupt said nothing in text mode).
        said = "interrupted: nbaccel stopped the 2 workers of run "
        assert reply["evalue"].startswith(said), reply["evalue"]
        # The helper (a subreaper) reaps its workers and the orphaned DataLoader workers.
        reap_deadline = time.monotonic() + 10
        while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < reap_deadline:
            time.sleep(0.02)
        assert not [pid for pid in pids if psutil.pid_exists(pid)], "zombies were not reaped"
        # The interrupt was the kernel's alone: the warm helper survives it.
        [helper_pid] = helper_pids
        assert _running(helper_pid), "the interrupt killed the helper"

        msg_id = kc.execute(
            textwrap.dedent(QUICK_CELL).format(runs=runs),
            user_expressions={"value": "QUICK", "seconds": "QUICK_SECONDS"},
        )
        reply = _reply(kc, msg_id, time.monotonic() + 120)
        assert reply is not None, "the launch after the interrupt did not finish in 120 s"
        assert reply["status"] == "ok", _iopub_text(kc, msg_id)
        expressions = reply["user_expressions"]
        assert expressions["value"]["data"]["text/plain"] == f"(42.0, {helper_pid})"
        seconds = float(expressions["seconds"]["data"]["text/plain"])
        # A warm launch is a fork (~0.1 s); restarting the helper would import torch again.
        assert seconds < 10, f"the launch after the interrupt took {seconds:.1f} s"
    finally:
        for pid in pids:  # only if the test failed: never leave spinning workers behind
            if _running(pid):
                try:
                    psutil.Process(pid).kill()
                except psutil.NoSuchProcess:
                    pass
