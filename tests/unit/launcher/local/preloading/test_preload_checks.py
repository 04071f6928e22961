"""The helper's check after each preloaded import (``preload.import_checked``)."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from nbaccel.launcher.local.preloading.preload import Hazards, import_checked, sockets_of


@pytest.fixture
def quiet_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "nbaccel_test_quiet.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "nbaccel_test_quiet"


def test_a_quiet_import_is_safe(quiet_module: str) -> None:
    assert import_checked(quiet_module, Hazards.now()) is None


def test_a_socket_that_appeared_is_unsafe_unless_the_helper_itself_holds_it(
    quiet_module: str,
) -> None:
    before = Hazards.now()
    ours, theirs = socket.socketpair()  # as a request served mid-import brings rank 0's socket
    try:
        assert import_checked(quiet_module, before) == "it opened a socket at import"
        held = sockets_of([ours.fileno(), theirs.fileno()])
        assert len(held) == 2
        assert import_checked(quiet_module, before, lambda: held) is None
    finally:
        ours.close()
        theirs.close()


def test_a_changed_signal_handler_is_undone(quiet_module: str) -> None:
    previous = signal.getsignal(signal.SIGUSR2)
    before = Hazards.now()
    signal.signal(signal.SIGUSR2, lambda *_: None)  # what a library's import might do
    try:
        assert import_checked(quiet_module, before) == (
            "handlers: it installed a signal handler at import"
        )
        assert signal.getsignal(signal.SIGUSR2) is previous  # put back
    finally:
        signal.signal(signal.SIGUSR2, previous)  # type: ignore[arg-type]
