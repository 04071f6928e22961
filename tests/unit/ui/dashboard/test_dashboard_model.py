"""The dashboard's model on several machines (a remote worker's pid is never read here) and
across torch elastic's restarts (the header names the attempt)."""

from __future__ import annotations

from nbaccel.events import WorkerStarted
from nbaccel.ui.dashboard.model import DashboardModel


def test_a_remote_workers_pid_is_not_sampled_on_this_machine() -> None:
    model = DashboardModel(world_size=2)
    model.handle(WorkerStarted(0, 101, 0.0))
    model.handle(WorkerStarted(1, 102, 0.0, host="node2"))
    assert model.pids == {0: 101}  # the memory sampler reads these pids on this machine
    assert model.hosts == {1: "node2"}


def test_the_header_says_which_attempt_runs_after_a_restart() -> None:
    from nbaccel.events import RunRestarted
    from nbaccel.ui.dashboard.text import header_text

    model = DashboardModel(world_size=2)
    model.handle(WorkerStarted(1, 102, 0.0))
    assert "attempt" not in header_text(model.header(now=1.0))  # no restart: not shown
    model.handle(RunRestarted(1, 2, 1, None, "killed by SIGKILL", 1.0))
    model.handle(WorkerStarted(1, 202, 1.0))
    parts = header_text(model.header(now=2.0)).split(" · ")
    assert parts[2] == "attempt 2 of 3"
    assert model.pids == {1: 202}  # the memory sampler follows the new worker


def test_a_launcher_notice_shows_in_the_first_ranks_log() -> None:
    from nbaccel.events import Notice
    from nbaccel.ui.dashboard.model import DashboardModel

    model = DashboardModel(2)
    model.handle(Notice("not preloaded: thready (it started a thread at import)", 0.0))
    assert "nbaccel: not preloaded: thready" in "\n".join(model.tail(0))
