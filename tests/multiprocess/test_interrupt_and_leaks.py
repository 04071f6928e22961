"""Interrupts stop the whole tree fast; many launches in a row leave nothing behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

import nbaccel
from nbaccel.launcher.local.helper import shared_helper

pytestmark = pytest.mark.timeout(240)
INTERRUPT_BOUND_SECONDS = 15.0  # 5x the 3-second goal

INTERRUPTED_SCRIPT = """
import os, signal, sys, time, nbaccel
# A shell's background job starts with SIGINT ignored (Python keeps that): give this
# process the handler a terminal or a Jupyter kernel has, whatever started the tests.
signal.signal(signal.SIGINT, signal.default_int_handler)
PIDS = sys.argv[1]

def train():
    import torch, torch.distributed as dist
    from torch.utils.data import DataLoader
    loader = DataLoader(list(range(10_000)), batch_size=1, num_workers=1, persistent_workers=True)
    batches = iter(loader)
    next(batches)                                   # the DataLoader worker is up
    import psutil
    kids = [p.pid for p in psutil.Process().children(recursive=True)]
    with open(f"{PIDS}.{dist.get_rank()}.tmp", "w") as f:
        f.write(" ".join(map(str, [os.getpid(), *kids])))
    os.rename(f"{PIDS}.{dist.get_rank()}.tmp", f"{PIDS}.{dist.get_rank()}")
    while True:
        dist.all_reduce(torch.ones(1))
        next(batches)

try:
    nbaccel.notebook_launcher(train, num_processes=2)
except KeyboardInterrupt as interrupt:
    print("INTERRUPTED", interrupt, flush=True)
def again():
    return 42
print("NEXT", nbaccel.notebook_launcher(again, num_processes=2), flush=True)
"""


def wait_for(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_interrupt_stops_workers_and_grandchildren(tmp_path: Path) -> None:
    pids_prefix = str(tmp_path / "pids")
    parent = subprocess.Popen(
        [sys.executable, "-", pids_prefix],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    assert parent.stdin is not None
    parent.stdin.write(textwrap.dedent(INTERRUPTED_SCRIPT))
    parent.stdin.close()
    try:
        wait_for(lambda: all(os.path.exists(f"{pids_prefix}.{r}") for r in (0, 1)), 60, "pid files")
        pids = [int(p) for r in (0, 1) for p in Path(f"{pids_prefix}.{r}").read_text().split()]
        assert len(pids) >= 4  # two workers and at least one DataLoader worker each
        assert all(alive(pid) for pid in pids)
        parent.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        # The goal is 3 s (benchmarks/interrupt_latency.py reports it); a loaded 2-core CI
        # machine gets 5x that here, so this catches a stop that hangs, not a slow one.
        wait_for(
            lambda: not any(alive(pid) for pid in pids),
            INTERRUPT_BOUND_SECONDS,
            "workers and grandchildren to die",
        )
        assert time.monotonic() - interrupted < INTERRUPT_BOUND_SECONDS
        parent.wait(timeout=60)  # its output is small: the pipes cannot fill up
        assert parent.stdout is not None and parent.stderr is not None
        out, err = parent.stdout.read(), parent.stderr.read()
    finally:
        parent.kill()
    # The interrupt says the workers were stopped (in text mode nothing else does): how many,
    # in what time, where their output is.
    said = re.search(r"INTERRUPTED interrupted: nbaccel stopped the 2 workers of run (\S+) ", out)
    assert said is not None, out + err
    assert re.search(r"\(and what they started\) in \d+\.\d\d s; their output is in ", out)
    assert "NEXT 42" in out, err


def outcome(kind: str) -> int:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        if kind == "raise":
            raise ValueError("planned")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "exit":
            os._exit(2)
    dist.all_reduce(torch.ones(1))
    return 1


def descendants_state() -> tuple[int, list[psutil.Process]]:
    helper = psutil.Process(shared_helper().pid)
    return helper.pid, helper.children(recursive=True)


def test_twenty_launches_leave_no_process_thread_fd_or_port(runs_dir: str) -> None:
    me = psutil.Process()
    nbaccel.notebook_launcher(outcome, args=("ok",), num_processes=2, runs_dir=runs_dir)  # warm
    fds, threads = me.num_fds(), threading.active_count()
    listening_before = frozenset(listening_sockets(me, descendants_state()[0], timeout=0))
    kinds = ["ok", "raise", "ok", "kill", "exit"] * 4
    for kind in kinds:
        run = nbaccel.launch(outcome, args=(kind,), num_processes=2, runs_dir=runs_dir)
        expected = nbaccel.RunState.SUCCEEDED if kind == "ok" else nbaccel.RunState.FAILED
        assert run.wait(60) is expected, run.error
    assert me.num_fds() == fds
    assert threading.active_count() == threads
    helper_pid, descendants = descendants_state()
    helper_session = os.getsid(helper_pid)
    for process in descendants:  # only idle spares remain: still in the helper's session
        assert process.ppid() == helper_pid
        assert os.getsid(process.pid) == helper_session, process
        assert process.status() != psutil.STATUS_ZOMBIE
    assert len(descendants) <= 16
    assert listening_sockets(me, helper_pid, timeout=10, before=listening_before) == []
    assert len(list(Path(runs_dir).glob("*/config.json"))) == 21  # the runs


def listening_sockets(
    me: psutil.Process, helper_pid: int, timeout: float, before: frozenset[str] = frozenset()
) -> list[str]:
    """The TCP sockets listening in this process, the helper or its children that were not
    in ``before``, waited for up to ``timeout`` s: a rank 0 that a failed run took down may
    still be closing its rendezvous socket when the run reports FAILED. ``before`` holds
    what earlier tests in the same process left (``make test-newest`` runs the unit tests
    first, whose in-process gloo groups keep a listener until they are collected)."""
    deadline = time.monotonic() + timeout
    while True:
        found = []
        helper = psutil.Process(helper_pid)
        for process in [me, helper, *helper.children(recursive=True)]:
            try:
                connections = process.net_connections(kind="inet")
                name = " ".join(process.cmdline()[:4])
            except psutil.NoSuchProcess:
                continue  # gone meanwhile: nothing of it listens
            found += [
                f"pid {process.pid} ({name}): {c.laddr}"
                for c in connections
                if c.status == psutil.CONN_LISTEN
                and f"pid {process.pid} ({name}): {c.laddr}" not in before
            ]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)  # polling an outside condition, bounded by the deadline


def start_detached_children(pid_file: str) -> int:
    """Leave behind what a careless user might: children in sessions of their own (one of
    them ignores SIGTERM, one has a child of its own), then return at once."""
    import subprocess
    import sys

    ignore_term = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    )
    with_child = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print(p.pid, flush=True); time.sleep(600)"
    )
    plain = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    stubborn = subprocess.Popen([sys.executable, "-c", ignore_term], start_new_session=True)
    parent = subprocess.Popen(
        [sys.executable, "-c", with_child],
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    grandchild = int(parent.stdout.readline())
    pids = [plain.pid, stubborn.pid, parent.pid, grandchild]
    with open(pid_file + ".tmp", "w") as file:
        file.write(" ".join(map(str, pids)))
    os.rename(pid_file + ".tmp", pid_file)
    return len(pids)


def test_children_that_left_the_worker_session_end_with_the_run(
    runs_dir: str, tmp_path: Path
) -> None:
    pid_file = str(tmp_path / "pids")
    run = nbaccel.launch(start_detached_children, args=(pid_file,), runs_dir=runs_dir)
    assert run.result(timeout=60) == 4
    pids = [int(p) for p in Path(pid_file).read_text().split()]
    # SIGTERM when the run ends, SIGKILL one second later for the one that ignores it.
    wait_for(lambda: not any(alive(pid) for pid in pids), 15.0, "detached children to end")
    helper = psutil.Process(shared_helper().pid)

    def reaped() -> bool:  # the helper collects their exit statuses too
        return not any(pid in pids for pid in (p.pid for p in helper.children(recursive=True)))

    wait_for(reaped, 15.0, "the helper to reap them")
    # The helper is fine afterwards: the next launch runs.
    assert nbaccel.notebook_launcher(outcome, args=("ok",), num_processes=2, runs_dir=runs_dir)
