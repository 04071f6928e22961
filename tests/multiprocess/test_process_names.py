"""Each of nbaccel's background processes is named for what it is in ps, top and nvidia-smi:
the helper, its base (whose parent is init), its idle spares and every worker, in both
``/proc/<pid>/comm`` and the command line (issue 39, item 20)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

import nbaccel
from nbaccel.launcher.local.helper import shared_helper

pytestmark = pytest.mark.timeout(180)

APPEAR_TIMEOUT_S = 60.0  # spares are forked at the helper's first idle turn after a run


def own_names() -> tuple[str, str]:
    with open("/proc/self/comm") as comm, open("/proc/self/cmdline", "rb") as cmdline:
        return comm.read().strip(), cmdline.read().split(b"\0")[0].decode()


def names_of_rank_and_child() -> list[tuple[str, str]]:
    """The rank's names, and those of a process it forks (as a DataLoader's workers are)."""
    import json

    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(write, json.dumps(own_names()).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        forked = json.loads(pipe.read())
    os.waitpid(child, 0)
    return [own_names(), tuple(forked)]


def names(pid: int) -> tuple[str, str]:
    comm = Path(f"/proc/{pid}/comm").read_text().strip()
    return comm, Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()


def spares_of(helper_pid: int) -> list[tuple[str, str]]:
    found = []
    for child in psutil.Process(helper_pid).children():
        try:
            found.append(names(child.pid))
        except OSError:
            pass  # a spare that went meanwhile
    return found


def test_the_helper_its_base_spares_and_workers_say_what_they_are(runs_dir: str) -> None:
    run = nbaccel.launch(names_of_rank_and_child, num_processes=2, runs_dir=runs_dir)
    results = run.results(timeout=120)
    for rank in (0, 1):
        assert results[rank][0] == (
            f"nbaccel rank {rank}",
            f"nbaccel rank {rank} (run {run.run_id})",
        )
        child = ("nbaccel child", f"nbaccel child of rank {rank} (run {run.run_id})")
        assert tuple(results[rank][1]) == child  # not a second "rank N"

    helper = shared_helper()
    assert helper.wait_ready(60)
    me = os.getpid()
    assert names(helper.pid) == ("nbaccel helper", f"nbaccel helper (for pid {me})")

    deadline = time.monotonic() + APPEAR_TIMEOUT_S
    while helper._base is None or not spares_of(helper.pid):  # bounded: polls the helper
        assert time.monotonic() < deadline, "no base or spare after the run ended"
        time.sleep(0.02)
    assert names(helper._base) == ("nbaccel base", f"nbaccel base (next helper for pid {me})")
    assert psutil.Process(helper._base).ppid() != helper.pid  # outside the helper's tree
    spare = ("nbaccel spare", f"nbaccel spare (for pid {me})")
    assert set(spares_of(helper.pid)) == {spare}
