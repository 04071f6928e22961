"""An agent resolves its rendezvous addresses before torch elastic starts: one that does not
resolve (or whose resolver hangs) fails at once, named, instead of c10d retrying it for
minutes (``agent_run.check_resolves``; no torch is imported)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from nbaccel.launcher import agent_run
from nbaccel.launcher.agent_run import AddressNotResolved, JobNotFormed, check_resolves

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
