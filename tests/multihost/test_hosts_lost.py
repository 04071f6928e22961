"""A host whose SSH connection is lost mid-run (its ssh client killed on this machine): the
run fails saying so, not "the agent exited with code -9" (that -9 was the ssh client's), and
points at no empty agent log; the agent there leaves with its workers."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

import nbaccel
from nbaccel.launcher.agent_link import AGENTS
from tests.multihost.conftest import SshHosts
from tests.multihost.test_hosts_launch import (
    GONE_WITHIN_S,
    RUN_TIMEOUT_S,
    on_hosts,
    sleeps,
    wait_for_ranks,
)


@pytest.mark.timeout(300)
def test_a_lost_ssh_connection_is_named_as_such(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    second = ssh_hosts.hosts[1]
    run = nbaccel.launch(sleeps, num_processes=4, dashboard=False, **on_hosts(ssh_hosts, tmp_path))
    wait_for_ranks(run, 4)
    idle = {link.pid for link in AGENTS.idle_links()}  # other tests' agents, not this run's
    (client,) = [
        process
        for process in psutil.Process().children()
        if process.name() == "ssh" and second in process.cmdline() and process.pid not in idle
    ]
    workers = [psutil.Process(run.worker_pids[rank]) for rank in (2, 3)]  # on the second host
    agent = workers[0].parent()
    assert agent is not None
    client.kill()
    assert run.wait(RUN_TIMEOUT_S) is nbaccel.RunState.FAILED
    message = str(run.error)
    assert message.startswith(
        f"the nbaccel agent on host {second!r} failed: the connection to the agent's host was "
        f"lost: its ssh client (pid {client.pid}, on this machine) was killed by SIGKILL"
    ), message
    assert "code -9" not in message
    log = tmp_path / run.run_id / f"agent-1-{second}.log"
    assert (str(log) in message) == bool(log.read_text().strip()), message
    _, alive = psutil.wait_procs([agent, *workers], timeout=GONE_WITHIN_S)
    assert not alive, f"left running on {second} after its connection was lost: {alive}"
