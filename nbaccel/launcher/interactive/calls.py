"""The kernel's side of a call's replies: a reader thread, and the error a failed call raises.

``Replies`` reads every rank's reply frames on a thread of its own: the kernel's main
thread, where an interrupt lands, only takes whole replies from a queue. Replies are plain
data read with ``unpickling.loads`` (the value inside stays bytes until the caller loads it).
``build_cell_error`` turns the ranks' error reports into the exception a launch would raise
(``outcome.failures``): the worker's type, ``[rank N]``, the remote traceback as its cause
(and ``outcome.failures.note_kernel_name``'s note on a NameError for a name the kernel has);
``check_ranks`` refuses ranks the workers do not have, before a call is sent;
``raise_at_rank_line`` raises a rank's error from the user's line that failed on the rank.
"""

from __future__ import annotations

import os
import queue
import re
import selectors
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from nbaccel import unpickling
from nbaccel.errors import DebuggerQuit, RemoteTraceback
from nbaccel.events import WorkerFailed
from nbaccel.launcher.interactive.wire import recv_frame_fds, send_frame
from nbaccel.launcher.outcome.failures import Failure, build_error, choose_culprit


class Replies:
    """Reads the ranks' replies into a queue until closed; a closed connection is reported
    as ``{"rank": r, "lost": True}``."""

    def __init__(self, conns: Mapping[int, socket.socket]) -> None:
        self._queue: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        for rank, conn in conns.items():
            self._selector.register(conn, selectors.EVENT_READ, rank)
        self._thread = threading.Thread(target=self._read, name="nbaccel-workers", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Wake the thread waiting in ``next`` (a rank stopped in the debugger): it gets
        ``{"poke": True}``."""
        self._queue.put({"poke": True})

    def next(self, timeout: float) -> dict[str, Any] | None:
        """The next reply, or None after ``timeout`` seconds."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop reading (the caller closes the connections after)."""
        if self._wake_write == -1:
            return
        os.write(self._wake_write, b"x")
        self._thread.join(timeout=10)
        self._selector.close()
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)
        self._wake_write = -1

    def _read(self) -> None:
        watched = len(self._selector.get_map()) - 1
        while watched:
            for key, _ in self._selector.select():
                if key.data is None:
                    return  # closed
                rank: int = key.data
                conn: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    frame, fds = recv_frame_fds(conn)
                except OSError:
                    frame, fds = None, []
                if frame is None:
                    self._selector.unregister(conn)
                    watched -= 1
                    self._queue.put({"rank": rank, "lost": True})
                else:  # "fds": the segments of the value's buffers (the taker closes them)
                    self._queue.put({**unpickling.loads(frame), "fds": fds})


class Sender:
    """Sends each command's frame to every rank on a thread of its own, so that an interrupt
    in the kernel's main thread never cuts a frame in half. ``failure``: why the last send
    failed (a rank's connection gone), else None. The thread ends with the process (daemon)
    or at ``close``."""

    def __init__(self, conns: Mapping[int, socket.socket]) -> None:
        self._conns = dict(conns)
        self._jobs: queue.SimpleQueue[tuple[bytes, tuple[int, ...], threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="nbaccel-send", daemon=True)
        self._thread.start()

    def send(self, frame: bytes, fds: Sequence[int] = ()) -> threading.Event:
        """Queue ``frame`` (with ``fds``: shared-memory segments, which stay the caller's
        until the event is set) for every rank; the event is set once all have it (or it
        failed)."""
        done = threading.Event()
        self._jobs.put((frame, tuple(fds), done))
        return done

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            frame, fds, done = job
            self.failure = None
            try:
                for conn in self._conns.values():
                    send_frame(conn, frame, fds)
            except OSError as error:
                self.failure = error
            done.set()


def build_cell_error(
    replies: Sequence[dict[str, Any]],
    world_size: int,
    collective_timeout: float,
    host_of: Callable[[int], str | None] = lambda rank: None,
) -> BaseException:
    """The exception of the rank that failed on its own (before those its failure caused),
    as a launch raises it. Every reply is in hand, so among ranks that failed on their own
    the lowest is named, not the quickest: a cell that fails everywhere names rank 0."""
    failures = []
    for reply in replies:
        report: WorkerFailed = reply["error"]
        failures.append(Failure(report.rank, report.cause, 0.0, report=report))
    culprit = choose_culprit(failures)
    error = build_error(
        culprit,
        world_size=world_size,
        collective_timeout=collective_timeout,
        host=host_of(culprit.rank),  # on several machines, where it ran
    )
    if isinstance(error, DebuggerQuit):  # the workers stay: only the call was ended
        ended = "the call was interrupted on every rank; the workers and their namespaces stay"
        quit_error = DebuggerQuit(rank=error.rank, where=error.where, host=error.host, ended=ended)
        quit_error.__cause__ = error.__cause__
        return quit_error
    return error


def check_ranks(ranks: frozenset[int], world_size: int, asked: str) -> None:
    """Refuse ranks that these workers do not have (``asked``: how the caller named them).

    >>> check_ranks(frozenset({1}), 2, "--ranks 1")
    >>> check_ranks(frozenset({5}), 2, "--ranks 5")
    Traceback (most recent call last):
    ValueError: --ranks 5 names rank 5, but these workers have ranks 0 and 1 (world size 2): ...
    """
    unknown = sorted(r for r in ranks if not 0 <= r < world_size)
    if unknown:
        names = "rank" + ("s " if len(unknown) > 1 else " ") + ", ".join(map(str, unknown))
        have = "rank 0" if world_size == 1 else f"ranks 0 {'and' if world_size == 2 else 'to'}"
        have += f" {world_size - 1}" if world_size > 1 else ""
        raise ValueError(
            f"{asked} names {names}, but these workers have {have} (world size {world_size}): "
            "name some of those, or all."
        )


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TRACEBACK = "Traceback (most recent call last):"


def raise_at_rank_line(error: BaseException, filename: str) -> NoReturn:
    """Raise a rank's ``error`` from the line of ``filename`` that failed on the rank (the
    outermost such frame of its last exception), so IPython's traceback ends at the user's
    line (as ``%%time`` ends at its ``<timed exec>``) and not in nbaccel: IPython shows the
    frame that raises even when it is hidden. Raised as it is where the rank's traceback
    names no such line, and a SyntaxError too (IPython shows every frame of one)."""
    __tracebackhide__ = True
    cause = error.__cause__
    if not isinstance(cause, RemoteTraceback) or isinstance(error, SyntaxError):
        raise error
    found = [
        int(match.group(2))
        for section in reversed(cause.text.split(_TRACEBACK))
        for match in _FRAME.finditer(section)
        if match.group(1) == filename
    ][:1]
    if not found:
        raise error
    # A frame that runs only ``raise``, numbered and named as the line on the rank.
    code = compile("\n" * (found[0] - 1) + "raise __nbaccel_error__", filename, "exec")
    exec(code, {"__nbaccel_error__": error.with_traceback(None)})
    raise AssertionError("unreachable")  # pragma: no cover - the exec raised
