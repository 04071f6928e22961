"""The parent's side of a torch_xla launch, with fakes: no torch_xla, no TPU, no process.

When a launch goes through torch_xla, and what is refused before anything starts; and the
Run's bookkeeping for one supervisor standing for every rank (one spawn request carrying
every rank's pipes, its exit ending every rank, signals to its whole process group).
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import nbaccel
from nbaccel.config.schema import Config
from nbaccel.context import ProcessContext
from nbaccel.events import DeviceMemory, ResultReady, RunState, WorkerFailed, WorkerStarted
from nbaccel.frames import EventWriter
from nbaccel.hardware.xla_plan import XlaPlan
from nbaccel.launcher import api
from nbaccel.launcher.bootstrap.worker_bootstrap import error_message
from nbaccel.launcher.run import Run
from tests.unit.fake_hosts import tpu_host


def train() -> int:
    return 1


def test_plain_machines_and_explicit_strategies_never_go_through_torch_xla(
    tmp_path: Path,
) -> None:
    assert api.plan_xla_launch(Config(), {}, root=tmp_path) is None
    v5e_8 = tpu_host(tmp_path / "tpu", 8)
    assert api.plan_xla_launch(Config(use_cpu=True), {}, root=v5e_8) is None
    assert api.plan_xla_launch(Config(strategy="ddp"), {}, root=v5e_8) is None


def test_a_tpu_host_without_torch_xla_is_refused_before_anything_starts(
    nothing_started: Path, tmp_path: Path
) -> None:
    if api._installed("torch_xla"):
        pytest.skip("torch_xla is installed here")
    with pytest.raises(nbaccel.ConfigError, match="needs torch_xla") as caught:
        api.plan_xla_launch(Config(), {}, root=tpu_host(tmp_path / "tpu", 1))
    assert "pip install" in str(caught.value)


@pytest.mark.parametrize("env", [{"PJRT_DEVICE": "TPU"}, {"PJRT_DEVICE": "CPU"}])
def test_launches_asking_for_xla_fail_before_start_without_torch_xla(
    nothing_started: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    if api._installed("torch_xla"):
        pytest.skip("torch_xla is installed here")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(nbaccel.ConfigError, match="needs torch_xla"):
        nbaccel.notebook_launcher(train, runs_dir=str(nothing_started))


class FakeHelper:
    """Records spawn requests (keeping the fds, as SCM_RIGHTS would) and signals."""

    def __init__(self) -> None:
        self.spawned: list[tuple[dict[str, Any], list[int]]] = []
        self.signals: list[tuple[int, list[int] | None]] = []
        self.listener: Any = None

    def subscribe(self, run_id: str, listener: Any) -> None:
        self.listener = listener

    def unsubscribe(self, run_id: str) -> None:
        self.listener = None

    def spawn(self, request: dict[str, Any], fds: list[int]) -> None:
        self.spawned.append((request, [os.dup(fd) for fd in fds]))

    def signal(
        self, run_id: str, signum: int, ranks: list[int] | None = None, *, group: bool = True
    ) -> None:
        self.signals.append((signum, ranks))

    def host_of(self, rank: int) -> str | None:
        return None


def start_supervised_run(tmp_path: Path, world: int) -> tuple[Run, FakeHelper]:
    plan = XlaPlan(device="TPU", num_processes=world, devices_per_process=1)
    run = Run("r1", tmp_path, Config(), world, xla=plan)
    helper = FakeHelper()
    requests = [
        {
            "context": ProcessContext(rank, rank, world, world, 0, "127.0.0.1", 1, "r1"),
            "env": {"RANK": str(rank)},
            "cwd": str(tmp_path),
        }
        for rank in range(world)
    ]
    payload_r, payload_w = os.pipe()
    listen_r, listen_w = os.pipe()
    try:
        run.start(helper, requests, payload_r, listen_r)  # type: ignore[arg-type]
    finally:
        for fd in (payload_r, payload_w, listen_r, listen_w):
            os.close(fd)
    return run, helper


def close_all(helper: FakeHelper) -> None:
    for _, fds in helper.spawned:
        for fd in fds:
            os.close(fd)


def test_one_supervisor_request_carries_every_ranks_pipes(tmp_path: Path) -> None:
    run, helper = start_supervised_run(tmp_path, world=4)
    try:
        [(request, fds)] = helper.spawned  # one process for the whole launch
        assert request["processes"] == 1 and request["rank"] == 0
        assert request["xla_plan"].world_size == 4
        assert [r["context"].rank for r in request["ranks"]] == [0, 1, 2, 3]
        assert all(r["xla_plan"] is request["xla_plan"] for r in request["ranks"])
        assert len(fds) == 1 + 2 * 4  # the payload, then (log, events) per rank; no port
        assert run.xla_device == "TPU"
    finally:
        helper.listener({"op": "exited", "status": -int(signal.SIGKILL)})
        close_all(helper)
        run.wait(timeout=10)


def test_the_supervisors_exit_ends_every_rank_and_results_come_back(tmp_path: Path) -> None:
    run, helper = start_supervised_run(tmp_path, world=2)
    [(_, fds)] = helper.spawned
    seen: list[Any] = []
    run.subscribe(seen.append)  # before anything is written: the pump reads at once
    for rank in (0, 1):
        log_fd, event_fd = fds[1 + 2 * rank], fds[2 + 2 * rank]
        os.write(log_fd, f"hello from {rank}\n".encode())
        events = EventWriter(event_fd)
        events.send(WorkerStarted(rank, 1000 + rank, 0.0))
        events.send(DeviceMemory(rank, f"TPU:{rank}", 5 << 20, 6 << 20, 16 << 30, 0.0))
        events.send(ResultReady(rank, pickle.dumps(rank * 10)))
    close_all(helper)
    helper.listener({"op": "exited", "run": "r1", "rank": 0, "status": 0})
    assert run.wait(timeout=10) is RunState.SUCCEEDED
    assert run.results() == {0: 0, 1: 10}
    assert run.logs(1) == "hello from 1\n"
    assert run.worker_pids == {0: 1000, 1: 1001}
    memory = [e for e in seen if isinstance(e, DeviceMemory)]
    readings = sorted((m.rank, m.device, m.used) for m in memory)
    assert readings == [(0, "TPU:0", 5 << 20), (1, "TPU:1", 5 << 20)]


def test_a_rank_error_stops_the_whole_supervisor_group(tmp_path: Path) -> None:
    run, helper = start_supervised_run(tmp_path, world=2)
    [(_, fds)] = helper.spawned
    EventWriter(fds[2]).send(ResultReady(0, pickle.dumps(0)))
    try:
        raise KeyError("label")
    except KeyError as error:
        EventWriter(fds[4]).send(error_message(error, 1))
    # The arbiter waits out its window, then asks for SIGTERM: for every rank (None), since
    # only the supervisor's process group can be signalled.
    deadline = time.monotonic() + 10
    while not helper.signals and time.monotonic() < deadline:
        time.sleep(0.02)
    deadline_signals = list(helper.signals)
    close_all(helper)
    helper.listener({"op": "exited", "run": "r1", "rank": 0, "status": -int(signal.SIGTERM)})
    assert run.wait(timeout=10) is RunState.FAILED
    assert deadline_signals and deadline_signals[0] == (signal.SIGTERM, None)
    with pytest.raises(KeyError, match=r"\[rank 1\]"):
        run.result()


def read_events(fd: int) -> list[dict[str, Any]]:
    from nbaccel.frames import FrameDecoder

    data = b""
    while chunk := os.read(fd, 1 << 16):
        data += chunk
    return list(FrameDecoder().feed(data))


def test_a_busy_chip_at_start_up_is_reported_on_rank_0_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nbaccel.launcher.xla import supervisor as xla_supervisor

    def chip_held(plan: XlaPlan, address: str) -> None:
        raise RuntimeError(
            "Failed to get global TPU topology: open(/dev/vfio/0): Device or resource busy"
        )

    monkeypatch.setattr(xla_supervisor, "_launch", chip_held)
    pipes = [os.pipe() for _ in range(4)]  # (log, events) for ranks 0 and 1
    payload_r, payload_w = os.pipe()
    plan = XlaPlan(device="TPU", num_processes=2, devices_per_process=1)
    requests: list[dict[str, Any]] = [{"rank": r} for r in (0, 1)]
    fds = [payload_r] + [w for _, w in pipes]
    code = xla_supervisor.supervise({"xla_plan": plan, "ranks": requests}, fds)
    for fd in [*fds, payload_w]:
        os.close(fd)
    assert code == 1
    events = [read_events(r) for r, _ in pipes[1::2]]
    for r, _ in pipes[0::2]:
        os.close(r)
    [error] = events[0]  # rank 0 (the first rank that had not finished) carries it
    assert events[1] == []  # the others end as the supervisor's exit, not as culprits
    assert isinstance(error, WorkerFailed) and error.rank == 0
    assert "another process" in error.message.lower() and "lsof" in error.message
    assert "Device or resource busy" in error.message  # torch_xla's own words kept
