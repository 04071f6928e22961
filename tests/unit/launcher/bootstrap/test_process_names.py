"""Names of nbaccel's processes (issue 39, item 20): the command line through setproctitle
where it is installed, ``/proc/self/comm`` always, and never an error for a label."""

from __future__ import annotations

import pytest

from nbaccel.launcher.bootstrap import process_names


def test_the_title_goes_to_the_command_line_and_its_head_to_comm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    titles: list[str] = []
    comms: list[str] = []
    monkeypatch.setattr(process_names, "_setproctitle", lambda: titles.append)
    monkeypatch.setattr(process_names, "_set_comm", comms.append)
    process_names.name_process(process_names.worker_title(12, "20261129-070000-abcdef"))
    assert titles == ["nbaccel rank 12 (run 20261129-070000-abcdef)"]
    assert comms == ["nbaccel rank 12"]


def test_without_setproctitle_or_with_a_failing_one_comm_is_still_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    comms: list[str] = []
    monkeypatch.setattr(process_names, "_set_comm", comms.append)
    monkeypatch.setattr(process_names, "_setproctitle", lambda: None)  # not installed
    process_names.name_process(process_names.spare_title(7))

    def broken(title: str) -> None:
        raise OSError("no room for a title")

    monkeypatch.setattr(process_names, "_setproctitle", lambda: broken)
    process_names.name_process(process_names.helper_title(7))
    assert comms == ["nbaccel spare", "nbaccel helper"]


def test_every_short_name_fits_in_comm() -> None:
    titles = [
        process_names.helper_title(4_194_304),
        process_names.base_title(4_194_304),
        process_names.spare_title(4_194_304),
        process_names.worker_title(0, "x"),
        process_names.worker_title(123_456, "x"),
        process_names.worker_title(0, "x", supervisor=True),
    ]
    assert all(len(process_names.short_name(t).encode()) <= 15 for t in titles)
