"""The dashboard's model on several machines: a remote worker's pid is never read here."""

from __future__ import annotations

from nbaccel.events import WorkerStarted
from nbaccel.ui.dashboard_model import DashboardModel


def test_a_remote_workers_pid_is_not_sampled_on_this_machine() -> None:
    model = DashboardModel(world_size=2)
    model.handle(WorkerStarted(0, 101, 0.0))
    model.handle(WorkerStarted(1, 102, 0.0, host="node2"))
    assert model.pids == {0: 101}  # the memory sampler reads these pids on this machine
    assert model.hosts == {1: "node2"}
