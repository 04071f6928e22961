"""What a several-hosts launch listens on (issue 23): nothing of it on every interface of a
host. The rendezvous store on the first host (torch's TCPStore would bind 0.0.0.0 / ::)
listens at the address the hosts were given for it, as does the workers' store of c10d's
rendezvous (with max_restarts), served by rank 0. The hosts are 127.0.0.2 and 127.0.0.3 of
this machine, behind the real sshd of conftest.py; each rank reports what its agent's process
tree (the agent, its workers) listens on while every rank is inside the function."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

import nbaccel
from tests.multihost.conftest import SshHosts

RUN_TIMEOUT_S = 180.0
EVERY_INTERFACE = ("0.0.0.0", "::")


def listeners_of_my_host() -> dict[str, Any]:
    """The listening TCP sockets of this worker's agent and of all its children, and the
    workers' store (the rendezvous store without restarts, rank 0's with them)."""
    import os

    import psutil
    import torch.distributed as dist

    dist.barrier()  # every rank is up: every store and gloo socket exists
    agent = psutil.Process(os.getppid())
    found = set()
    for process in [agent, *agent.children(recursive=True)]:
        try:
            connections = process.net_connections("tcp")
        except psutil.NoSuchProcess:
            continue
        found |= {(c.laddr.ip, c.laddr.port) for c in connections if c.status == "LISTEN"}
    dist.barrier()  # no rank leaves (and no store closes) before all have looked
    store = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return {"listening": sorted(found), "store": store}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("max_restarts", [0, 1], ids=["static", "c10d"])
def test_nothing_of_a_launch_on_two_hosts_listens_on_every_interface(
    ssh_hosts: SshHosts, tmp_path: Path, max_restarts: int
) -> None:
    settings: dict[str, Any] = {
        "hosts": list(ssh_hosts.hosts),
        "ssh_options": shlex.join(ssh_hosts.ssh_options),
        "remote_python": sys.executable,
        "runs_dir": str(tmp_path),
        "use_cpu": True,
        "max_restarts": max_restarts,
    }
    run = nbaccel.launch(listeners_of_my_host, num_processes=4, dashboard=False, **settings)
    assert run.wait(RUN_TIMEOUT_S) is nbaccel.RunState.SUCCEEDED, run.error
    results = run.results()
    for rank, found in results.items():
        listening = [tuple(where) for where in found["listening"]]
        everywhere = [(ip, port) for ip, port in listening if ip in EVERY_INTERFACE]
        assert everywhere == [], f"on {run.host_of(rank)}: {everywhere} (all: {listening})"
    # The workers' store listens at the address its host was given, where they all reach it.
    store = tuple(results[0]["store"])
    assert all(tuple(found["store"]) == store for found in results.values()), results
    serving = [rank for rank in results if run.host_of(rank) == store[0]]
    assert serving and store in [tuple(w) for w in results[serving[0]]["listening"]], results
    if not max_restarts:  # the rendezvous store itself, on the first host
        assert store[0] == ssh_hosts.hosts[0]
