"""The agents of ``hosts=`` are kept between launches (issue 15's warm relaunch): a second
launch on the same hosts takes the same agent processes, checks no host again, and gets
none of the first launch's environment; an agent that left while idle is replaced."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest

import nbaccel
from nbaccel.launcher.remote import agent_link
from nbaccel.launcher.remote.agent_link import AGENTS
from tests.multihost.conftest import SshHosts
from tests.multihost.test_hosts_launch import GONE_WITHIN_S, RUN_TIMEOUT_S, on_hosts


def where_am_i() -> dict[str, Any]:
    import torch.distributed as dist

    return {
        "rank": dist.get_rank(),
        "agent": os.getppid(),  # a worker is a fork of its host's agent
        "accumulation": os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
    }


def launch(ssh_hosts: SshHosts, runs_dir: Path, **settings: Any) -> dict[int, dict[str, Any]]:
    run = nbaccel.launch(
        where_am_i, num_processes=4, dashboard=False, **on_hosts(ssh_hosts, runs_dir), **settings
    )
    assert run.wait(RUN_TIMEOUT_S) is nbaccel.RunState.SUCCEEDED, run.error
    # Each launch keeps its own part of each agent's output.
    assert len(list(run.run_dir.glob("agent-*.log"))) == 2
    return run.results()


@pytest.fixture
def checked_hosts(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The hosts each launch's preflight probes (its new agents' first step)."""
    checked: list[list[str]] = []
    probe = agent_link.preflight

    def recording(shell: Any, hosts: Any, ask: Any, **kwargs: Any) -> Any:
        checked.append(list(hosts))
        return probe(shell, hosts, ask, **kwargs)

    monkeypatch.setattr(agent_link, "preflight", recording)
    return checked


def test_a_relaunch_takes_the_same_agents_without_checking_the_hosts_again(
    ssh_hosts: SshHosts, tmp_path: Path, checked_hosts: list[list[str]]
) -> None:
    AGENTS.close_all()  # the first launch starts its own
    first = launch(ssh_hosts, tmp_path, gradient_accumulation_steps=2)
    second = launch(ssh_hosts, tmp_path)
    assert checked_hosts == [list(ssh_hosts.hosts), []]
    agents = {rank: value["agent"] for rank, value in first.items()}
    assert {rank: value["agent"] for rank, value in second.items()} == agents
    assert len(set(agents.values())) == 2  # one agent per host, two ranks each
    # The first launch's environment is not the second's.
    assert {value["accumulation"] for value in first.values()} == {"2"}
    assert {value["accumulation"] for value in second.values()} == {None}


def test_an_agent_that_left_while_idle_is_replaced_and_its_host_checked(
    ssh_hosts: SshHosts, tmp_path: Path, checked_hosts: list[list[str]]
) -> None:
    first = launch(ssh_hosts, tmp_path)
    # The second host's link, taken before its agent goes (the pool then stops listing it).
    (link,) = [link for link in AGENTS.idle_links() if link.host == ssh_hosts.hosts[1]]
    gone = psutil.Process(first[3]["agent"])
    gone.send_signal(signal.SIGKILL)
    gone.wait(GONE_WITHIN_S)
    # Its ssh ends with it: then the pool no longer offers it.
    assert link.wait_ended(GONE_WITHIN_S)
    second = launch(ssh_hosts, tmp_path)
    assert checked_hosts[-1] == [ssh_hosts.hosts[1]]
    assert second[0]["agent"] == first[0]["agent"]
    assert second[3]["agent"] != first[3]["agent"]
