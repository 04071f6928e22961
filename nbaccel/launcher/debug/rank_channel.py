"""A rank's end of its debug channel: stacks on request, breakpoints and post-mortems.

``RankDebugger`` owns the channel's socket. A daemon thread blocks on it (a run that never
stops pays nothing) and answers ``{"op": "stacks"}`` at once (``stacks.stacks_now``), even
while the main thread waits in a collective, which releases the GIL; a thread that holds the
GIL in C code keeps it from answering, and the kernel then falls back to faulthandler's dump
into the rank's log (SIGUSR2, as the hang report does). Every other frame from the kernel
(an answer, a typed line) goes to the thread in the debugger.

``install`` makes ``breakpoint()`` and ``pdb.set_trace()`` open a ``ChannelPdb`` here, as
Python's own hook would open pdb: ``PYTHONBREAKPOINT=0`` turns them off and another value
names the hook to call (read at each call, as Python does); ``debugger=False`` skips them.
A stop first asks the kernel whether someone can type (``ask``); where nobody can (a
detached run, a notebook executed headless, a terminal without a tty) or there is no channel
(a torch_xla launch), the rank skips it and says so once, in its log and in the cell.

Frames, rank -> kernel: ``stacks`` (the answer), ``ask`` (kind, where, host), ``prompt``
(pdb's output and prompt: a line is awaited), ``resumed`` (output, stepping, quit,
interrupted), ``skipped`` (where, why: said once). Kernel -> rank: ``stacks``, ``answer``
(yes, why), ``line`` (text), ``skip`` (why: the kernel could not take the session after all).
Each stop asked is numbered (``session``) and every frame of its session carries the number
both ways, so that what an interrupted session left unread is never taken for the next
one's. One thread of the rank is in pdb at a time: the others' stops wait for it (a lock
held from the ask to the end of the interaction), as they would share one input. Stdlib
only.
"""

from __future__ import annotations

import itertools
import os
import pdb
import queue
import socket
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

from nbaccel.frames import FrameDecoder, encode_frame
from nbaccel.launcher.debug.rank_pdb import ChannelPdb, Skipped
from nbaccel.launcher.debug.stacks import stacks_now

SIGNAL_CHECK_S = 0.2  # how long a wait for the kernel goes without a signal handled
# What the rank says of a skipped stop, after why: where to look instead.
SKIP_HINT = (
    "Debug from a kernel with a frontend (JupyterLab, VS Code) or a terminal, or see where "
    "every rank is with run.stacks()."
)


class RankDebugger:
    """The debug channel of rank ``rank`` on ``host``; ``fd``: its socket (None: none, as
    on torch_xla, where every stop is skipped).

    >>> import socket
    >>> kernel, rank_end = socket.socketpair()
    >>> debugger = RankDebugger(rank_end.detach(), rank=1, host="node1")
    >>> debugger.start()
    >>> kernel.sendall(encode_frame({"op": "stacks", "id": 7}))
    >>> reply = FrameDecoder().feed(kernel.recv(1 << 16))[0]
    >>> reply["op"], reply["id"], reply["text"].startswith("Thread MainThread")
    ('stacks', 7, True)
    >>> debugger.close(); kernel.close()
    """

    def __init__(self, fd: int | None, rank: int, host: str) -> None:
        self.rank, self.host = rank, host
        self._sock = socket.socket(fileno=fd) if fd is not None else None
        self._send_lock = threading.Lock()
        self._inbox: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        # One pdb at a time in this process, held from a stop's ask to the end of its
        # interaction: two threads would otherwise read each other's lines (ChannelPdb).
        self.lock = threading.RLock()
        self._sessions = itertools.count(1)
        self._session = 0  # the number of the stop asked last (its frames carry it)
        self._enabled = True
        self._off_why = ""
        self._said_skip = False
        self.quit_where: str | None = None  # where ``q`` was typed: the run ends there
        self._thread: threading.Thread | None = None
        # A process forked from the rank (a DataLoader worker) inherits the hook and the
        # socket but not the thread that reads it: there every stop is skipped, never waited.
        self._pid = os.getpid()

    # ----- the channel ------------------------------------------------------------
    def start(self) -> None:
        """Serve the kernel's requests on a daemon thread."""
        if self._sock is not None and self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="nbaccel-debug", daemon=True)
            self._thread.start()

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()

    def send(self, message: dict[str, Any]) -> bool:
        """Send one frame to the kernel; False when the channel is gone (or not this
        process's: a forked child must not write into its rank's stream)."""
        if self._sock is None or os.getpid() != self._pid:
            return False
        frame = encode_frame(message)
        with self._send_lock:
            try:
                self._sock.sendall(frame)
                return True
            except OSError:
                return False

    def _serve(self) -> None:
        assert self._sock is not None
        decoder = FrameDecoder()
        me = {threading.get_ident()}
        try:
            while data := self._sock.recv(1 << 16):
                for message in decoder.feed(data):
                    if not isinstance(message, dict):
                        continue
                    if message.get("op") == "stacks":
                        self.send({"op": "stacks", "id": message.get("id"), **stacks_now(me)})
                    else:
                        self._inbox.put(message)
        except OSError:
            pass
        self._inbox.put(None)  # the kernel is gone: a waiting debugger sees end of input

    def _next(self, *ops: str) -> dict[str, Any] | None:
        """The kernel's next frame of one of ``ops`` for the session asked last (others are
        stale, of a session an interrupt ended: dropped)."""
        while True:
            try:
                # Waited in short spells: a SIGINT (the run interrupted while pdb waits for
                # a line) that the OS hands to another thread leaves this one blocked, and
                # Python runs the handler here only once the wait returns.
                message = self._inbox.get(timeout=SIGNAL_CHECK_S)
            except queue.Empty:
                continue
            if message is None:
                break
            if message.get("op") in ops and message.get("session") == self._session:
                return message
        self._inbox.put(None)  # end of input stays the answer for every later read
        return None

    # ----- what ChannelPdb asks (rank_pdb.SessionLink) ------------------------------
    def ask(self, kind: str, where: str) -> tuple[bool, str]:
        if not self._enabled:
            return False, self._off_why
        if os.getpid() != self._pid:
            return False, (
                f"it runs in a process forked from rank {self.rank} (a DataLoader worker?), "
                "which has no debug channel of its own"
            )
        self._session = session = next(self._sessions)
        ask = {"op": "ask", "kind": kind, "where": where, "host": self.host, "session": session}
        if not self.send(ask):
            return False, "this rank has no debug channel to the kernel"
        try:
            answer = self._next("answer")
        except BaseException:  # interrupted before the kernel answered: the stop is withdrawn
            self.resumed("", stepping=False, quitting=False, interrupted=True)
            raise
        if answer is None:
            return False, "the kernel's end of the debug channel closed"
        return bool(answer["yes"]), str(answer.get("why", ""))

    def read_line(self, output: str, prompt: str) -> str | None:
        frame = {"op": "prompt", "output": output, "prompt": prompt, "session": self._session}
        if not self.send(frame):
            return None
        message = self._next("line", "skip")
        if message is None:
            return None
        if message["op"] == "skip":
            raise Skipped(message.get("why", ""))
        return str(message["text"]) if message.get("text") is not None else None

    def resumed(
        self, output: str, stepping: bool, quitting: bool, interrupted: bool = False
    ) -> None:
        self.send(
            {
                "op": "resumed",
                "output": output,
                "stepping": stepping,
                "quit": quitting,
                "interrupted": interrupted,
                "session": self._session,
            }
        )

    def skipped(self, where: str, why: str) -> None:
        if self._said_skip:
            return
        self._said_skip = True
        print(
            f"nbaccel: a debugger stop at {where} on rank {self.rank} was skipped: {why}. "
            f"Later ones are skipped too. {SKIP_HINT}",
            file=sys.stderr,
            flush=True,
        )
        self.send({"op": "skipped", "where": where, "why": why})

    # ----- breakpoint() and pdb.set_trace() ------------------------------------------
    def install(self, enabled: bool) -> None:
        """Take over ``breakpoint()`` and ``pdb.set_trace()`` in this process; ``enabled``:
        the launch's ``debugger`` (off: every stop is skipped, said once)."""
        self._enabled = enabled and self._sock is not None
        if not enabled:
            self._off_why = "the launch has debugger=False"
        elif self._sock is None:
            self._off_why = "this rank has no debug channel (torch_xla launches have none yet)"
        sys.breakpointhook = self.breakpointhook
        pdb.set_trace = self.pdb_set_trace

    def breakpointhook(self, *args: Any, **kwargs: Any) -> Any:
        """``sys.breakpointhook``: Python's rules for ``PYTHONBREAKPOINT``, then ours."""
        hook = os.environ.get("PYTHONBREAKPOINT", "")
        if hook == "0":
            return None
        if hook not in ("", "pdb.set_trace"):
            return sys.__breakpointhook__(*args, **kwargs)  # imports and calls that hook
        return self.set_trace(sys._getframe(1), header=kwargs.get("header"))

    def pdb_set_trace(self, *, header: str | None = None, **_: Any) -> None:
        """``pdb.set_trace()`` on a rank: the kernel's cell is its terminal."""
        self.set_trace(sys._getframe(1), header=header)

    def set_trace(self, frame: FrameType, header: str | None = None) -> None:
        """Stop in ``frame`` (the caller of ``breakpoint()``) if someone can answer."""
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        # Held until the interaction that set_trace leads to ends (ChannelPdb gives it back):
        # pdb stops at the caller's next line, after this returns.
        self.lock.acquire()
        try:
            yes, why = self.ask("breakpoint", where)
        except BaseException:
            self.lock.release()
            raise
        if not yes:
            self.lock.release()
            self.skipped(where, why)
            return
        debugger = self._pdb()
        debugger.holds_lock = True
        if header is not None:
            debugger.message(header)
        debugger.set_trace(frame)

    def post_mortem(self, error: BaseException) -> bool:
        """Open pdb at the frame that raised ``error``, if someone can answer; whether a
        session was held."""
        tb = error.__traceback__
        if tb is None:
            return False
        with self.lock:
            where = ChannelPdb._where(None, tb)
            yes, why = self.ask("post_mortem", where)
            if not yes:
                self.skipped(where, why)
                return False
            debugger = self._pdb()
            debugger.message(f"{type(error).__name__}: {error}")
            debugger.post_mortem(_from_user_code(tb))
            return True

    def _pdb(self) -> ChannelPdb:
        return _QuitNoting(self, f"[rank {self.rank} on {self.host}] (Pdb) ")


class _QuitNoting(ChannelPdb):
    """Remembers where ``q`` was typed, for the run's error ("quit in the debugger")."""

    def __init__(self, owner: RankDebugger, prompt: str) -> None:
        super().__init__(owner, prompt)
        self._owner = owner  # ``link``, typed as the RankDebugger that keeps ``quit_where``

    def do_quit(self, arg: str) -> Any:
        frame = self.curframe
        if frame is not None:
            self._owner.quit_where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        return super().do_quit(arg)

    do_q = do_exit = do_quit


def _from_user_code(tb: TracebackType) -> TracebackType:
    """``tb`` without the launcher's frames above the user's code (the bootstrap, the serve
    loop): pdb's ``u`` stops at the user's outermost frame. pdb opens at the innermost."""
    start = tb
    while start.tb_next is not None and _in_launcher(start.tb_frame):
        start = start.tb_next
    return start


def _in_launcher(frame: FrameType) -> bool:
    return str(frame.f_globals.get("__name__", "")).startswith("nbaccel.launcher.")
