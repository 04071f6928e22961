"""The kernel's end of a run's debug channels: one socket per rank, read by one thread.

``DebugHub`` makes each rank's ``socketpair`` (``open``: the rank's end goes to its worker
with its pipes) and reads every rank's frames on a daemon thread. "stacks" answers complete
a request (``stacks``, or ``request_stacks`` with a callback for the stall warning); a rank
that stopped (``ask``) waits in ``stops`` until the thread that waits for the run takes it
(``next_stop``: ``console.DebugConsole`` then answers and prompts); the frames of a session
(``prompt``, ``resumed``) wait in ``sessions.SessionFrames``, tagged with the session the rank
numbered: a session an interrupt ended leaves nothing for the next. A run whose ranks nobody
can answer for (a detached run) is told so at once (``refuse``). ``debugging``: ranks stopped
in a debugger now, so that the stall warning does not fire while a peer is in pdb.
``ending`` (``q`` was typed) lasts one call of interactive workers, which keep one run across
calls (``new_call``). Stdlib only.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from nbaccel.frames import FrameDecoder, encode_frame
from nbaccel.launcher.debug.sessions import SessionFrames
from nbaccel.launcher.debug.stack_requests import StackRequests

# How long a stop may wait for a thread to serve it before the run says where it waits
# (``notebook_launcher`` takes it at once; a non-blocking launch waits for run.wait()).
UNSERVED_NOTICE_SECONDS = 1.0
# How long the rank stepping in a session (n, s) is awaited before another rank's stop is
# served: a step takes milliseconds, unless it runs into a collective that waits for a peer.
STEP_PATIENCE = 1.0


@dataclass(frozen=True)
class Stop:
    """A rank stopped in a debugger and waits for the kernel's answer: ``kind`` is
    "breakpoint", "step" (a later stop of the same session), or "post_mortem"; ``session``:
    the number the rank gave this stop (its frames carry it)."""

    rank: int
    kind: str
    where: str
    host: str
    session: int | None = None
    time: float = field(default_factory=time.monotonic)


class DebugHub:
    """Every rank's debug channel of one run, from the kernel's side.

    >>> hub = DebugHub()
    >>> rank_end = socket.socket(fileno=hub.open(0)); hub.start()
    >>> decoder = FrameDecoder()
    >>> def answer_stacks():  # what a rank's channel thread does
    ...     request = decoder.feed(rank_end.recv(4096))[0]
    ...     rank_end.sendall(encode_frame({"op": "stacks", "id": request["id"], "text": "..."}))
    >>> import threading; threading.Thread(target=answer_stacks).start()
    >>> hub.stacks([0], timeout=10)[0]["text"]
    '...'
    >>> hub.close(); rank_end.close()
    """

    def __init__(
        self,
        *,
        refuse: str | None = None,
        notice: Callable[[str], None] = lambda text: None,
    ) -> None:
        self._refuse = refuse
        self._notice = notice
        # Called (on the hub's thread) when a rank stops: wakes a thread that waits for
        # something else meanwhile (interactive workers wait for replies).
        self.on_stop: Callable[[], None] = lambda: None
        # Called (on the hub's thread) when a rank's session may have ended without the
        # console's answer (the rank resumed or was interrupted, its channel closed: None for
        # every rank, the run ended): a console waiting for a line for it stops waiting.
        self.on_session_end: Callable[[int | None], None] = lambda rank: None
        self._socks: dict[int, socket.socket] = {}
        self._lock = threading.Condition()
        self._send_lock = threading.Lock()
        self._stops: list[Stop] = []
        self._noticed: set[Stop] = set()
        self._sessions = SessionFrames(self._lock)
        self._requests = StackRequests()
        self._said_skip = False
        self.debugging: set[int] = set()  # ranks stopped in a debugger now
        self.died_in_debugger: set[int] = set()  # ranks whose worker ended while stopped
        self.ending = False  # q was typed on a rank: no more sessions, the run (call) ends
        self._serving = threading.Lock()  # held by the thread that serves stops
        self._closed = False
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        self._pipe_lock = threading.Lock()
        self._finished = False
        self._thread: threading.Thread | None = None

    # ----- the run's set-up and end ---------------------------------------------------
    def open(self, rank: int) -> int:
        """A channel for ``rank``: the rank's end, a file descriptor its worker inherits
        (the caller closes it once the worker has it)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socks[rank] = ours
        return theirs.detach()

    @property
    def closed(self) -> bool:
        """Whether the run has ended (no stop will come any more)."""
        return self._closed

    def new_call(self) -> None:
        """A call of interactive workers begins: a ``q`` typed in an earlier call ended that
        call, not this one (its sessions are served, its stops told of, as the first's)."""
        with self._lock:
            self.ending = False
            self._lock.notify_all()
        self._wake()

    def start(self) -> None:
        """Read every rank's frames from now on (after the last ``open``)."""
        self._thread = threading.Thread(target=self._read, name="nbaccel-debug-hub", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """The run has ended: every channel closes; a waiting thread is woken."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._thread is None or not self._thread.is_alive():
            self._finish()
        with self._pipe_lock:  # never written to once closed: the numbers may be reused
            for fd in (self._wake_read, self._wake_write):
                os.close(fd)
            self._wake_read = self._wake_write = -1

    # ----- stacks --------------------------------------------------------------------
    def stacks(self, ranks: Iterable[int], timeout: float) -> dict[int, dict[str, Any]]:
        """Each of ``ranks``' answer to "stacks" (``stacks.stacks_now``'s dict) within
        ``timeout`` seconds; ranks that did not answer are left out."""
        done = threading.Event()
        answers: dict[int, dict[str, Any]] = {}

        def take(got: dict[int, dict[str, Any]]) -> None:
            answers.update(got)
            done.set()

        self.request_stacks(ranks, timeout, take)
        done.wait(timeout + 1.0)
        return answers

    def request_stacks(
        self,
        ranks: Iterable[int],
        timeout: float,
        done: Callable[[dict[int, dict[str, Any]]], None],
    ) -> None:
        """Ask ``ranks`` for their stacks; ``done(answers)`` is called once, on the hub's
        thread, when all answered or ``timeout`` passed (with those that did)."""
        with self._lock:
            asked = {rank for rank in ranks if rank in self._socks}
            if not asked or self._closed:
                asked = set()
            else:
                number, request = self._requests.add(asked, time.monotonic() + timeout, done)
        if not asked:
            done({})
            return
        for rank in asked:
            if not self._send(rank, {"op": "stacks", "id": number}):
                with self._lock:
                    request.ranks.discard(rank)
        self._wake()

    # ----- debugger stops ------------------------------------------------------------
    def next_stop(self, timeout: float, prefer: int | None = None) -> Stop | None:
        """The oldest stop waiting for an answer, or None after ``timeout`` or once the run
        has ended. ``prefer``: the rank stepping in the session in progress (``n``, ``s``),
        whose next stop is awaited ``STEP_PATIENCE`` seconds before another rank's is
        taken, so that one session is not cut by another's at every step."""
        now = time.monotonic()
        deadline = now + timeout
        patience = now + STEP_PATIENCE if prefer is not None else now
        with self._lock:
            while not self._closed:
                mine = [s for s in self._stops if s.rank == prefer]
                if not self.ending and (mine or (self._stops and time.monotonic() >= patience)):
                    stop = (mine or self._stops)[0]
                    self._stops.remove(stop)
                    self._noticed.discard(stop)
                    return stop
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if self._stops and not self.ending:
                    left = min(left, max(0.0, patience - time.monotonic()))
                self._lock.wait(left)
        return None

    def serving(self) -> bool:
        """Take the right to serve stops (one thread at a time); False if another has it.
        ``done_serving`` gives it back."""
        return self._serving.acquire(blocking=False)

    def done_serving(self) -> None:
        self._serving.release()

    def answer(self, stop: Stop, yes: bool, why: str = "") -> None:
        self._send(stop.rank, {"op": "answer", "yes": yes, "why": why, "session": stop.session})
        if not yes:
            with self._lock:
                self.debugging.discard(stop.rank)

    def send_line(self, stop: Stop, text: str | None) -> None:
        """A line typed for the stopped rank's pdb (None: end of input, which quits it)."""
        self._send(stop.rank, {"op": "line", "text": text, "session": stop.session})

    def skip(self, stop: Stop, why: str) -> None:
        """The session cannot be held after all: the rank leaves pdb and goes on."""
        self._send(stop.rank, {"op": "skip", "why": why, "session": stop.session})

    def session_frame(self, stop: Stop) -> dict[str, Any] | None:
        """The next frame ("prompt", "resumed") of ``stop``'s session; None once the rank's
        channel or the run has closed. Frames of the rank's earlier sessions are dropped."""
        return self._sessions.take(stop.rank, stop.session, lambda: self._closed)

    def session_over(self, stop: Stop) -> bool:
        """Whether ``stop``'s session has ended without waiting for a line (the rank was
        interrupted, its worker is gone, the run ended): the console asks before it reads
        a line, ``on_session_end`` tells it while it reads."""
        return self._sessions.over(stop.rank, stop.session, self._closed)

    # ----- the reader thread -----------------------------------------------------------
    def _read(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_read, selectors.EVENT_READ, None)
        decoders = {}
        with self._lock:
            for rank, sock in self._socks.items():
                selector.register(sock, selectors.EVENT_READ, rank)
                decoders[rank] = FrameDecoder()
        try:
            while not self._closed:
                for key, _ in selector.select(self._timeout()):
                    if key.data is None:
                        os.read(self._wake_read, 4096)
                        continue
                    rank = key.data
                    if rank not in self._socks:
                        continue  # closed by _lost meanwhile
                    try:
                        data = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
                    except OSError:
                        data = b""
                    if not data:
                        selector.unregister(key.fileobj)
                        self._lost(rank)
                        continue
                    for message in decoders[rank].feed(data):
                        if isinstance(message, dict):
                            self._take(rank, message)
                self._due(time.monotonic())
        finally:
            selector.close()
            self._finish()

    def _take(self, rank: int, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "stacks":
            with self._lock:
                self._requests.answered(rank, message)
        elif op == "ask":
            where, host = str(message["where"]), str(message["host"])
            stop = Stop(rank, str(message["kind"]), where, host, message.get("session"))
            if self._refuse is not None:
                self.answer(stop, False, self._refuse)
                return
            with self._lock:
                self.debugging.add(rank)
                self._stops.append(stop)
                self._lock.notify_all()
            self.on_stop()
        elif op in ("prompt", "resumed"):
            if op == "resumed" and not message.get("stepping"):
                session = message.get("session")
                with self._lock:
                    self.debugging.discard(rank)
                    if message.get("quit"):
                        # q ends the run: stops of other ranks wait to be ended with it
                        self.ending = True
                    # A stop interrupted before it was served: nobody will answer it now.
                    gone = [s for s in self._stops if (s.rank, s.session) == (rank, session)]
                    for stop in gone:
                        self._stops.remove(stop)
                        self._noticed.discard(stop)
            self._sessions.put(rank, message)
            if op == "resumed":
                self.on_session_end(rank)
        elif op == "skipped" and not self._said_skip:
            self._said_skip = True
            self._notice(
                f"rank {rank}: a debugger stop at {message.get('where')} was skipped: "
                f"{message.get('why')} (later ones are skipped too)."
            )

    def _due(self, now: float) -> None:
        """Complete the stacks requests that are answered or due; tell of unserved stops."""
        with self._lock:
            finished = self._requests.due(now)
            unserved = [
                s
                for s in self._stops
                if s not in self._noticed and now - s.time >= UNSERVED_NOTICE_SECONDS
            ]
            if self.ending:
                unserved = []
            self._noticed.update(unserved)
        for request in finished:
            request.done(request.got)
        for stop in unserved:
            self._notice(
                f"rank {stop.rank} stopped in the debugger at {stop.where} and waits: "
                "run.wait() or run.result() (workers: the next call) opens pdb in the cell."
            )

    def _timeout(self) -> float | None:
        with self._lock:
            deadlines = self._requests.deadlines()
            deadlines += [
                s.time + UNSERVED_NOTICE_SECONDS
                for s in self._stops
                if s not in self._noticed and not self.ending
            ]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def stopped_in_debugger(self) -> set[int]:
        """The ranks whose worker ended while stopped in pdb. Asked once every worker has
        ended, it also counts those still marked stopped: this thread may not have seen
        their channel close yet when the run's pump thread asks."""
        with self._lock:
            return self.died_in_debugger | self.debugging

    def _lost(self, rank: int) -> None:
        """A rank's channel closed (its worker ended): nothing more comes from it."""
        with self._lock:
            sock = self._socks.pop(rank, None)
            self._stops = [s for s in self._stops if s.rank != rank]
            if rank in self.debugging:
                self.died_in_debugger.add(rank)
            self.debugging.discard(rank)
            self._requests.forget_rank(rank)
        if sock is not None:
            sock.close()
        self._sessions.lost(rank)
        self.on_session_end(rank)

    def _finish(self) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            socks, self._socks = dict(self._socks), {}
            requests = self._requests.take_all()
            self._stops.clear()
            self.debugging.clear()
            self._closed = True
            self._lock.notify_all()
        for sock in socks.values():
            sock.close()
        self.on_session_end(None)
        for request in requests:
            request.done(request.got)

    def _send(self, rank: int, message: dict[str, Any]) -> bool:
        with self._lock:
            sock = self._socks.get(rank)
        if sock is None:
            return False
        with self._send_lock:
            try:
                sock.sendall(encode_frame(message))
                return True
            except OSError:
                return False

    def _wake(self) -> None:
        with self._pipe_lock:
            if self._wake_write == -1:
                return  # closed: the run has ended
            try:
                os.write(self._wake_write, b"x")
            except BlockingIOError:
                pass  # already woken
