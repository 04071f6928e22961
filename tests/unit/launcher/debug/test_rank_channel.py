"""A rank's end of its debug channel, against a scripted kernel on the other end of a
socketpair: stacks while the main thread is blocked, breakpoint() and pdb.set_trace() in a
session typed from the kernel, the skips (PYTHONBREAKPOINT, debugger=False, nobody to
type), q, an interrupt while pdb waits for a line, and post-mortems."""

from __future__ import annotations

import bdb
import os
import pdb
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from nbaccel.frames import FrameDecoder, encode_frame
from nbaccel.launcher.debug.rank_channel import RankDebugger

WAIT = 10.0  # every wait for the other end is bounded


class ScriptedKernel:
    """The kernel's end: answers every ask with ``yes`` (or ``why`` not), types ``lines``,
    and records every frame it got."""

    def __init__(self, sock: socket.socket, lines: list[str], yes: bool = True, why: str = ""):
        self.sock, self.lines, self.yes, self.why = sock, list(lines), yes, why
        self.frames: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.seen: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self._read()
        except OSError:
            pass  # the test closed its end

    def _read(self) -> None:
        decoder = FrameDecoder()
        while data := self.sock.recv(1 << 16):
            for message in decoder.feed(data):
                self.seen.append(message)
                self.frames.put(message)
                session = message.get("session")  # the stop's number, echoed
                if message["op"] == "ask":
                    answer = {"op": "answer", "yes": self.yes, "why": self.why}
                    self._send({**answer, "session": session})
                elif message["op"] == "prompt":
                    line = self.lines.pop(0) if self.lines else None
                    self._send({"op": "line", "text": line, "session": session})

    def _send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(encode_frame(message))

    def wait_for(self, op: str) -> dict[str, Any]:
        """The next frame of ``op`` (frames come on the reader's thread)."""
        while (message := self.frames.get(timeout=WAIT))["op"] != op:
            pass
        return message

    def output(self) -> str:
        return "".join(str(m.get("output", "")) for m in self.seen)


@pytest.fixture
def channel() -> Iterator[tuple[RankDebugger, socket.socket]]:
    kernel, rank_end = socket.socketpair()
    debugger = RankDebugger(rank_end.detach(), rank=1, host="node1")
    debugger.start()
    saved = sys.breakpointhook, pdb.set_trace
    try:
        yield debugger, kernel
    finally:
        sys.breakpointhook, pdb.set_trace = saved
        sys.settrace(None)
        debugger.close()
        kernel.close()


def _frames(kernel: socket.socket, count: int) -> list[dict[str, Any]]:
    decoder, got = FrameDecoder(), []
    kernel.settimeout(WAIT)
    while len(got) < count:
        got += decoder.feed(kernel.recv(1 << 16))
    return got


def test_stacks_are_answered_while_the_main_thread_is_blocked_in_a_call(
    channel: tuple[RankDebugger, socket.socket],
) -> None:
    _, kernel = channel
    asleep, release = threading.Event(), threading.Event()

    def blocked_in_c() -> None:  # as a collective waits: a C call that released the GIL
        asleep.set()
        release.wait(WAIT)

    sleeper = threading.Thread(target=blocked_in_c, name="trainer")
    sleeper.start()
    assert asleep.wait(WAIT)
    started = time.monotonic()
    kernel.sendall(encode_frame({"op": "stacks", "id": 3}))
    [answer] = _frames(kernel, 1)
    assert time.monotonic() - started < 2.0  # at once (the channel's thread answers)
    assert answer["op"] == "stacks" and answer["id"] == 3
    text = answer["text"]
    assert text.splitlines()[0] == "Thread MainThread (main):"
    assert "Thread trainer:" in text and "in blocked_in_c" in text
    assert "nbaccel-debug" not in text  # the answering thread is not shown
    release.set()
    sleeper.join()


def test_a_breakpoint_opens_pdb_typed_from_the_kernel(
    channel: tuple[RankDebugger, socket.socket],
) -> None:
    debugger, kernel = channel
    debugger.install(enabled=True)
    typed = ScriptedKernel(kernel, ["p x * 2", "n", "p y", "c"])

    def user_code() -> int:
        x = 21
        breakpoint()
        y = x + 1
        return y

    assert user_code() == 22
    while sum(m["op"] == "resumed" for m in typed.seen) < 2:  # c's frame may still travel
        typed.frames.get(timeout=WAIT)
    asks = [m for m in typed.seen if m["op"] == "ask"]
    assert asks[0]["kind"] == "breakpoint" and asks[0]["host"] == "node1"
    assert asks[0]["where"].endswith(f"{__file__}:{user_code.__code__.co_firstlineno + 2}")
    assert [m["kind"] for m in asks[1:]] == ["step"]  # the stop after n asks again
    prompts = [m for m in typed.seen if m["op"] == "prompt"]
    assert {m["prompt"] for m in prompts} == {"[rank 1 on node1] (Pdb) "}
    output = typed.output()
    assert "42" in output and "22" in output  # p x * 2, then p y after n
    resumed = [m for m in typed.seen if m["op"] == "resumed"]
    assert [m["stepping"] for m in resumed] == [True, False]  # n steps, c runs on
    assert sys.gettrace() is None  # c without breakpoints: no tracing left behind


def test_pdb_set_trace_is_taken_over_too(channel: tuple[RankDebugger, socket.socket]) -> None:
    debugger, kernel = channel
    debugger.install(enabled=True)
    typed = ScriptedKernel(kernel, ["p value", "c"])
    value = "seen by pdb"  # noqa: F841 - read in pdb
    pdb.set_trace()
    assert "seen by pdb" in typed.output()


def test_q_raises_bdbquit_where_it_was_typed(channel: tuple[RankDebugger, socket.socket]) -> None:
    debugger, kernel = channel
    debugger.install(enabled=True)
    typed = ScriptedKernel(kernel, ["q"])
    line = sys._getframe().f_lineno + 3  # pdb stops at the line after breakpoint()
    with pytest.raises(bdb.BdbQuit):
        breakpoint()
        pytest.fail("q ran on")  # pdb stops here: q is typed on this line
    assert debugger.quit_where == f"{__file__}:{line}"
    assert typed.wait_for("resumed")["quit"] is True


def test_pythonbreakpoint_0_turns_breakpoints_off_and_a_named_hook_is_called(
    channel: tuple[RankDebugger, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    debugger, kernel = channel
    debugger.install(enabled=True)
    typed = ScriptedKernel(kernel, [])
    monkeypatch.setenv("PYTHONBREAKPOINT", "0")
    assert breakpoint() is None
    monkeypatch.setenv("PYTHONBREAKPOINT", "os.getpid")  # any callable, as Python's hook
    assert breakpoint() == os.getpid()
    assert typed.seen == []  # the kernel was never asked


@pytest.mark.parametrize(
    ("enabled", "yes", "why"),
    [
        (False, True, "the launch has debugger=False"),
        (True, False, "this notebook runs without a frontend that takes input"),
    ],
)
def test_a_stop_nobody_can_answer_is_skipped_and_said_once(
    channel: tuple[RankDebugger, socket.socket],
    capsys: pytest.CaptureFixture[str],
    enabled: bool,
    yes: bool,
    why: str,
) -> None:
    debugger, kernel = channel
    debugger.install(enabled=enabled)
    typed = ScriptedKernel(kernel, [], yes=yes, why=why)
    for _ in range(3):
        breakpoint()  # skipped: the code goes on
    typed.wait_for("skipped")
    said = capsys.readouterr().err
    assert said.count("was skipped") == 1 and why in said  # once, in the rank's log
    assert [m["why"] for m in typed.seen if m["op"] == "skipped"] == [why]  # once, to the cell
    assert not any(m["op"] == "prompt" for m in typed.seen)


def test_no_channel_skips_with_a_reason(capsys: pytest.CaptureFixture[str]) -> None:
    saved = sys.breakpointhook, pdb.set_trace
    try:
        RankDebugger(None, rank=0, host="tpu").install(enabled=True)
        breakpoint()
    finally:
        sys.breakpointhook, pdb.set_trace = saved
    assert "torch_xla launches have none yet" in capsys.readouterr().err


@pytest.mark.parametrize("landing", ["process", "another thread"])
def test_an_interrupt_while_pdb_waits_for_a_line_raises_in_the_users_code(
    channel: tuple[RankDebugger, socket.socket], landing: str
) -> None:
    debugger, kernel = channel
    debugger.install(enabled=True)
    typed = ScriptedKernel(kernel, [])
    typed.lines = []  # never typed: the interrupt comes while pdb waits
    # The kernel does not answer the prompt: hold it, and interrupt this thread.
    held = threading.Event()
    original = typed._send

    def hold_prompts(message: dict[str, Any]) -> None:
        if message["op"] == "line":
            held.set()
            return
        original(message)

    typed._send = hold_prompts  # type: ignore[method-assign]

    def interrupt() -> None:
        if held.wait(WAIT) and landing == "process":
            os.kill(os.getpid(), signal.SIGINT)  # the OS hands it to a thread of its choice
        elif held.is_set():  # as the OS may: this thread gets it, the main one waits on
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        else:  # no prompt came: end the session, so that the test fails instead of hanging
            original({"op": "line", "text": "c", "session": 1})

    timer = threading.Timer(0.5, interrupt)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        breakpoint()
        time.sleep(WAIT)  # never reached
    timer.join()
    assert sys.gettrace() is None
    assert typed.wait_for("resumed")["quit"] is False


def test_post_mortem_opens_at_the_frame_that_raised(
    channel: tuple[RankDebugger, socket.socket],
) -> None:
    debugger, kernel = channel
    typed = ScriptedKernel(kernel, ["p secret", "u", "p outer", "c"])

    def inner() -> None:
        secret = "kept in the frame"
        raise ValueError(secret)

    def outer() -> None:
        outer = "the caller's"  # noqa: F841 - read by pdb
        inner()

    try:
        outer()
    except ValueError as error:
        assert debugger.post_mortem(error)
    [ask] = [m for m in typed.seen if m["op"] == "ask"]
    assert ask["kind"] == "post_mortem"
    output = typed.output()
    assert "ValueError: kept in the frame" in output
    assert "'kept in the frame'" in output and '"the caller\'s"' in output


def test_a_process_forked_from_the_rank_skips_its_breakpoints_instead_of_hanging(
    channel: tuple[RankDebugger, socket.socket], capfd: pytest.CaptureFixture[str]
) -> None:
    debugger, kernel = channel
    debugger.install(enabled=True)
    typed = ScriptedKernel(kernel, [])
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say: the hook and the socket, not the reader thread
        try:
            breakpoint()
            print("went on", flush=True)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)  # bounded by the test's timeout: it must not hang
    said = capfd.readouterr()
    assert status == 0 and said.out == "went on\n"
    assert "in a process forked from rank 1" in said.err
    assert typed.seen == []  # nothing written into the rank's own stream
