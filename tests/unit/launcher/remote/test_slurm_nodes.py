"""Where the nodes of ``hosts="slurm"`` meet: scontrol's NodeAddr, and the check that each
address resolves and has a route (no cluster: scontrol and the resolver are stood in)."""

from __future__ import annotations

import errno
import socket
import subprocess
import threading
import time
from typing import Any

import pytest

from nbaccel.errors import ConfigError
from nbaccel.launcher.remote import slurm_nodes
from nbaccel.launcher.remote.slurm_nodes import node_addresses

# What slurm-wlm 22.05's `scontrol show node --oneliner n1,n2` printed (shortened).
SCONTROL = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 Gres=(null) NodeAddr=127.0.0.2 "
    "NodeHostName=n1 Port=46821 Version=22.05.8 OS=Linux 6.18.44 #1 SMP  RealMemory=1\n"
    "NodeName=n2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 Gres=(null) NodeAddr=127.0.0.3 "
    "NodeHostName=n2 Port=46822 Version=22.05.8 OS=Linux 6.18.44 #1 SMP  RealMemory=1\n"
)


def scontrol(stdout: str, code: int = 0) -> Any:
    calls: list[list[str]] = []

    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, code, stdout, "")

    run.calls = calls  # type: ignore[attr-defined]
    return run


def resolves(*names: str) -> Any:
    def resolve(host: str) -> list[str]:
        if host in names or host[0].isdigit():
            return [host if host[0].isdigit() else "127.0.0.9"]
        raise OSError(-2, "Name or service not known")

    return resolve


def test_each_node_meets_at_its_node_addr_asked_once_for_all() -> None:
    run = scontrol(SCONTROL)
    assert node_addresses(["n1", "n2"], {}, run=run, resolve=resolves()) == [
        "127.0.0.2",
        "127.0.0.3",
    ]
    assert run.calls == [["scontrol", "show", "node", "--oneliner", "n1,n2"]]


def test_without_an_answer_from_scontrol_the_names_stand_for_themselves() -> None:
    def missing(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(2, "No such file or directory", "scontrol")

    assert node_addresses(["gpu01"], {}, run=missing, resolve=resolves("gpu01")) == ["gpu01"]
    failed = scontrol("", code=1)
    assert node_addresses(["gpu01"], {}, run=failed, resolve=resolves("gpu01")) == ["gpu01"]


def test_a_name_that_resolves_nowhere_fails_naming_the_node_why_and_the_fix() -> None:
    with pytest.raises(ConfigError) as raised:
        node_addresses(["n1", "n2"], {}, run=scontrol(""), resolve=resolves("n1"))
    message = str(raised.value)
    assert "- node n2: its name n2: it does not resolve (Name or service not known)" in message
    assert "node n1" not in message
    assert "nothing was started" in message
    assert "NodeAddr that resolves on every node" in message  # the fix
    assert raised.value.field == "hosts"


def test_a_resolver_that_hangs_fails_within_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_nodes, "RESOLVE_TIMEOUT", 0.2)
    never = threading.Event()

    def hangs(host: str) -> list[str]:
        never.wait(30)
        return []

    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"node n1: its NodeAddr a\.b: resolving it took"):
        node_addresses(["n1", "n2"], {}, run=scontrol("NodeName=n1 NodeAddr=a.b\n"), resolve=hangs)
    # Both nodes were looked up at once: one timeout for the whole check.
    assert time.monotonic() - start < 0.2 * 10
    never.set()


def test_an_address_without_a_route_from_here_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoRoute(socket.socket):
        def connect(self, address: Any) -> None:
            raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(slurm_nodes.socket, "socket", NoRoute)
    with pytest.raises(ConfigError) as raised:
        node_addresses(
            ["n1"], {}, run=scontrol("NodeName=n1 NodeAddr=10.9.9.9\n"), resolve=resolves()
        )
    assert (
        "node n1: its NodeAddr 10.9.9.9: it resolves to 10.9.9.9, with no route from here "
        "(Network is unreachable)"
    ) in str(raised.value)
