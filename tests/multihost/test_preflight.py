"""Preflight against a real sshd on 127.0.0.2 and 127.0.0.3: both pass, and each way a host
can fail is named with the host and the fix (see conftest.py for the server)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import psutil
import pytest

from nbaccel.errors import ConfigError
from nbaccel.launcher.remote.agent_link import AgentPool
from nbaccel.launcher.remote.preflight import HostInfo, local_versions
from nbaccel.launcher.remote_shell import RemoteShell
from tests.multihost.conftest import SshHosts, keygen

TIMEOUT = 30.0  # per host; a probe here takes well under a second


def failure(shell: RemoteShell, hosts: list[str], **versions: str) -> str:
    """The error of checking ``hosts``, each by its new agent's first step: no agent, and
    no ssh of one, stays."""
    pool = AgentPool()
    before = {child.pid for child in psutil.Process().children()}
    with pytest.raises(ConfigError) as caught:
        pool.start_checked(
            shell, hosts, timeout=TIMEOUT, local_versions=versions or local_versions()
        )
    assert caught.value.field == "hosts"
    assert pool.idle_links() == []
    assert {child.pid for child in psutil.Process().children()} <= before
    return str(caught.value)


def test_both_hosts_pass_with_the_kernels_versions(ssh_hosts: SshHosts) -> None:
    shell = RemoteShell("ssh", ssh_hosts.ssh_options, python=sys.executable)
    here = local_versions()
    pool = AgentPool()
    try:
        found = pool.start_checked(
            shell, list(ssh_hosts.hosts), timeout=TIMEOUT, local_versions=here
        )
        # The agents that answered wait in the pool for the launch.
        assert sorted(link.host for link in pool.idle_links()) == sorted(ssh_hosts.hosts)
    finally:
        pool.close_all()
    assert list(found) == list(ssh_hosts.hosts)
    for host, info in found.items():
        assert info == HostInfo(
            host=host,
            hostname=socket.gethostname(),
            python=here["python"],
            nbaccel=here["nbaccel"],
            torch=here["torch"],
            cpus=info.cpus,
            gpus=info.gpus,
        )
        assert info.cpus >= 1


def test_an_unreachable_host_is_named_beside_a_good_one(ssh_hosts: SshHosts) -> None:
    shell = RemoteShell("ssh", ssh_hosts.ssh_options, python=sys.executable)
    # Nothing listens on 127.0.0.4 (the server listens on .2 and .3 only).
    message = failure(shell, [ssh_hosts.hosts[0], "127.0.0.4"])
    assert message.startswith("1 of 2 hosts cannot run nbaccel")
    assert "- 127.0.0.4: unreachable (ssh could not connect)" in message
    assert "runs an SSH server" in message and "Connection refused" in message
    assert f"- {ssh_hosts.hosts[0]}" not in message


def test_a_key_the_host_does_not_accept(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    stranger = keygen(tmp_path / "stranger_key")
    shell = RemoteShell("ssh", ssh_hosts.options(identity=stranger), python=sys.executable)
    message = failure(shell, [ssh_hosts.hosts[1]])
    assert f"- {ssh_hosts.hosts[1]}: authentication refused" in message
    assert f"ssh-copy-id {ssh_hosts.hosts[1]}" in message
    assert "Permission denied (publickey)" in message


def test_a_host_key_not_in_known_hosts(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    shell = RemoteShell("ssh", ssh_hosts.options(known_hosts=empty), python=sys.executable)
    message = failure(shell, [ssh_hosts.hosts[0]])
    assert f"- {ssh_hosts.hosts[0]}: its host key is not trusted" in message
    assert f"`ssh {ssh_hosts.hosts[0]}`" in message and "known_hosts" in message
    assert "Host key verification failed." in message


def test_a_missing_interpreter_on_every_host(ssh_hosts: SshHosts) -> None:
    shell = RemoteShell("ssh", ssh_hosts.ssh_options, python="/nonexistent/python")
    message = failure(shell, list(ssh_hosts.hosts))
    assert message.startswith("2 of 2 hosts cannot run nbaccel")
    for host in ssh_hosts.hosts:
        assert f"- {host}: the Python interpreter /nonexistent/python is missing there" in message
    assert "remote_python=" in message and "No such file or directory" in message


def test_an_interpreter_without_nbaccel(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    # The venv's own Python without its site-packages (-S): neither nbaccel nor torch there.
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    shell = RemoteShell("ssh", ssh_hosts.ssh_options, python=str(bare))
    message = failure(shell, [ssh_hosts.hosts[0]])
    assert f"- {ssh_hosts.hosts[0]}: nbaccel and torch are not installed for {bare}" in message
    assert f"nbaccel=={local_versions()['nbaccel']}" in message


def test_another_nbaccel_version_than_the_kernels(ssh_hosts: SshHosts) -> None:
    shell = RemoteShell("ssh", ssh_hosts.ssh_options, python=sys.executable)
    there = local_versions()["nbaccel"]
    message = failure(shell, [ssh_hosts.hosts[1]], nbaccel="0.0.1")
    expected = f"- {ssh_hosts.hosts[1]}: different versions: nbaccel {there} there, 0.0.1 here"
    assert expected in message
