"""A host that ssh reaches by a name nothing else resolves (an alias of the ssh config)
fails the launch within seconds, named, instead of torch elastic's rendezvous retrying the
name for minutes ("The IPv6 network addresses of (...) cannot be retrieved"): each agent
resolves the rendezvous addresses before elastic starts (``agent_run.check_resolves``)."""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import psutil

import nbaccel
from tests.multihost.conftest import SshHosts
from tests.multihost.test_hosts_launch import GONE_WITHIN_S, on_hosts

FAILS_WITHIN_S = 60.0  # measured ~3 s whole (both agents start and import torch)
ALIASES = ("nbaccel-nowhere-1", "nbaccel-nowhere-2")  # end in no domain: never in DNS


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def test_a_host_named_by_an_ssh_alias_fails_at_once_naming_the_address(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    config = tmp_path / "ssh_config"
    aliases = "".join(
        f"Host {alias}\n  HostName {address}\n"
        for alias, address in zip(ALIASES, ssh_hosts.hosts, strict=True)
    )
    # ssh keeps the first value of each option: the aliases' HostName first, then the rest.
    config.write_text(aliases + Path(ssh_hosts.ssh_options[1]).read_text())
    settings = {
        **on_hosts(ssh_hosts, tmp_path),
        "hosts": list(ALIASES),
        "ssh_options": shlex.join(("-F", str(config))),
    }
    start = time.monotonic()
    run = nbaccel.launch(rank, num_processes=2, dashboard=False, **settings)
    assert run.wait(FAILS_WITHIN_S) is nbaccel.RunState.FAILED
    assert time.monotonic() - start < FAILS_WITHIN_S
    error = str(run.error)
    # Whichever agent said it first: each resolves its own address first.
    assert re.search(
        r"the nbaccel agent on host 'nbaccel-nowhere-(\d)' failed: 'nbaccel-nowhere-\1', this "
        r"host's own rendezvous address, does not resolve on ",
        error,
    ), error
    assert "an alias of ~/.ssh/config is not" in error  # the fix
    assert "Traceback" not in error  # said as it is, not as a crash
    # A failed run's agents are ended, not kept: their ssh connections go.
    ssh = [p for p in psutil.Process().children() if set(ALIASES) & set(_cmdline(p))]
    _, alive = psutil.wait_procs(ssh, timeout=GONE_WITHIN_S)
    assert not alive, f"left running: {alive}"


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []
