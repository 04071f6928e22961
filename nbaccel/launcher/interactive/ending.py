"""How a call of interactive workers collects its replies under interrupts, and how the group
ends: the half of ``WorkerGroup`` (``workers.py``) that deals with ranks that fail, hang, die
or are interrupted. A rank's error gets the ranks still busy SIGINT after a grace (they may wait
for it in a collective); an interrupt gets them SIGINT at once; a rank still busy a grace after
SIGINT, a lost connection, or a run that ended, ends the group, and every later call says why.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from nbaccel.errors import WorkersEnded
from nbaccel.launcher.interactive.calls import Replies, Sender, build_cell_error
from nbaccel.launcher.run import Run

INTERRUPT_GRACE = 5.0  # how long a rank gets to stop after SIGINT before the group is ended
ENDED_GRACE = 10.0  # how long a run that lost a rank gets to say why and end the others


class CallEnding:
    """``WorkerGroup``'s state this half reads (set by ``WorkerGroup._start``)."""

    _run: Run | None
    _conns: dict[int, socket.socket]
    _replies: Replies
    _sender: Sender
    _listener: socket.socket
    _ended_why: str
    _finalizer: Any
    _changed: Callable[[], None]  # after_training.AfterTraining's: the group's watchers

    def _wait(self, run: Run, interrupted: bool, replies: dict[int, dict[str, Any]]) -> None:
        """Every rank's reply, into ``replies``. An interrupt (here, or while the command
        was being sent) gets the ranks SIGINT at once; one rank's error gets the ranks still
        busy SIGINT after ``INTERRUPT_GRACE`` (they may be waiting for it in a collective).
        SIGINT goes again each second to the ranks still busy (one that started the command
        after the first took nothing; a rank takes one interrupt per command). A rank still
        busy ``INTERRUPT_GRACE`` after the first SIGINT (stuck in a collective or in C code)
        ends the group; a second interrupt here ends it at once."""
        deadline: float | None = None  # when the ranks still busy get SIGINT, or are given up
        signalled_at: float | None = None
        reason = ""
        while len(replies) < len(self._conns):
            try:
                if interrupted:
                    interrupted = False
                    raise KeyboardInterrupt
                # Once the busy ranks have been sent SIGINT, a rank's stop is not served: its
                # ask is being interrupted, and a prompt for it would be closed at once.
                self._take_reply(run, replies, serve=signalled_at is None)
                if deadline is None and errors_of(replies):
                    failed = errors_of(replies)[0]
                    # q in pdb: the call ends now, not after the peers' grace
                    quit = failed["error"].type == "bdb.BdbQuit"
                    deadline = time.monotonic() + (0.0 if quit else INTERRUPT_GRACE)
                    reason = f"rank {failed['rank']} " + ("quit the debugger" if quit else "failed")
                now = time.monotonic()
                if signalled_at is None and deadline is not None and now > deadline:
                    signalled_at, deadline = now, now + INTERRUPT_GRACE
                    self._interrupt(run, replies)
                elif signalled_at is not None and deadline is not None and now > deadline:
                    raise self._stuck(run, replies, reason)
                elif signalled_at is not None and now > signalled_at + 1.0:
                    signalled_at = now
                    self._interrupt(run, replies)
            except KeyboardInterrupt:
                if reason == "the interrupt":
                    raise self._stuck(run, replies, "a second interrupt") from None
                reason = "the interrupt"
                signalled_at = time.monotonic()
                deadline = signalled_at + INTERRUPT_GRACE
                self._interrupt(run, replies)

    def _interrupt(self, run: Run, replies: Mapping[int, Any]) -> None:
        busy = sorted(set(self._conns) - set(replies))
        if busy:
            run.signal_workers(signal.SIGINT, busy)

    def _take_reply(self, run: Run, replies: dict[int, dict[str, Any]], serve: bool = True) -> None:
        if serve:
            run._serve_debugger()  # a rank stopped in breakpoint(): its pdb, in this cell
        reply = self._replies.next(0.25)
        if reply is not None and reply.get("poke"):
            return  # a rank stopped: served at the next turn
        if reply is not None and reply.get("lost"):
            raise self._ended(run, f"rank {reply['rank']}'s connection closed")
        if reply is not None:
            replies[reply["rank"]] = reply
        elif run.processes_ended:
            raise self._ended(run, "the workers' run ended")

    def _stuck(self, run: Run, replies: dict[int, dict[str, Any]], reason: str) -> WorkersEnded:
        stuck = ", ".join(map(str, sorted(set(self._conns) - set(replies))))
        why = (
            f"rank(s) {stuck} did not stop within {INTERRUPT_GRACE:g} s of SIGINT after "
            f"{reason}, stuck in a collective or in C code?"
        )
        self._end(f"they were ended after {reason}: {why}")
        error = WorkersEnded(
            f"{why} So the workers were ended. Start them again with workers.restart(), or "
            "make new ones with nbaccel.Workers(...) (their namespaces start empty)."
        )
        failed = errors_of(replies)
        if failed:
            timeout = run.config.collective_timeout
            error.__cause__ = build_cell_error(failed, run.world_size, timeout, run.host_of)
        return error

    def _ended(self, run: Run, what: str) -> BaseException:
        """The group lost a rank: the run first records why (its exit code or signal, as a
        launch names it, and stops the others), then whatever is left is stopped."""
        try:
            run._await_end(ENDED_GRACE)
        except TimeoutError:
            pass
        cause = run.error or run.kept_error
        first = str(cause).splitlines()[0] if cause is not None and str(cause) else ""
        self._end(f"{what}: {first}" if first else what)
        why = f" ({first})" if first else ""
        error = WorkersEnded(
            f"{what}{why}: the workers are gone. Start them again with workers.restart(), or "
            "make new ones with nbaccel.Workers(...) (their namespaces start empty)."
        )
        error.__cause__ = cause
        return error

    def _end(self, why: str) -> None:
        """End the workers at once; ``why`` is what every later call says."""
        run, self._run = self._run, None
        if run is not None:
            self._ended_why = why
            self._finalizer.detach()
            shut(run, self._replies, self._sender, self._conns, self._listener, None)
            self._changed()


def shut(
    run: Run,
    replies: Replies,
    sender: Sender,
    conns: Mapping[int, socket.socket],
    listener: socket.socket,
    wait: float | None,
) -> None:
    """End the workers: their connections close, so each leaves its serve loop and exits;
    a run still going ``wait`` seconds later (or at once, with None) is stopped."""
    run._post({"op": "release"})  # their exits from now on were asked for
    replies.close()
    sender.close()
    for conn in conns.values():
        conn.close()
    try:
        run._await_end(wait if wait is not None else 0.0)
    except TimeoutError:
        run.stop()
    listener.close()


def errors_of(replies: Mapping[int, dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in replies.values() if r["status"] == "error"]
