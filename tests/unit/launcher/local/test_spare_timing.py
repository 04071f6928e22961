"""When the helper forks the spares a launch used: not while that launch's ranks start
(forking a torch-sized helper copies its page tables, taking a core from them), but once
they exit or a while after the last request (``child_processes.spares_held_for``)."""

from __future__ import annotations

import pytest

from nbaccel.launcher.local.child_processes import (
    SPARES_AFTER_REQUEST_SECONDS,
    spares_held_for,
)


def test_spares_wait_while_the_workers_of_the_last_request_start() -> None:
    assert spares_held_for(missing=True, workers_alive=True, quiet_for=0.0) == pytest.approx(
        SPARES_AFTER_REQUEST_SECONDS
    )
    assert 0 < spares_held_for(missing=True, workers_alive=True, quiet_for=0.25) < 0.06


def test_spares_are_forked_once_the_workers_exit_or_the_run_goes_on() -> None:
    assert spares_held_for(missing=True, workers_alive=False, quiet_for=0.0) == 0.0
    assert spares_held_for(missing=True, workers_alive=True, quiet_for=0.3) == 0.0
    assert spares_held_for(missing=True, workers_alive=True, quiet_for=5.0) == 0.0


def test_nothing_waits_when_no_spare_is_missing() -> None:
    assert spares_held_for(missing=False, workers_alive=True, quiet_for=0.0) == 0.0
