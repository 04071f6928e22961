"""A restartable one-machine run (``max_restarts``: torch elastic under the nbaccel agent)
listens on loopback only, as a run without restarts does (``test_network_and_files.py``):
the agent (elastic's rendezvous) and every worker (rank 0's store, gloo), in the first
attempt and in the attempt after a restart."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import nbaccel

pytestmark = pytest.mark.timeout(300)

RUN_TIMEOUT_S = 180.0
LOOPBACK = ("127.0.0.1", "::1")


def hold_until_told(folder: str) -> dict[str, Any]:
    """Bring gloo up, say so with a file, and wait for the test's go-ahead file. In the first
    attempt, rank 1 then SIGKILLs itself: elastic restarts both ranks."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    dist.all_reduce(torch.ones(1))  # every gloo pair and the store are up
    ready = Path(folder, f"ready-{attempt}-{rank}")
    ready.with_suffix(".tmp").write_text(str(os.getpid()))
    ready.with_suffix(".tmp").rename(ready)  # whole, or not there at all
    go = Path(folder, f"go-{attempt}")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{go} did not appear within {RUN_TIMEOUT_S} s")
        time.sleep(0.02)  # polling the file: the test's answer comes when it comes
    if attempt == "0" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return {"attempt": attempt, "pid": os.getpid()}


def wait_for_ready(run: nbaccel.Run, folder: Path, attempt: int) -> list[int]:
    """The pids of both ranks' workers of ``attempt``, once gloo is up in both."""
    files = [folder / f"ready-{attempt}-{rank}" for rank in (0, 1)]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not all(f.exists() for f in files):
        assert not run.state.done, run.error
        assert time.monotonic() < deadline, f"attempt {attempt}: the ranks did not start"
        with contextlib.suppress(TimeoutError):
            run.wait(0.05)  # returns early if the run ends
    return [int(f.read_text()) for f in files]


def listening(process: psutil.Process) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in process.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def check_loopback_only(worker_pids: list[int]) -> None:
    workers = [psutil.Process(pid) for pid in worker_pids]
    agent = workers[0].parent()
    assert agent is not None
    assert "nbaccel.launcher.remote.agent_main" in " ".join(agent.cmdline())
    assert all(w.parent() == agent for w in workers)  # elastic forks them from the agent
    seen = {f"agent {agent.pid}": listening(agent)}
    seen |= {f"rank {rank} ({w.pid})": listening(w) for rank, w in enumerate(workers)}
    # Rank 0 serves the workers' store: a check that finds no socket at all proves nothing.
    assert seen[f"rank 0 ({workers[0].pid})"], seen
    exposed = {who: s for who, s in seen.items() if any(ip not in LOOPBACK for ip, _ in s)}
    assert not exposed, f"listening beyond loopback: {exposed} (all: {seen})"


def test_a_restartable_run_listens_on_loopback_only_before_and_after_a_restart(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "sync"
    folder.mkdir()
    run = nbaccel.launch(
        hold_until_told,
        args=(str(folder),),
        num_processes=2,
        use_cpu=True,
        max_restarts=1,
        dashboard=False,
        runs_dir=str(tmp_path / "runs"),
    )
    try:
        first = wait_for_ready(run, folder, 0)
        check_loopback_only(first)
        (folder / "go-0").touch()
        second = wait_for_ready(run, folder, 1)
        assert not set(first) & set(second)  # new workers: elastic restarted both ranks
        check_loopback_only(second)
        (folder / "go-1").touch()
        results = run.results(timeout=RUN_TIMEOUT_S)
    finally:
        run.stop(timeout=30)
    assert [results[r] for r in (0, 1)] == [
        {"attempt": "1", "pid": second[0]},
        {"attempt": "1", "pid": second[1]},
    ]
