"""Before torch elastic starts, an agent resolves its rendezvous addresses
(``agent_run.check_resolves``) and, on every host but the first, connects to the first
host's rendezvous (``check_reaches``): an address that does not resolve, a resolver that
hangs, or a rendezvous that never accepts fails within seconds, named, instead of c10d
retrying for minutes. No torch is imported."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from nbaccel.launcher.remote import agent_run
from nbaccel.launcher.remote.agent_run import (
    AddressNotResolved,
    JobNotFormed,
    RendezvousUnreachable,
    check_reaches,
    check_resolves,
)

START = {"local_addr": "n2", "endpoint_host": "n1"}


def resolving(*names: str) -> Any:
    def resolve(host: str, port: object) -> list[object]:
        if host in names:
            return []
        raise socket.gaierror(-2, "Name or service not known")

    return resolve


def test_addresses_that_resolve_pass() -> None:
    check_resolves(START, resolve=resolving("n1", "n2"))
    check_resolves({"local_addr": None, "endpoint_host": "n1"}, resolve=resolving("n1"))


def test_an_address_that_does_not_resolve_is_named_with_why_and_the_fix() -> None:
    with pytest.raises(AddressNotResolved) as raised:
        check_resolves(START, resolve=resolving("n2"))
    message = str(raised.value)
    assert message.startswith("'n1', the first host's rendezvous address, does not resolve on ")
    assert "Name or service not known" in message
    assert "NodeAddr that resolves on every node" in message
    # The agent says it as it is (no traceback), as for a job whose machines did not meet.
    assert isinstance(raised.value, JobNotFormed)


def test_a_resolver_that_hangs_fails_within_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_run, "RESOLVE_TIMEOUT", 0.2)
    never = threading.Event()

    def hangs(host: str, port: object) -> list[object]:
        never.wait(30)
        return []

    start = time.monotonic()
    with pytest.raises(AddressNotResolved, match=r"'n2', this host's own .*no answer within 0.2 s"):
        check_resolves(START, resolve=hangs)
    assert time.monotonic() - start < 0.2 * 10
    never.set()


def test_a_listening_rendezvous_is_reached_at_once() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        start = time.monotonic()
        check_reaches("127.0.0.1", server.getsockname()[1])
        assert time.monotonic() - start < 5.0


def test_a_rendezvous_that_never_listens_fails_within_the_timeout_naming_where(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agent_run, "REACH_TIMEOUT", 0.3)
    with socket.socket() as taken:  # bound, never listening: every connection is refused
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(RendezvousUnreachable) as raised:
            check_reaches("127.0.0.1", port)
        assert time.monotonic() - start < 0.3 * 10
    message = str(raised.value)
    assert message.startswith(f"the first host's rendezvous at 127.0.0.1:{port} did not accept")
    assert "(last: Connection refused)" in message
    assert "open the ports between the hosts" in message  # the fix
    assert isinstance(raised.value, JobNotFormed)  # said without a traceback


def test_refused_is_retried_until_the_rendezvous_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first host names its port moments before its store listens: refused, then open.
    with socket.socket() as later:
        later.bind(("127.0.0.1", 0))
        port = later.getsockname()[1]
        refusals = 0
        real = socket.create_connection

        def connect(address: Any, timeout: float) -> socket.socket:
            nonlocal refusals
            refusals += 1
            if refusals == 3:
                later.listen()
            return real(address, timeout)

        monkeypatch.setattr(agent_run.socket, "create_connection", connect)
        check_reaches("127.0.0.1", port)
        assert refusals == 3
