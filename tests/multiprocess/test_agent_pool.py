"""The pool that keeps several-machine agents between launches (``agent_link.py``), with
stand-in agents: small Python processes that speak the agent's frames on this machine
(``RemoteShell("local")``), so each case costs a Python start, not an ``import torch``.
The real agents' reuse over SSH is tested in tests/multihost/test_agents_kept.py."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from nbaccel.launcher.remote.agent_link import AgentLink, AgentPool
from nbaccel.launcher.remote_shell import RemoteShell

TIMEOUT_S = 30.0

# First the probe's line, as a real agent's first step prints it. Then, for each start: a
# line on stderr naming the run, and "done" saying whether it stays (the start's "stays");
# "leave" ends it as an agent that breaks would.
STAND_IN = """
import os, sys
from nbaccel.frames import FrameDecoder, encode_frame
print("a login banner")
print('{"nbaccel_probe": 1, "python": "3.11.2"}', flush=True)
decoder = FrameDecoder()
while data := os.read(0, 65536):
    for message in decoder.feed(data):
        if message["op"] == "leave":
            os._exit(3)
        print("serving", message["run"], file=sys.stderr, flush=True)
        done = encode_frame({"op": "done", "stays": message["stays"]})
        if message.get("late"):  # a worker's end said after "done", in the same write
            done += encode_frame({"op": "ended", "rank": 0, "attempt": 0, "status": 0})
        os.write(1, done)
"""

SHELL = RemoteShell("local", python=sys.executable)


class Holder:
    """A launch's side of a link: the messages it got, and the agent's end."""

    def __init__(self, link: AgentLink, log: Path) -> None:
        self.messages: list[dict[str, Any]] = []
        self.ended: list[str] = []
        self.over = threading.Event()
        link.hold(self._message, self._end, log)

    def _message(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self.over.set()

    def _end(self, reason: str) -> None:
        self.ended.append(reason)
        self.over.set()


@pytest.fixture
def pool() -> Iterator[AgentPool]:
    pool = AgentPool(agent_argv=("-c", STAND_IN))
    yield pool
    pool.close_all()


def serve(pool: AgentPool, log: Path, run: str, *, stays: bool = True) -> AgentLink:
    """One launch on the host's agent: hold it, start, wait for its "done", give it back."""
    link = pool.take(SHELL, "node1")
    serve_held(link, log, run, stays=stays)
    pool.give_back(SHELL, link)
    return link


def serve_held(link: AgentLink, log: Path, run: str, *, stays: bool = True) -> None:
    holder = Holder(link, log)
    link.send({"op": "start", "run": run, "stays": stays})
    assert holder.over.wait(TIMEOUT_S), "no answer from the agent"
    assert holder.messages == [{"op": "done", "stays": stays}]


def test_an_agent_that_stays_is_taken_again_and_each_launch_keeps_its_own_output(
    pool: AgentPool, tmp_path: Path
) -> None:
    first = serve(pool, tmp_path / "first.log", "run-1")
    assert pool.has_idle(SHELL, "node1") and not pool.has_idle(SHELL, "node2")
    second = serve(pool, tmp_path / "second.log", "run-2")
    assert second is first and psutil.Process(first.pid).is_running()
    pool.close_all()  # both logs are complete once the agent is gone
    assert (tmp_path / "first.log").read_text() == "serving run-1\n"
    assert (tmp_path / "second.log").read_text() == "serving run-2\n"
    assert not pool.has_idle(SHELL, "node1")


def test_an_agent_that_does_not_stay_is_ended(pool: AgentPool, tmp_path: Path) -> None:
    link = serve(pool, tmp_path / "run.log", "run-1", stays=False)
    assert not pool.has_idle(SHELL, "node1")
    assert not psutil.pid_exists(link.pid) or psutil.Process(link.pid).status() == "zombie"


def test_an_agent_that_left_while_idle_is_replaced(pool: AgentPool, tmp_path: Path) -> None:
    first = serve(pool, tmp_path / "first.log", "run-1")
    psutil.Process(first.pid).kill()
    assert first.wait_ended(TIMEOUT_S)  # its channel's end: the pool offers it no more
    assert not pool.has_idle(SHELL, "node1")
    second = serve(pool, tmp_path / "second.log", "run-2")
    assert second is not first and second.pid != first.pid


def test_a_holder_hears_an_agent_that_breaks_with_its_exit_code(
    pool: AgentPool, tmp_path: Path
) -> None:
    link = pool.take(SHELL, "node1")
    holder = Holder(link, tmp_path / "run.log")
    link.send({"op": "leave", "run": "run-1"})
    assert holder.over.wait(TIMEOUT_S)
    assert holder.ended == ["the agent exited with code 3"] and not link.alive
    pool.give_back(SHELL, link)  # said no "done": ended, not kept
    assert not pool.has_idle(SHELL, "node1")


def test_an_agent_is_probed_on_its_own_channel_before_its_frames(
    pool: AgentPool, tmp_path: Path
) -> None:
    link = pool.take(SHELL, "node1")
    answer = link.probe(TIMEOUT_S)
    assert answer is not None and answer.returncode == 0
    assert answer.stdout == 'a login banner\n{"nbaccel_probe": 1, "python": "3.11.2"}\n'
    serve_held(link, tmp_path / "run.log", "run-1")  # its frames follow, whole
    pool.give_back(SHELL, link)


def test_an_agent_that_ends_before_its_probe_answers_with_its_code_and_output(
    tmp_path: Path,
) -> None:
    pool = AgentPool(agent_argv=("-c", "import sys; sys.exit('no such module: nbaccel')"))
    link = pool.take(SHELL, "node1")
    answer = link.probe(TIMEOUT_S)
    assert answer is not None and answer.returncode == 1
    assert answer.stdout == "" and answer.stderr == "no such module: nbaccel\n"
    link.close()


def test_close_all_ends_every_idle_agent(pool: AgentPool, tmp_path: Path) -> None:
    links = [pool.take(SHELL, host) for host in ("node1", "node2")]
    for index, link in enumerate(links):
        holder = Holder(link, tmp_path / f"{index}.log")
        link.send({"op": "start", "run": f"run-{index}", "stays": True})
        assert holder.over.wait(TIMEOUT_S)
        pool.give_back(SHELL, link)
    assert sorted(link.pid for link in pool.idle_links()) == sorted(link.pid for link in links)
    processes = [psutil.Process(link.pid) for link in links]
    pool.close_all()
    _, alive = psutil.wait_procs(processes, timeout=TIMEOUT_S)
    assert not alive and pool.idle_links() == []


def test_a_launch_hears_of_an_agent_that_ended_before_it_subscribed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nbaccel.launcher.remote import remote_hosts

    # A one-machine agent that cannot start (as one whose interpreter breaks at once).
    monkeypatch.setattr(remote_hosts, "AGENT_ARGV", ("-c", "import sys; sys.exit('broken')"))
    hosts = remote_hosts.RemoteHosts(["127.0.0.1"], [1], SHELL, tmp_path, local=True)
    try:
        (link,) = hosts._links
        assert link.wait_ended(TIMEOUT_S)
        heard: list[dict[str, Any]] = []
        hosts.subscribe("run-1", heard.append)  # after the agent's end: it is not lost
        assert [message["op"] for message in heard] == ["helper_died"]
        assert "exited with code 1" in heard[0]["error"] and "broken" in heard[0]["error"]
        assert heard[0]["run"] == "run-1"
    finally:
        hosts.close()


def test_a_real_agent_whose_channel_reader_breaks_says_why_and_leaves(tmp_path: Path) -> None:
    # The reader of the kernel's channel is what stops a host: if a frame breaks it, the
    # agent must not stay on, deaf to the kernel (its workers could never be stopped).
    from nbaccel.launcher.remote.agent_link import AGENT_ARGV

    link = AgentLink("127.0.0.1", SHELL.argv("127.0.0.1", [SHELL.python, *AGENT_ARGV]))
    holder = Holder(link, tmp_path / "agent.log")
    try:
        link.send({"op": "start", "max_restarts": "not a number"})
        assert link.wait_ended(TIMEOUT_S * 4), "the agent stayed on without its reader"
        failed = [m for m in holder.messages if m["op"] == "failed"]
        assert len(failed) == 1 and "ValueError" in failed[0]["error"], holder.messages
        assert holder.ended == ["the agent exited with code 1"]
    finally:
        link.close()


def test_what_an_agent_says_after_done_reaches_no_launch(pool: AgentPool, tmp_path: Path) -> None:
    link = pool.take(SHELL, "node1")
    first = Holder(link, tmp_path / "first.log")
    link.send({"op": "start", "run": "run-1", "stays": True, "late": True})
    assert first.over.wait(TIMEOUT_S)
    link.release()
    second = Holder(link, tmp_path / "second.log")
    link.send({"op": "start", "run": "run-2", "stays": True})
    assert second.over.wait(TIMEOUT_S)  # the late frame was read before this "done"
    assert first.messages == [{"op": "done", "stays": True}]
    assert second.messages == [{"op": "done", "stays": True}]
    pool.give_back(SHELL, link)


def test_a_frame_the_kernel_will_not_read_ends_the_launch_saying_why(tmp_path: Path) -> None:
    # A frame that names a class of a module the kernel has not imported (a torch object,
    # say) is not unpickled (that would import the module): the launch hears why and ends.
    from tests.unit.launcher.test_unreadable_frames import ELSEWHERE, refused_frame

    agent = (
        "import os\n"
        "print('{\"nbaccel_probe\": 1}', flush=True)\n"
        "os.read(0, 65536)\n"  # the launch's start: it holds the link by now
        f"os.write(1, bytes.fromhex({refused_frame().hex()!r}))\n"
        "os.read(0, 65536)\n"
    )
    link = AgentLink("node1", [sys.executable, "-c", agent])
    try:
        holder = Holder(link, tmp_path / "agent.log")
        link.send({"op": "start", "run": "run-1"})
        assert holder.over.wait(TIMEOUT_S)
        [failed] = holder.messages
        assert failed["op"] == "failed" and f"holds a {ELSEWHERE}.Scalar" in failed["error"]
        assert ELSEWHERE not in sys.modules
    finally:
        link.close()
