"""``WorkerGroup``: a process group that keeps its state between cells (parent side; the
public ``nbaccel.Workers`` adds the per-call dashboard above the launcher, ``nbaccel.interactive``).

It is one long launch (``api.start``) whose function is ``serve.serve``: every rank connects
back over an abstract Unix socket, checked to be this user's (``control.same_user``) and to
know the launch's secret token, and then runs the commands sent to it. Output and events
keep flowing through the run's pipes and pump; ``relay.CellRelay`` hands them to the call in
progress. A reader thread reads every reply, so an interrupt in the kernel's main thread
never cuts a frame in half. Torch-free: replies are read with ``unpickling.loads``; only a
returned value is unpickled as ``Run.result`` does (a tensor imports torch, as asked).
"""

from __future__ import annotations

import pickle
import secrets
import signal
import socket
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from nbaccel import unpickling
from nbaccel.config.resolve import ConfigSource
from nbaccel.errors import ConfigError, WorkersEnded
from nbaccel.events import RunEnded, RunStarted, RunState
from nbaccel.launcher import api
from nbaccel.launcher.bootstrap.payload import cell_sources, dumps_call
from nbaccel.launcher.control import same_user
from nbaccel.launcher.interactive.calls import Replies, build_cell_error
from nbaccel.launcher.interactive.relay import CellRelay
from nbaccel.launcher.interactive.wire import (
    ADDRESS_PREFIX,
    recv_frame,
    send_frame,
    serve_on_rank,
)
from nbaccel.launcher.printer import TextPrinter
from nbaccel.launcher.pump import Subscriber
from nbaccel.launcher.run import Run

START_TIMEOUT = 300.0  # a cold start imports torch and may load CUDA: minutes on a slow disk
INTERRUPT_GRACE = 5.0  # how long a rank gets to stop after SIGINT before the group is ended
OUTPUT_GRACE = 2.0  # how long a call waits for the last of its output to be shown
_REFUSED = ("hosts", "detach", "max_restarts", "num_machines")
# The last Workers made in this process, weakly: where ``%%nbaccel`` without a name runs.
_last_made: weakref.ref[WorkerGroup] | None = None


def last_workers() -> WorkerGroup | None:
    """The last ``Workers`` made in this process, if it still exists (closed or not)."""
    return _last_made() if _last_made is not None else None


class WorkerGroup:
    """The processes of ``nbaccel.Workers`` (``nbaccel/interactive.py``) and their calls;
    shown as text here. See docs/interactive.md."""

    def __init__(
        self,
        num_processes: int | None = None,
        *,
        config: ConfigSource = None,
        **overrides: Any,
    ) -> None:
        for key in _REFUSED:
            if overrides.get(key):
                raise ConfigError(
                    f"{key}= is not supported by nbaccel.Workers yet (interactive workers run "
                    "on this machine, attached to this kernel). Use nbaccel.launch for it.",
                    field=key,
                )
        self._num_processes = num_processes
        self._config = config
        self._overrides = dict(overrides)
        self._seq = 0
        self._sent_sources: set[str] = set()
        self.memory: dict[int, dict[str, int]] = {}  # per rank, after the last call
        self._run: Run | None = None
        self._start()
        global _last_made
        _last_made = weakref.ref(self)

    # ----- public API -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._live_run().world_size

    @property
    def pids(self) -> dict[int, int]:
        """{rank: pid} of the live workers."""
        return dict(self._pids)

    @property
    def alive(self) -> bool:
        return self._run is not None and not self._run.state.done

    def run(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[int, Any]:
        """Call ``function(*args, **kwargs)`` on every rank; ``{rank: value}``.

        The function travels as ``launch`` sends it (cells' functions by value). A failing
        rank raises its exception here, ``[rank N]`` in its message; an interrupt raises
        ``KeyboardInterrupt`` and leaves the workers ready for the next call.
        """
        call = dumps_call(function, args, kwargs)
        return self._call({"op": "run", "call": call})

    def run_cell(
        self, code: str, filename: str, show_ranks: frozenset[int] | None = None
    ) -> dict[int, Any]:
        """Run a cell's ``code`` in every rank's namespace (what ``%%nbaccel`` does); the
        repr of its last expression on each rank (None when there is none). ``show_ranks``:
        whose output is shown for this cell (default: ``log_ranks``'s; empty: all)."""
        return self._call({"op": "exec", "code": code, "filename": filename}, show_ranks)

    def push(self, **values: Any) -> None:
        """Set ``name=value`` in every rank's namespace (the same value on each)."""
        self._call({"op": "push", "values": dumps_call(dict, (), values)}, shown=False)

    def pull(self, name: str) -> dict[int, Any]:
        """``{rank: value}`` of ``name`` in every rank's namespace."""
        values = self._call({"op": "pull", "names": [name]}, shown=False)
        return {rank: found[name] for rank, found in values.items()}

    def free_memory(self) -> dict[int, dict[str, int]]:
        """Collect garbage and empty the device's cache on every rank; memory after it."""
        self._call({"op": "free"}, shown=False)
        return dict(self.memory)

    def restart(self) -> None:
        """End the workers and start them afresh with the same config (namespaces empty)."""
        self.close()
        self._start()

    def close(self, timeout: float = 30.0) -> None:
        """End the workers: each leaves its serve loop and exits; stopped if it will not."""
        run, self._run = self._run, None
        if run is not None:
            self._finalizer.detach()
            _shut(run, self._replies, self._conns, self._listener, wait=timeout)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "alive" if self.alive else "closed"
        return f"<nbaccel.Workers {state} world_size={len(self._pids)} pids={self._pids}>"

    # ----- start and calls ----------------------------------------------------------
    def _start(self) -> None:
        token = secrets.token_hex(16)
        address = ADDRESS_PREFIX + token
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen()
        self._listener = listener
        self._relay = CellRelay()
        try:
            run = api.start(
                serve_on_rank,
                (address, token),
                self._num_processes,
                None,
                self._config,
                self._overrides,
                show=self._subscribe_relay,
            )
            self._run = run
            self._conns, self._pids = _accept_ranks(listener, run, token)
        except BaseException:
            if self._run is not None:
                self._run.stop()
                self._run = None
            listener.close()
            raise
        self._replies = Replies(self._conns)
        # Workers dropped without close() (a setup cell run again, a script's end) end too:
        # the finalizer holds what it closes, never this object.
        self._finalizer = weakref.finalize(
            self, _shut, run, self._replies, self._conns, listener, 10.0
        )

    def _display(self, run: Run, gpus: int, show_ranks: frozenset[int] | None) -> Subscriber:
        """What shows one call's output and events, in the calling cell: rank-labelled text
        here; ``nbaccel.Workers`` shows a dashboard per call in a kernel with widgets."""
        ranks = run.shown_ranks() if show_ranks is None else (show_ranks or None)
        return TextPrinter(sys.stdout, ranks, announce_end=False)

    def _subscribe_relay(self, run: Run, gpus: int) -> None:
        self._gpus = gpus
        # Between calls (a rank's thread printing), output goes out as text.
        self._idle = TextPrinter(sys.stdout, run.shown_ranks(), announce_end=False)
        self._relay.target = self._idle
        run.subscribe(self._relay)

    def _live_run(self) -> Run:
        if self._run is None:
            raise WorkersEnded(
                "these workers were closed (workers.close(), or they ended after an error). "
                "Start them again with workers.restart()."
            )
        return self._run

    def _call(
        self,
        command: dict[str, Any],
        show_ranks: frozenset[int] | None = None,
        *,
        shown: bool = True,
    ) -> dict[int, Any]:
        """Send ``command`` to every rank and return their values. ``shown``: the call gets
        a display of its own (a dashboard in a kernel); push, pull and free_memory print
        what the ranks print, as text, and nothing else."""
        run = self._live_run()
        self._seq += 1
        seq = self._seq
        new_sources = {k: v for k, v in cell_sources().items() if k not in self._sent_sources}
        self._sent_sources |= set(new_sources)
        frame = pickle.dumps({**command, "seq": seq, "sources": new_sources}, protocol=5)
        display = self._display(run, self._gpus, show_ranks) if shown else self._idle
        self._relay.target = display
        started = time.time()
        display(RunStarted(run.run_id, run.world_size, str(run.run_dir), started))
        error: BaseException | None = None
        try:
            try:
                for conn in self._conns.values():
                    send_frame(conn, frame)
            except BaseException as failed:  # a frame cut short: the stream has lost its place
                self._end(f"sending a command to the workers failed ({failed!r})")
                raise
            replies = self._wait(run)
            visible = run.shown_ranks() if show_ranks is None else (show_ranks or None)
            ranks = visible if visible is not None else run.ranks
            self._relay.wait_output(seq, ranks, OUTPUT_GRACE)
            self.memory = {rank: reply.get("memory", {}) for rank, reply in replies.items()}
            errors = _errors(replies)
            if errors:
                raise build_cell_error(errors, run.world_size, run.config.collective_timeout)
            if any(r["status"] == "interrupted" for r in replies.values()):
                raise KeyboardInterrupt
            return {rank: pickle.loads(r["value"]) for rank, r in sorted(replies.items())}
        except BaseException as failed:
            error = failed
            raise
        finally:
            state = RunState.SUCCEEDED if error is None else RunState.FAILED
            if isinstance(error, KeyboardInterrupt):
                state, error = RunState.CANCELLED, None
            display(RunEnded(state, error, time.time() - started, time.time()))
            self._relay.target = self._idle

    def _wait(self, run: Run) -> dict[int, dict[str, Any]]:
        """Every rank's reply. An interrupt gets every rank SIGINT at once; one rank's error
        gets the ranks still busy SIGINT after ``INTERRUPT_GRACE`` (they may be waiting for
        it in a collective). A rank still busy ``INTERRUPT_GRACE`` after SIGINT (stuck in a
        collective or in C code) ends the group; a second interrupt ends it at once."""
        replies: dict[int, dict[str, Any]] = {}
        deadline: float | None = None  # when the ranks still busy get SIGINT, or are given up
        signalled = False
        reason = ""
        while len(replies) < len(self._conns):
            try:
                self._take_reply(run, replies)
                if deadline is None and _errors(replies):
                    deadline = time.monotonic() + INTERRUPT_GRACE
                    reason = f"rank {_errors(replies)[0]['rank']} failed"
                if deadline is not None and time.monotonic() > deadline and not signalled:
                    run.signal_workers(signal.SIGINT)
                    signalled, deadline = True, time.monotonic() + INTERRUPT_GRACE
                elif deadline is not None and time.monotonic() > deadline:
                    raise self._stuck(run, replies, reason)
            except KeyboardInterrupt:
                if signalled and reason == "the interrupt":
                    raise self._stuck(run, replies, "a second interrupt") from None
                run.signal_workers(signal.SIGINT)
                signalled, reason = True, "the interrupt"
                deadline = time.monotonic() + INTERRUPT_GRACE
        return replies

    def _take_reply(self, run: Run, replies: dict[int, dict[str, Any]]) -> None:
        reply = self._replies.next(0.25)
        if reply is not None and reply.get("lost"):
            raise self._ended(run, f"rank {reply['rank']}'s connection closed")
        if reply is not None:
            replies[reply["rank"]] = reply
        elif run.state.done:
            raise self._ended(run, "the workers' run ended")

    def _stuck(self, run: Run, replies: dict[int, dict[str, Any]], reason: str) -> WorkersEnded:
        stuck = sorted(set(self._conns) - set(replies))
        self._end("stuck ranks")
        error = WorkersEnded(
            f"rank(s) {', '.join(map(str, stuck))} did not stop within {INTERRUPT_GRACE:g} s "
            f"of SIGINT after {reason} (stuck in a collective or in C code?), so the workers "
            "were ended. Start them again with workers.restart() (their namespaces start empty)."
        )
        failed = _errors(replies)
        if failed:
            timeout = run.config.collective_timeout
            error.__cause__ = build_cell_error(failed, run.world_size, timeout)
        return error

    def _ended(self, run: Run, what: str) -> BaseException:
        self._end(what)
        try:
            run.wait(10)
        except TimeoutError:
            pass
        cause = run.error
        error = WorkersEnded(
            f"{what}: the workers are gone ({run.state.value}). Start them again with "
            "workers.restart() (their namespaces start empty)."
        )
        error.__cause__ = cause
        return error

    def _end(self, why: str) -> None:
        run, self._run = self._run, None
        if run is not None:
            self._finalizer.detach()
            _shut(run, self._replies, self._conns, self._listener, wait=None)


def _shut(
    run: Run,
    replies: Replies,
    conns: Mapping[int, socket.socket],
    listener: socket.socket,
    wait: float | None,
) -> None:
    """End the workers: their connections close, so each leaves its serve loop and exits;
    a run still going ``wait`` seconds later (or at once, with None) is stopped."""
    replies.close()
    for conn in conns.values():
        conn.close()
    try:
        run.wait(wait if wait is not None else 0.0)
    except TimeoutError:
        run.stop()
    listener.close()


def _errors(replies: Mapping[int, dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in replies.values() if r["status"] == "error"]


def _accept_ranks(
    listener: socket.socket, run: Run, token: str
) -> tuple[dict[int, socket.socket], dict[int, int]]:
    """Each rank's connection, checked (this user, the launch's token), by rank."""
    conns: dict[int, socket.socket] = {}
    pids: dict[int, int] = {}
    deadline = time.monotonic() + START_TIMEOUT
    listener.settimeout(0.25)
    try:
        while len(conns) < run.world_size:
            if run.state.done:
                run.result()  # raises the run's error (a rank that failed to start)
                raise WorkersEnded("the workers ended before they all connected.")
            if time.monotonic() > deadline:
                raise WorkersEnded(
                    f"only {len(conns)} of {run.world_size} workers connected within "
                    f"{START_TIMEOUT:g} s; see their logs in {run.run_dir}."
                )
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(10)
            hello = recv_frame(conn) if same_user(conn) else None
            message = unpickling.loads(hello) if hello is not None else {}
            if message.get("token") != token:
                conn.close()  # not one of ours: another user, or a stranger
                continue
            conn.settimeout(None)
            conns[message["rank"]] = conn
            pids[message["rank"]] = message["pid"]
    except BaseException:
        for conn in conns.values():
            conn.close()
        raise
    return conns, pids
