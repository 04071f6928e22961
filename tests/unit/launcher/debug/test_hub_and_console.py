"""The kernel's end of a run's debug channels: stacks asked of every rank (and a rank that
does not answer), stops served one after the other in the cell, the stepping rank first,
what a detached run answers, what nobody to type answers, and the notice for a stop that
nobody serves. Ranks are played by threads on the rank ends of the hub's socketpairs."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from nbaccel.frames import FrameDecoder, encode_frame
from nbaccel.launcher.debug import hub as hub_module
from nbaccel.launcher.debug.console import DebugConsole
from nbaccel.launcher.debug.hub import DebugHub
from nbaccel.launcher.debug.waiting import wait_serving

WAIT = 10.0


class FakeRank:
    """One rank's end: sends frames, reads the kernel's."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.settimeout(WAIT)
        self._decoder = FrameDecoder()
        self._got: list[dict[str, Any]] = []

    def send(self, **message: Any) -> None:
        self.sock.sendall(encode_frame(message))

    def next(self) -> dict[str, Any]:
        while not self._got:
            self._got += self._decoder.feed(self.sock.recv(1 << 16))
        return self._got.pop(0)


@pytest.fixture
def hub() -> Iterator[DebugHub]:
    notices: list[str] = []
    made = DebugHub(notice=notices.append)
    made.notices = notices  # type: ignore[attr-defined]
    yield made
    made.close()


def test_stacks_come_from_every_rank_and_a_silent_one_is_left_out(hub: DebugHub) -> None:
    ranks = {rank: FakeRank(hub.open(rank)) for rank in (0, 1)}
    hub.start()

    def answer() -> None:
        request = ranks[0].next()
        ranks[0].send(op="stacks", id=request["id"], text="rank 0's", waits_in="barrier")

    threading.Thread(target=answer, daemon=True).start()
    started = time.monotonic()
    got = hub.stacks([0, 1], timeout=0.5)  # rank 1 never answers
    assert got == {0: {"op": "stacks", "id": 1, "text": "rank 0's", "waits_in": "barrier"}}
    assert time.monotonic() - started < 0.5 * 5


def test_stops_are_served_one_after_the_other_each_named(hub: DebugHub) -> None:
    ranks = {rank: FakeRank(hub.open(rank)) for rank in (0, 1)}
    hub.start()
    for rank, fake in ranks.items():  # both stop at once
        fake.send(op="ask", kind="breakpoint", where=f"train.py:{rank + 10}", host="h")
    typed: list[tuple[str, str]] = []
    written: list[str] = []

    def prompt(text: str) -> str:
        typed.append((text, "c"))
        return "c"

    console = DebugConsole(hub, prompt=prompt, write=written.append, can_type=lambda: None)

    def play(fake: FakeRank, rank: int) -> None:
        assert fake.next() == {"op": "answer", "yes": True, "why": "", "session": None}
        fake.send(op="prompt", output=f"> train.py({rank + 10})\n", prompt=f"[rank {rank}] ")
        assert fake.next() == {"op": "line", "text": "c", "session": None}
        fake.send(op="resumed", output="", stepping=False, quit=False)

    players = [threading.Thread(target=play, args=(ranks[r], r), daemon=True) for r in (0, 1)]
    for player in players:
        player.start()
    for _ in range(2):
        stop = hub.next_stop(WAIT)
        assert stop is not None
        assert console.serve(stop) is False
    for player in players:
        player.join(WAIT)
    text = "".join(written)
    first = text.index("--- pdb on rank 0 (h), stopped by breakpoint() at train.py:10")
    second = text.index("--- pdb on rank 1 (h), stopped by breakpoint() at train.py:11")
    assert first < text.index("--- rank 0 runs on ---") < second
    assert [p for p, _ in typed] == ["[rank 0] ", "[rank 1] "]
    assert not hub.debugging


def test_the_stepping_rank_is_served_before_a_waiting_one(hub: DebugHub) -> None:
    ranks = {rank: FakeRank(hub.open(rank)) for rank in (0, 1)}
    hub.start()
    ranks[1].send(op="ask", kind="breakpoint", where="b.py:1", host="h")
    assert hub.next_stop(WAIT) is not None  # rank 1's session (served elsewhere)
    ranks[0].send(op="ask", kind="breakpoint", where="a.py:1", host="h")
    deadline = time.monotonic() + WAIT
    while 0 not in hub.debugging and time.monotonic() < deadline:  # rank 0's stop is queued
        time.sleep(0.01)
    ranks[1].send(op="ask", kind="step", where="b.py:2", host="h")
    stop = hub.next_stop(WAIT, prefer=1)
    assert stop is not None and (stop.rank, stop.kind) == (1, "step")
    stop = hub.next_stop(WAIT, prefer=1)  # rank 1 does not stop again: rank 0's turn
    assert stop is not None and stop.rank == 0


def test_nobody_to_type_answers_no_with_why(hub: DebugHub) -> None:
    rank = FakeRank(hub.open(0))
    hub.start()
    rank.send(op="ask", kind="breakpoint", where="a.py:1", host="h")
    stop = hub.next_stop(WAIT)
    assert stop is not None
    console = DebugConsole(hub, can_type=lambda: "nobody is there")
    assert console.serve(stop) is False
    assert rank.next() == {"op": "answer", "yes": False, "why": "nobody is there", "session": None}


def test_a_detached_run_refuses_at_once() -> None:
    hub = DebugHub(refuse="a detached run has no cell to type into")
    rank = FakeRank(hub.open(0))
    hub.start()
    try:
        rank.send(op="ask", kind="breakpoint", where="a.py:1", host="h", session=3)
        answer = rank.next()
        assert answer["why"] == "a detached run has no cell to type into"
        assert answer["session"] == 3  # the rank takes only its own stop's answer
        assert hub.next_stop(0.1) is None
    finally:
        hub.close()


def test_a_stop_nobody_serves_is_told_and_a_waiter_serves_it(
    hub: DebugHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hub_module, "UNSERVED_NOTICE_SECONDS", 0.1)
    rank = FakeRank(hub.open(0))
    hub.start()
    rank.send(op="ask", kind="breakpoint", where="a.py:7", host="h")
    deadline = time.monotonic() + WAIT
    while not hub.notices and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.01)
    [notice] = hub.notices  # type: ignore[attr-defined]
    assert "rank 0 stopped in the debugger at a.py:7" in notice and "run.wait()" in notice
    done = threading.Event()

    def play() -> None:
        assert rank.next()["yes"]
        rank.send(op="resumed", output="", stepping=False, quit=False)
        done.set()

    threading.Thread(target=play, daemon=True).start()
    console = DebugConsole(hub, write=lambda text: None, can_type=lambda: None)
    # run.wait()'s loop serves it, then returns once the run is done
    assert wait_serving(hub, console, done, timeout=WAIT)


def test_the_stdin_refusal_of_a_frontend_skips_the_session(hub: DebugHub) -> None:
    rank = FakeRank(hub.open(0))
    hub.start()
    rank.send(op="ask", kind="breakpoint", where="a.py:1", host="h")

    class StdinNotImplementedError(Exception):  # ipykernel's, by name
        pass

    def refuse(prompt: str) -> str:
        raise StdinNotImplementedError("raw_input was called")

    def play() -> None:
        assert rank.next()["yes"]
        rank.send(op="prompt", output="", prompt="(Pdb) ")
        assert rank.next()["op"] == "skip"
        rank.send(op="resumed", output="", stepping=False, quit=False)

    player = threading.Thread(target=play, daemon=True)
    player.start()
    console = DebugConsole(hub, prompt=refuse, write=lambda text: None, can_type=lambda: None)
    stop = hub.next_stop(WAIT)
    assert stop is not None
    assert console.serve(stop) is False
    player.join(WAIT)
    rank.send(op="ask", kind="breakpoint", where="a.py:2", host="h")
    stop = hub.next_stop(WAIT)
    assert stop is not None
    console.serve(stop)  # refused at once from now on
    assert rank.next()["yes"] is False


def test_closing_wakes_a_waiting_session(hub: DebugHub) -> None:
    rank = FakeRank(hub.open(0))
    hub.start()
    rank.send(op="ask", kind="breakpoint", where="a.py:1", host="h")
    stop = hub.next_stop(WAIT)
    assert stop is not None
    written: list[str] = []
    console = DebugConsole(hub, write=written.append, can_type=lambda: None)
    threading.Timer(0.2, hub.close).start()
    assert console.serve(stop) is False  # the run ended while the rank was in pdb
    assert "--- rank 0 has ended: its worker is gone" in "".join(written)


def test_a_rank_stopped_in_pdb_counts_as_such_before_its_closed_channel_is_read(
    hub: DebugHub,
) -> None:
    # The run's pump thread asks once every worker has ended, which the hub's thread may
    # not have seen yet (the channel's close is still unread): a CollectiveTimeout must name
    # the rank as stopped in the debugger either way (it did so only by chance before).
    rank = FakeRank(hub.open(1))
    hub.start()
    rank.send(op="ask", kind="breakpoint", where="a.py:7", host="h")
    deadline = time.monotonic() + WAIT
    while 1 not in hub.debugging:
        assert time.monotonic() < deadline, "the stop did not reach the hub"
        time.sleep(0.01)
    assert hub.stopped_in_debugger() == {1}  # the worker ended; the hub has not read it yet
    rank.sock.close()
    while 1 not in hub.died_in_debugger:
        assert time.monotonic() < deadline, "the hub did not see the channel close"
        time.sleep(0.01)
    assert hub.stopped_in_debugger() == {1}
