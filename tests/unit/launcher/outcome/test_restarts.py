"""A run whose workers torch elastic restarts (``max_restarts``), driven with a fake starter:
no process. What the pump does with a failure while restarts are left (records it, stops
nobody, says why at the restart, keeps the rank's pipes and forgets its old result), and once
they are used up (ends the run as without restarts, the error naming the attempt).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from nbaccel.config.schema import Config
from nbaccel.context import ProcessContext
from nbaccel.events import Event, ResultReady, RunRestarted, RunState, WorkerStarted
from nbaccel.frames import EventWriter
from nbaccel.launcher.bootstrap.worker_bootstrap import error_message
from nbaccel.launcher.printer import TextPrinter
from nbaccel.launcher.run import Run
from tests.unit.launcher.test_xla_launch import FakeHelper, close_all

WAIT_S = 10.0


class Started:
    """A two-rank run with a fake starter; the test plays the agent's part."""

    def __init__(self, tmp_path: Path, max_restarts: int) -> None:
        self.run = Run("r1", tmp_path, Config(max_restarts=max_restarts), 2)
        self.helper = FakeHelper()
        self.seen: list[Event] = []
        self.restarted = threading.Event()
        self.text = io.StringIO()
        printer = TextPrinter(self.text, None, announce_end=True)
        self.run.subscribe(self._take)
        self.run.subscribe(printer)
        requests = [
            {"context": ProcessContext(rank, rank, 2, 2, 0, "127.0.0.1", 1, "r1"), "env": {}}
            for rank in range(2)
        ]
        payload_r, payload_w = os.pipe()
        try:
            self.run.start(self.helper, requests, payload_r, None)  # type: ignore[arg-type]
        finally:
            os.close(payload_r)
            os.close(payload_w)
        # One spawn per rank: (payload, log, events); the same pipes serve every attempt.
        self.events = [EventWriter(fds[2]) for _, fds in self.helper.spawned]

    def _take(self, event: Event) -> None:
        self.seen.append(event)
        if isinstance(event, RunRestarted):
            self.restarted.set()

    def started(self, rank: int, attempt: int) -> None:
        pid = 100 + 10 * attempt + rank
        self.events[rank].send(WorkerStarted(rank, pid, 0.0, attempt=attempt))

    def result(self, rank: int, value: Any) -> None:
        self.events[rank].send(ResultReady(rank, pickle.dumps(value)))

    def error(self, rank: int, error: BaseException) -> None:
        try:
            raise error
        except BaseException as raised:  # noqa: BLE001 - a traceback, as a worker has
            self.events[rank].send(error_message(raised, rank))

    def post(self, message: dict[str, Any]) -> None:
        # As a real starter: nothing reaches a run that has ended (it unsubscribed). A rank
        # whose last worker's end came as "worker_ended" may end the run before its
        # "exited" is posted.
        listener = self.helper.listener
        if listener is not None:
            listener({**message, "run": "r1"})

    def end(self, statuses: dict[int, int]) -> RunState:
        """Elastic's end: every rank's final exit, after its last bytes."""
        close_all(self.helper)
        for rank, status in statuses.items():
            self.post({"op": "exited", "rank": rank, "status": status})
        return self.run.wait(WAIT_S)

    def records(self) -> list[dict[str, Any]]:
        lines = (self.run.run_dir / "events.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]


def test_a_failure_with_restarts_left_stops_nobody_and_the_next_attempt_finishes(
    tmp_path: Path,
) -> None:
    run = Started(tmp_path, max_restarts=1)
    for rank in (0, 1):
        run.started(rank, 0)
    run.result(0, "stale")  # rank 0 finished attempt 0 before rank 1 died
    run.error(1, ValueError("bad batch"))
    run.post({"op": "worker_ended", "rank": 1, "attempt": 0, "status": 1})
    run.post({"op": "worker_ended", "rank": 0, "attempt": 0, "status": -int(signal.SIGTERM)})
    run.post({"op": "restarted", "attempt": 1})
    assert run.restarted.wait(WAIT_S)
    for rank in (0, 1):
        run.started(rank, 1)
        run.result(rank, f"value {rank}")
    assert run.end({0: 0, 1: 0}) is RunState.SUCCEEDED, run.run.error
    assert run.helper.signals == []  # elastic stopped and restarted them, not the pump
    [restart] = [e for e in run.seen if isinstance(e, RunRestarted)]
    assert (restart.attempt, restart.max_restarts, restart.rank) == (1, 1, 1)
    assert restart.reason == "raised ValueError: bad batch"
    assert run.run.results() == {0: "value 0", 1: "value 1"}  # attempt 1's, not "stale"
    assert run.run.worker_pids == {0: 110, 1: 111}
    line = "nbaccel: rank 1 failed (raised ValueError: bad batch); restarting the workers"
    assert f"{line} (attempt 2 of 2)\n" in run.text.getvalue()
    records = run.records()
    assert [(r["rank"], r["reason"]) for r in records if r["event"] == "failure"] == [
        (1, "raised ValueError: bad batch")  # rank 0 ended after a result: no failure
    ]
    assert [r["attempt"] for r in records if r["event"] == "restarted"] == [1]


def test_a_worker_whose_status_elastic_took_first_is_recorded_once_with_elastics_code(
    tmp_path: Path,
) -> None:
    # The agent reads a worker's status without reaping it; where elastic reaped it first
    # the agent's "ended" says None, and events.jsonl once read "exitcode": null before the
    # real code of the same rank.
    run = Started(tmp_path, max_restarts=1)
    for rank in (0, 1):
        run.started(rank, 0)
    run.error(1, ValueError("first attempt"))
    run.post({"op": "worker_ended", "rank": 1, "attempt": 0, "status": 1})
    run.post({"op": "restarted", "attempt": 1})
    assert run.restarted.wait(WAIT_S)
    for rank in (0, 1):
        run.started(rank, 1)
        run.result(rank, rank)
        run.post({"op": "worker_ended", "rank": rank, "attempt": 1, "status": None})
    assert run.end({0: 0, 1: 0}) is RunState.SUCCEEDED, run.run.error
    exits = [(r["rank"], r["exitcode"]) for r in run.records() if r["event"] == "exited"]
    assert sorted(exits) == [(0, 0), (1, 0)]
    assert run.run.exit_code == 0


def test_a_killed_worker_is_blamed_over_the_peer_that_saw_it_go(tmp_path: Path) -> None:
    run = Started(tmp_path, max_restarts=2)
    for rank in (0, 1):
        run.started(rank, 0)
    run.error(0, RuntimeError("Connection closed by peer [127.0.0.1]:4012"))
    run.post({"op": "worker_ended", "rank": 0, "attempt": 0, "status": 1})
    run.post({"op": "worker_ended", "rank": 1, "attempt": 0, "status": -int(signal.SIGKILL)})
    run.post({"op": "restarted", "attempt": 1})
    assert run.restarted.wait(WAIT_S)
    [restart] = [e for e in run.seen if isinstance(e, RunRestarted)]
    assert (restart.rank, restart.reason) == (1, "killed by SIGKILL")
    assert "attempt 2 of 3" in run.text.getvalue()
    for rank in (0, 1):
        run.started(rank, 1)
        run.result(rank, rank)
    assert run.end({0: 0, 1: 0}) is RunState.SUCCEEDED, run.run.error


def test_once_restarts_are_used_up_a_failure_ends_the_run_naming_the_attempt(
    tmp_path: Path,
) -> None:
    run = Started(tmp_path, max_restarts=1)
    for rank in (0, 1):
        run.started(rank, 0)
    run.post({"op": "worker_ended", "rank": 1, "attempt": 0, "status": -int(signal.SIGKILL)})
    run.post({"op": "restarted", "attempt": 1})
    assert run.restarted.wait(WAIT_S)
    for rank in (0, 1):
        run.started(rank, 1)
    run.error(1, ValueError("bad batch"))
    # The last attempt: the arbiter stops the others, as without restarts.
    run.post({"op": "worker_ended", "rank": 1, "attempt": 1, "status": 1})  # not a restart
    deadline = threading.Event()
    for _ in range(int(WAIT_S / 0.05)):
        if run.helper.signals:
            break
        deadline.wait(0.05)
    assert run.helper.signals[:1] == [(signal.SIGTERM, None)]
    assert run.end({0: -int(signal.SIGTERM), 1: 1}) is RunState.FAILED
    with pytest.raises(ValueError) as caught:
        run.run.result()
    assert str(caught.value) == "[rank 1 in attempt 2 of 2, after 1 restart] bad batch"
    assert run.run.exit_code == 1


def test_a_killed_rank_in_the_last_attempt_says_so_in_its_error(tmp_path: Path) -> None:
    run = Started(tmp_path, max_restarts=1)
    for rank in (0, 1):
        run.started(rank, 0)
    run.post({"op": "worker_ended", "rank": 0, "attempt": 0, "status": 3})
    run.post({"op": "restarted", "attempt": 1})
    assert run.restarted.wait(WAIT_S)
    for rank in (0, 1):
        run.started(rank, 1)
    # Rank 1 dies; elastic stops rank 0 after it, and at its end reports both.
    run.post({"op": "worker_ended", "rank": 1, "attempt": 1, "status": -int(signal.SIGKILL)})
    run.post({"op": "worker_ended", "rank": 0, "attempt": 1, "status": -int(signal.SIGTERM)})
    assert run.end({0: -int(signal.SIGTERM), 1: -int(signal.SIGKILL)}) is RunState.FAILED
    message = str(run.run.error)
    assert message.startswith("rank 1 was killed by SIGKILL")
    assert message.endswith("It failed in attempt 2 of 2, after 1 restart (max_restarts=1).")


def test_a_stop_ends_the_run_even_with_restarts_left(tmp_path: Path) -> None:
    run = Started(tmp_path, max_restarts=3)
    for rank in (0, 1):
        run.started(rank, 0)
    stopping = threading.Thread(target=run.run.stop, kwargs={"timeout": WAIT_S})
    stopping.start()
    for _ in range(int(WAIT_S / 0.05)):
        if run.helper.signals:
            break
        threading.Event().wait(0.05)
    assert run.helper.signals[:1] == [(signal.SIGINT, None)]
    # The interrupted workers end, and elastic restarts the group: nothing of it counts.
    run.error(1, KeyboardInterrupt())
    run.post({"op": "worker_ended", "rank": 1, "attempt": 0, "status": 1})
    run.post({"op": "restarted", "attempt": 1})
    assert run.end({0: -int(signal.SIGKILL), 1: -int(signal.SIGKILL)}) is RunState.CANCELLED
    stopping.join(WAIT_S)
    assert not [e for e in run.seen if isinstance(e, RunRestarted)]
    assert "restarting" not in run.text.getvalue()


def train() -> int:
    return 1


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"detach": True}, "detach=True asks for a launch where a detached run's supervisor"),
        ({"max_restarts": -1}, "max_restarts"),
    ],
)
def test_what_cannot_restart_is_refused_before_anything_starts(
    nothing_started: Path, settings: dict[str, Any], fragment: str
) -> None:
    import nbaccel

    given = {"max_restarts": 1, **settings}
    with pytest.raises(nbaccel.ConfigError, match="max_restarts") as caught:
        nbaccel.launch(train, num_processes=2, use_cpu=True, runs_dir=str(nothing_started),
                       dashboard=False, **given)  # fmt: skip
    assert fragment in str(caught.value)


def test_a_one_machine_launch_with_restarts_runs_under_the_local_agent() -> None:
    from nbaccel.launcher import api

    planned = api.plan(train, (), 2, None, None, {"use_cpu": True, "max_restarts": 1})
    assert planned.placement is not None and planned.placement.shell.kind == "local"
    assert (planned.placement.hosts, planned.placement.shares) == (("127.0.0.1",), (2,))
    plain = api.plan(train, (), 2, None, None, {"use_cpu": True})
    assert plain.placement is None  # no restarts: the helper's workers, as before
