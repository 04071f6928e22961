"""``WorkerGroup``: a process group that keeps its state between cells (parent side; the
public ``nbaccel.Workers``, in ``nbaccel/interactive/__init__.py``, adds a dashboard per call).

It is one long launch (``api.start_plan``) whose function is ``serve.serve``: every rank
connects back (``connect.py``: an abstract Unix socket here, TCP with ``hosts=``; each peer
checked before anything of it is read) and then runs the commands sent to it. Output and
events keep flowing through the run's pipes and pump; ``relay.CellRelay`` hands them to the
call in progress. Threads of their own send the commands and read the replies
(``calls.py``), so an interrupt in the kernel's main thread never cuts a frame in half.
Torch-free: replies are read with ``unpickling.loads``; only a returned value is unpickled
as ``Run.result`` does (a tensor imports torch, as asked).
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from nbaccel.config.resolve import ConfigSource
from nbaccel.errors import WorkersEnded
from nbaccel.events import RunEnded, RunStarted, RunState
from nbaccel.launcher.bootstrap.payload import cell_sources, pack_call
from nbaccel.launcher.bootstrap.pickling import cell_globals
from nbaccel.launcher.debug.console import nobody_to_type
from nbaccel.launcher.interactive.after_training import AfterTraining
from nbaccel.launcher.interactive.calls import (
    build_cell_error,
    check_ranks,
    raise_at_rank_line,
)
from nbaccel.launcher.interactive.ending import CallEnding, errors_of, shut
from nbaccel.launcher.interactive.group_start import GroupStart, last_workers, remember
from nbaccel.launcher.outcome.failures import note_kernel_name
from nbaccel.launcher.printer import TextPrinter
from nbaccel.launcher.pump import Subscriber
from nbaccel.launcher.run import Run
from nbaccel.launcher.sharing.packing import Packed, close_fds, unpack

__all__ = ["WorkerGroup", "last_workers"]

OUTPUT_GRACE = 2.0  # how long a call waits for the last of its output to be shown


class WorkerGroup(GroupStart, CallEnding, AfterTraining):
    """The processes of ``nbaccel.Workers`` (``nbaccel/interactive/__init__.py``) and their calls;
    shown as text here. See docs/interactive.md."""

    def __init__(
        self,
        num_processes: int | None = None,
        *,
        config: ConfigSource = None,
        **overrides: Any,
    ) -> None:
        self._num_processes = num_processes
        self._config = config
        self._overrides = dict(overrides)
        self._seq = 0
        self._memory: dict[int, dict[str, int]] = {}  # per rank, after the last call
        self._run: Run | None = None
        self._ended_why = ""  # what ended the workers, said by every later call
        self._watchers: list[Callable[[WorkerGroup], None]] = []
        self._busy = threading.Lock()  # one call at a time (a workers.launch runs on a thread)
        self._start()
        remember(self)

    # ----- public API -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._live_run().world_size

    @property
    def pids(self) -> dict[int, int]:
        """{rank: pid} of the live workers."""
        return dict(self._pids)

    @property
    def run_dir(self) -> Path:
        """The run folder of the current (or last) workers: config, each rank's log."""
        return self._last_run.run_dir

    def logs(self, rank: int = 0) -> str:
        """Everything ``rank`` printed since these workers started (also once they ended)."""
        return self._last_run.logs(rank)

    @property
    def memory(self) -> dict[int, dict[str, int]]:
        """Each rank's memory in bytes: ``rss`` (resident) after the last call, with its
        device's ``cuda_allocated``/``cuda_reserved``; for ranks on this machine, read now,
        ``uss`` (pages this rank alone holds) and ``pss`` (its share of the pages it shares:
        data in shared memory counts once over the ranks that map it, so the ranks' PSS
        add up to what they take together). Reading USS/PSS walks each rank's page tables:
        milliseconds per GiB, so only when asked."""
        memory = {rank: dict(values) for rank, values in self._memory.items()}
        if self._local:  # pids of another machine are no processes of this one
            for rank, pid in self._pids.items():
                try:
                    full = psutil.Process(pid).memory_full_info()
                except (psutil.Error, OSError):
                    continue  # ended, or on another machine
                memory.setdefault(rank, {}).update(uss=full.uss, pss=full.pss)
        return memory

    @property
    def alive(self) -> bool:
        return self._run is not None and not self._run.processes_ended

    def run(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[int, Any]:
        """Call ``function(*args, **kwargs)`` on every rank; ``{rank: value}``.

        The function travels as ``launch`` sends it (cells' functions by value). A failing
        rank raises its exception here, ``[rank N]`` in its message; an interrupt raises
        ``KeyboardInterrupt`` and leaves the workers ready for the next call.
        """
        __tracebackhide__ = True  # IPython shows the cell, not nbaccel's frames
        # A cell's function takes the kernel's globals with it (serve.in_namespace's rule).
        names = cell_globals(function)
        try:
            return self._call({"op": "run"}, kernel_names=names, sending=(function, args, kwargs))
        except Exception as error:
            code = getattr(function, "__code__", None)
            if code is None:
                raise
            raise_at_rank_line(error, code.co_filename)  # the traceback ends at its line

    def run_cell(
        self,
        code: str,
        filename: str,
        show_ranks: frozenset[int] | None = None,
        kernel_names: Mapping[str, Any] | None = None,
    ) -> dict[int, Any]:
        """Run a cell's ``code`` in every rank's namespace (what ``%%nbaccel`` does); the
        repr of its last expression on each rank (None when there is none). ``show_ranks``:
        whose output is shown for this cell (default: ``log_ranks``'s; empty: all).
        ``kernel_names``: the kernel's namespace (default: ``__main__``'s), for the note on
        a name a rank lacks that the kernel has."""
        __tracebackhide__ = True
        if show_ranks:
            check_ranks(show_ranks, self.world_size, f"show_ranks={set(show_ranks)}")
        if kernel_names is None:
            kernel_names = vars(sys.modules["__main__"])
        command = {"op": "exec", "code": code, "filename": filename}
        return self._call(command, show_ranks, kernel_names=kernel_names)

    def push(self, **values: Any) -> None:
        """Set ``name=value`` in every rank's namespace (the same value on each)."""
        self._call({"op": "push"}, shown=False, sending=(dict, (), values))

    def pull(self, name: str) -> dict[int, Any]:
        """``{rank: value}`` of ``name`` in every rank's namespace."""
        values = self._call({"op": "pull", "names": [name]}, shown=False)
        return {rank: found[name] for rank, found in values.items()}

    def free_memory(self) -> dict[int, dict[str, int]]:
        """Collect garbage and empty the device's cache on every rank; memory after it."""
        self._call({"op": "free"}, shown=False)
        return self.memory

    def stacks(self) -> dict[int, str]:
        """Where every rank is now, ``{rank: text}``, without interrupting anything (as
        ``Run.stacks``): the user's function it is in, the collective it waits in, then
        every thread's Python stack.

        >>> import nbaccel
        >>> with nbaccel.Workers(num_processes=1, dashboard="text") as workers:
        ...     print(workers.stacks()[0].splitlines()[1])  # between calls: nothing of yours
        Thread MainThread (main): in nbaccel's own code, idle
        """
        return self._live_run().stacks()

    def debug(self, rank: int | None = None) -> None:
        """Open pdb in the cell at the frame where a rank's last error was raised (as
        IPython's ``%debug``): ``rank``, or the rank the last failed call named. Its locals
        (the model, the tensors) are there; ``c`` or ``q`` ends the session, and the
        workers are ready for the next call. ``free_memory()`` drops the frames kept.

        >>> import nbaccel
        >>> with nbaccel.Workers(num_processes=1, dashboard="text") as workers:
        ...     workers.debug()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: no call of these workers has failed yet, so there is no frame to debug: ...
        """
        __tracebackhide__ = True
        run = self._live_run()
        if rank is None:
            rank = self._last_failed
        if rank is None:
            raise ValueError(
                "no call of these workers has failed yet, so there is no frame to debug: "
                "workers.debug() opens pdb where a rank's last call raised (name one with "
                "workers.debug(rank=N))."
            )
        check_ranks(frozenset({rank}), run.world_size, f"workers.debug(rank={rank})")
        why = nobody_to_type()
        if why is not None:
            raise RuntimeError(
                f"workers.debug() needs someone to type into pdb, but {why}. Run it in a "
                "notebook with a frontend (JupyterLab, VS Code) or in a terminal."
            )
        self._call({"op": "debug", "rank": rank}, shown=False)

    def restart(self) -> None:
        """End the workers and start them afresh with the same config (namespaces empty)."""
        self.close()
        self._start()

    def close(self, timeout: float = 30.0, *, why: str = "workers.close()") -> None:
        """End the workers: each leaves its serve loop and exits; stopped if it will not.
        ``why``: what closed them, said by every later call."""
        run, self._run = self._run, None
        if run is not None:
            self._ended_why = f"they were closed with {why}"
            self._finalizer.detach()
            shut(run, self._replies, self._sender, self._conns, self._listener, timeout)
            self._changed()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "alive" if self.alive else "closed"
        return f"<nbaccel.Workers {state} world_size={len(self._pids)} pids={self._pids}>"

    # ----- calls --------------------------------------------------------------------
    def _display(
        self, run: Run, gpus: int, show_ranks: frozenset[int] | None, stoppable: bool = False
    ) -> Subscriber:
        """What shows one call's output and events, in the calling cell: rank-labelled text
        here; ``nbaccel.Workers`` shows a dashboard per call in a kernel with widgets (with
        a Stop button when ``stoppable``: ``launch``)."""
        return TextPrinter(sys.stdout, self._shown(run, show_ranks), announce_end=False)

    @staticmethod
    def _shown(run: Run, show_ranks: frozenset[int] | None) -> frozenset[int] | None:
        """Whose output a call shows: ``show_ranks`` (empty: every rank, None), else the
        run's ``log_ranks``."""
        return run.shown_ranks() if show_ranks is None else (show_ranks or None)

    def _live_run(self) -> Run:
        if self._run is None:
            raise WorkersEnded(
                f"these workers are gone ({self._ended_why or 'they did not start'}). Start "
                "them again with workers.restart(), or make new ones with nbaccel.Workers(...) "
                "(their namespaces start empty)."
            )
        return self._run

    def _call(
        self,
        command: dict[str, Any],
        show_ranks: frozenset[int] | None = None,
        *,
        shown: bool = True,
        kernel_names: Mapping[str, Any] | None = None,
        sending: tuple[Callable[..., Any], tuple[Any, ...], Mapping[str, Any]] | None = None,
        stoppable: bool = False,
    ) -> dict[int, Any]:
        """Send ``command`` to every rank and return their values. ``shown``: the call gets
        a display of its own (a dashboard in a kernel); push, pull and free_memory print
        what the ranks print, as text, and nothing else. ``kernel_names``: where the call's
        names come from in the kernel (a NameError on a rank says when one is there).
        ``sending``: a call ``(function, args, kwargs)`` that travels with it
        (``command["call"]``), its large buffers in shared memory on one machine."""
        __tracebackhide__ = True
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                "these workers are running another call (a workers.launch still going?): "
                "wait for it (its .wait() or .result()), or stop it with its dashboard's Stop."
            )
        try:
            return self._call_alone(command, show_ranks, shown, kernel_names, sending, stoppable)
        finally:
            self._busy.release()

    def _call_alone(
        self,
        command: dict[str, Any],
        show_ranks: frozenset[int] | None,
        shown: bool,
        kernel_names: Mapping[str, Any] | None,
        sending: tuple[Callable[..., Any], tuple[Any, ...], Mapping[str, Any]] | None,
        stoppable: bool,
    ) -> dict[int, Any]:
        __tracebackhide__ = True
        run = self._live_run()
        shared = None
        if sending is not None:
            packed, shared, notice = pack_call(*sending, self._share_limit)
            if notice:
                print(
                    f"nbaccel: {notice}: sent inside the message, a copy per rank", file=sys.stderr
                )
            command = {**command, "call": packed.data, "refs": packed.refs}
        self._seq += 1
        seq = self._seq
        new_sources = {k: v for k, v in cell_sources().items() if k not in self._sent_sources}
        self._sent_sources |= set(new_sources)
        frame = pickle.dumps({**command, "seq": seq, "sources": new_sources}, protocol=5)
        display = self._display(run, self._gpus, show_ranks, stoppable) if shown else self._idle
        self._relay.target = display
        run._call_starts(runs_code=command["op"] in ("run", "exec"))  # each call as the first
        started = time.time()
        display(RunStarted(run.run_id, run.world_size, str(run.run_dir), started))
        error: BaseException | None = None
        replies: dict[int, dict[str, Any]] = {}
        try:
            interrupted = False
            fds = shared.fds if shared is not None else ()
            sent = self._sender.send(frame, fds)  # on its own thread: an interrupt cannot cut it
            while True:
                try:
                    if sent.wait(0.25):
                        break
                except KeyboardInterrupt:
                    interrupted = True  # once every rank has the command
            if shared is not None:
                shared.close()  # every rank holds the segments now
            if self._sender.failure is not None:
                failure = self._sender.failure
                raise self._ended(run, f"sending a command to the workers failed ({failure!r})")
            self._wait(run, interrupted, replies)
            # Every rank's output, shown or not: its log is whole when the call returns (each
            # rank wrote its mark before its reply: it is on its way, if not in already).
            self._relay.wait_output(seq, run.ranks, OUTPUT_GRACE)
            self._memory = {rank: reply.get("memory", {}) for rank, reply in replies.items()}
            errors = errors_of(replies)
            if errors:
                failed = build_cell_error(
                    errors, run.world_size, run.config.collective_timeout, run.host_of
                )
                if command["op"] != "debug":
                    self._last_failed = getattr(failed, "rank", errors[0]["rank"])
                note_kernel_name(failed, kernel_names, command["op"])
                raise failed
            if any(r["status"] == "interrupted" for r in replies.values()):
                raise KeyboardInterrupt
            return {
                rank: unpack(Packed(r["value"], r.get("refs", ())), r["fds"])
                for rank, r in sorted(replies.items())
            }
        except BaseException as failed:
            error = failed
            raise
        finally:
            for reply in replies.values():
                close_fds(reply.get("fds", ()))  # what was mapped stays
            state = RunState.SUCCEEDED if error is None else RunState.FAILED
            if isinstance(error, KeyboardInterrupt):
                state, error = RunState.CANCELLED, None
            display(RunEnded(state, error, time.time() - started, time.time()))
            self._relay.target = self._idle
            run._watch_stalls(False)
            self._changed()
