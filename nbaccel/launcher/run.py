"""``Run``: one launch in flight — its state and its public API.

``start`` (``run_start.py``) opens every rank's pipes and asks the helper for the workers;
the pump thread (``pump.py``) then owns the run's state until it ends. The public methods
only read that state or post to the pump.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nbaccel.config.schema import Config, shown_ranks
from nbaccel.errors import RunCancelled, hidden_frames
from nbaccel.events import RunState
from nbaccel.hardware.xla_plan import XlaPlan
from nbaccel.launcher.debug.console import DebugConsole
from nbaccel.launcher.debug.hub import DebugHub
from nbaccel.launcher.debug.stacks import STACKS_TIMEOUT
from nbaccel.launcher.debug.stall import StallWatch
from nbaccel.launcher.debug.waiting import collect_stacks, serve_pending, wait_serving
from nbaccel.launcher.long_runs.kernel_signals import SaveOnSignal
from nbaccel.launcher.outcome.arbiter import Arbiter
from nbaccel.launcher.outcome.failures import note_kernel_name
from nbaccel.launcher.outcome.kept import kept_workers
from nbaccel.launcher.outcome.restarts import Attempts
from nbaccel.launcher.pump import RankPipes, Subscriber
from nbaccel.launcher.results import ResultBoxes, load_value
from nbaccel.launcher.run_folder import read_metrics
from nbaccel.launcher.run_start import RunStart
from nbaccel.launcher.starter import WorkerStarter


class Run(RunStart):
    """A launch in flight or finished. Made by ``nbaccel.launch``; see DESIGN.md §1.

    >>> import nbaccel
    >>> run = nbaccel.launch(sum, args=([1, 2],), num_processes=1, log_ranks="all")
    >>> run.result(), run.state
    (3, <RunState.SUCCEEDED: 'succeeded'>)
    """

    def __init__(
        self,
        run_id: str,
        run_dir: Path,
        config: Config,
        world_size: int,
        xla: XlaPlan | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        self.run_id = run_id
        self.run_dir = run_dir
        self.config = config
        self.world_size = world_size
        # The ranks whose workers this run starts: all of them, or on a machine of a job
        # whose machines each launch from their own cell (num_nodes=), this machine's.
        self.ranks: tuple[int, ...] = tuple(ranks if ranks is not None else range(world_size))
        # A torch_xla launch: one supervisor process stands for every rank (its exit is
        # every rank's, a signal goes to its whole group). "TPU" or "CPU"; None otherwise.
        self._xla = xla
        self.xla_device = xla.device if xla else None
        self._state = RunState.PENDING
        self._subscribers: list[Subscriber] = []
        self.notices: list[str] = []  # told as Notice events once the run has started
        # The globals of the cell function launched (api.start): a NameError for a name
        # defined there since gets a note. Dropped once used.
        self.kernel_names: Mapping[str, Any] | None = None
        # Rank 0's latest metrics; all of them are in events.jsonl. The lock guards both,
        # so that run.metrics can flush the file from the user's thread.
        self._metrics: deque[dict[str, Any]] = deque(maxlen=config.metrics_in_memory)
        self._metrics_seen = 0
        self._records_lock = threading.Lock()
        # _done: the run's outcome is known (wait and result return). _gone: its processes
        # have ended and the pump closed everything. One moment, but where the run keeps its
        # workers (keep_workers): the function returned on every rank, and they serve on.
        self._done = threading.Event()
        self._gone = threading.Event()
        self._keep: Any = None  # keep_workers: where the ranks connect then (planned.KeptEnd)
        self._handed_over = False  # the function returned everywhere; the workers serve on
        self._releasing = False  # the kept workers are being closed: their exits are no failure
        self.kept_error: BaseException | None = None  # what ended the kept workers, if a failure
        self._workers: Any = None  # their group (interactive.workers), once taken over
        self._workers_ready = threading.Event()
        self._workers_failure: BaseException | None = None
        self._inbox: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        # The pump thread's wake-up pipe: made by start(), closed when the run ends. A run
        # that is never started (an error before its workers, an attached run) has none.
        self._wake_read = self._wake_write = -1
        self._wake_lock = threading.Lock()
        self._ranks: dict[int, RankPipes] = {}
        self._rank0_value: bytes | None = None
        self._arbiter = Arbiter()
        self._drain_deadline: float | None = None
        self._stopped = None  # the RankStopped that a save-and-stop ended the run with
        self._stop_reason = None
        # SIGTERM/SIGUSR1 to this process save the run first (installed when it starts)
        self._save_on_signal = SaveOnSignal(self)
        self._error: BaseException | None = None
        self._results_cache: dict[int, Any] = {}
        self._started = time.monotonic()
        self._helper: WorkerStarter | None = None
        self._events_file: Any = None
        self._attempts = Attempts(config.max_restarts)
        self._boxes = ResultBoxes()  # each rank's value's large buffers (results.py)
        # Each rank's debug channel (made by start(); launcher/debug/), who serves its stops
        # in this process, and the stall warning's clock.
        self._debug: DebugHub | None = None
        self._console: DebugConsole | None = None
        self._stall = StallWatch(config.stall_warning, time.monotonic())

    # ----- public API -------------------------------------------------------------
    @property
    def state(self) -> RunState:
        return self._state

    @property
    def error(self) -> BaseException | None:
        """The exception the run failed with (None while running or on success)."""
        return self._error

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """Records logged on rank 0, in order: the logged values plus ``step``.

        The latest ``metrics_in_memory`` stay in memory; when more were logged, the whole
        list is read back from ``run_dir/events.jsonl``.
        """
        with self._records_lock:
            if self._metrics_seen == len(self._metrics):
                return list(self._metrics)
            seen = self._metrics_seen
            if self._events_file is not None:
                self._events_file.flush()
        return read_metrics(self.run_dir / "events.jsonl", rank=self.ranks[0], limit=seen)

    @property
    def exit_code(self) -> int | None:
        """A shell-style code: None while running, 0 on success, 130 when stopped, else the
        failing rank's exit code (128 + the signal number when a signal killed it)."""
        if not self._state.done:
            return None
        if self._state in (RunState.SUCCEEDED, RunState.STOPPED):
            return 0
        culprit = self._arbiter.culprit
        if self._state is RunState.CANCELLED or culprit is None:
            return 130 if self._state is RunState.CANCELLED else 1
        status = self._ranks[culprit.rank].exitcode
        if status is None or status == 0:
            return 1
        return 128 - status if status < 0 else status

    @property
    def worker_pids(self) -> dict[int, int]:
        """{rank: pid} of the workers that have started (for memory readings)."""
        return {r.rank: r.pid for r in self._ranks.values() if r.pid is not None}

    def shown_ranks(self) -> frozenset[int] | None:
        """The ranks whose output is shown (``log_ranks``; None: all). On a machine of a job
        launched from each machine's cell where none of them runs, its own first rank."""
        shown = shown_ranks(self.config.log_ranks)
        if shown is None:
            return None
        return (shown & frozenset(self.ranks)) or frozenset(self.ranks[:1])

    def host_of(self, rank: int) -> str | None:
        """The host ``rank`` runs on, on several machines (``hosts=``); None on this one."""
        return self._helper.host_of(rank) if self._helper is not None else None

    def subscribe(self, subscriber: Subscriber) -> None:
        """Receive every later event (called on the pump thread: keep it quick)."""
        self._subscribers.append(subscriber)

    def wait(self, timeout: float | None = None) -> RunState:
        """Block until the run ends; returns its state. TimeoutError if it has not ended.

        Meanwhile, a rank that stops in ``breakpoint()`` (or, with ``post_mortem=True``, at
        its error) gets pdb here: its output printed, each command read with ``input()``
        (Jupyter's input box in a kernel). ``c`` lets it run on, ``q`` ends the run. See
        docs/debugging.md.
        """
        if not wait_serving(self._debug, self._console, self._done, timeout):
            raise TimeoutError(f"run {self.run_id} still {self._state.value} after {timeout} s")
        self._save_on_signal.uninstall()  # ended: this process's handlers as they were
        return self._state

    def stacks(self, timeout: float = STACKS_TIMEOUT) -> dict[int, str]:
        """Where every live rank is now: ``{rank: text}``, each text a line naming the
        user's function it is in and the collective it waits in, then every thread's
        Python stack (the main thread, which runs the function, first). Nothing is
        stopped. A rank whose channel does not answer within ``timeout`` seconds (a thread
        holding the GIL in C code) gets faulthandler's dump from its log instead.

        >>> import nbaccel
        >>> def nap():
        ...     import time
        ...     time.sleep(60)
        >>> run = nbaccel.launch(nap, num_processes=1, dashboard="text")
        >>> while "in nap" not in run.stacks()[0]:  # until the rank has reached its nap
        ...     pass
        >>> print(run.stacks()[0].splitlines()[0])  # doctest: +ELLIPSIS
        rank 0: in nap (...:3)
        >>> run.stop()
        nbaccel: run cancelled
        <RunState.CANCELLED: 'cancelled'>
        """
        if self._gone.is_set():
            raise RuntimeError(
                f"run {self.run_id} has ended ({self._state.value}): its ranks are gone. What "
                "they wrote is in run.logs(rank); a failed rank's traceback is in run.error."
            )
        # A worker that has not said it started may not have set up faulthandler yet: the
        # fallback's SIGUSR2 would end it. It is named, not asked.
        waiting = {r.rank for r in self._ranks.values() if r.exitcode is None and r.pid is None}
        live = [r.rank for r in self._ranks.values() if r.exitcode is None and r.pid is not None]
        return {
            rank: f"rank {rank}: its worker has not started yet (importing torch?)"
            for rank in waiting
        } | collect_stacks(
            self._debug,
            live,
            host_of=self.host_of,
            # SIGUSR2 to the rank's pid only: its DataLoader workers and tools would die of
            # it. torch_xla's ranks are its supervisor's children, in its process group:
            # only that group reaches them.
            signal_ranks=lambda signum, ranks: self.signal_workers(
                signum,
                None if self._xla is not None else ranks,
                group=self._xla is not None,
            ),
            log_path=lambda rank: self.run_dir / f"rank{rank}.log",
            timeout=timeout,
        )

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value; raises the run's error if it failed (with the caller's
        frames only: its message and the rank's traceback say what happened)."""
        with hidden_frames():
            return self._value(0, timeout)

    def results(self, timeout: float | None = None) -> dict[int, Any]:
        """Every rank's return value, ``{rank: value}`` (of this machine's ranks, where each
        machine of a job launches from its own cell)."""
        with hidden_frames():
            self.wait(timeout)
            return {r.rank: self._value(r.rank, None) for r in self._ranks.values()}

    def stop(
        self, timeout: float | None = None, *, save: bool = False, why: str | None = None
    ) -> RunState:
        """Stop every worker and its children: SIGINT, then SIGTERM, then SIGKILL.

        ``save=True``: every rank saves at a step they agree on, then ends (the run is
        ``stopped``, resumable with ``resume="auto"``); ranks that cannot save within
        ``checkpoint_grace`` are ended. ``timeout`` defaults to 10 s (the grace and 10 s).
        ``why``: what the run's end says asked for the save (default ``run.stop(save=True)``).
        """
        if timeout is None:
            timeout = 10.0 + (self.config.checkpoint.grace if save else 0.0)
        if not self._gone.is_set():
            self._post({"op": "stop", "save": save, "why": why or "run.stop(save=True)"})
        return self._await_end(timeout)

    @property
    def processes_ended(self) -> bool:
        """Whether every worker process has ended (a kept run's serve on after it succeeded)."""
        return self._gone.is_set()

    @property
    def workers(self) -> Any:
        """The ``nbaccel.Workers`` group a ``keep_workers=True`` launch left: its ranks, with
        the process group, the Accelerator, the devices' memory and each rank's returned
        value as ``result``. Waits for the function to return on every rank (as ``result``
        does); a run that did not succeed kept nothing, and says why."""
        return kept_workers(self)

    def state_dict(self, name: str | None = None) -> dict[str, Any]:
        """The trained model's whole state dict in this process, as CPU tensors in shared
        memory (``workers.state_dict``): the first model the ranks' Accelerator prepared,
        else a returned module, or ``name`` in the ranks' namespace. Needs the workers kept
        (``keep_workers=True``)."""
        group = self.workers
        state: dict[str, Any] = group.state_dict(name)
        return state

    @property
    def saved_step(self) -> int | None:
        """The step every rank saved at before a save-and-stop ended the run, else None."""
        return self._stopped.completed_steps if self._stopped is not None else None

    def _await_end(self, timeout: float | None) -> RunState:
        """``wait`` without serving debugger stops, until the processes are gone (kept
        workers too): for a run being stopped or closed, whose stopped ranks are ending,
        not to be typed into."""
        if not self._gone.wait(timeout):
            raise TimeoutError(f"run {self.run_id} still {self._state.value} after {timeout} s")
        self._save_on_signal.uninstall()
        return self._state

    def _serve_debugger(self) -> None:
        """Hold the debugger sessions of ranks stopped now (what ``wait`` does as it waits),
        then return: for a thread that waits for something else (interactive workers)."""
        serve_pending(self._debug, self._console)

    def _debug_stops_wake(self, wake: Callable[[], None], quit_ends: str = "the run") -> None:
        """Call ``wake`` whenever a rank stops in the debugger (on the channels' thread);
        ``quit_ends``: what ``q`` ends, as the session's header says."""
        if self._debug is not None:
            self._debug.on_stop = wake
        if self._console is not None:
            self._console.quit_ends = quit_ends

    def _call_starts(self, runs_code: bool) -> None:
        """A call of interactive workers (one run, many calls) begins: it starts as the first
        did (a ``q`` of an earlier call ended that call only), watching for stalls if it
        ``runs_code``."""
        if self._debug is not None:
            self._debug.new_call()
        self._watch_stalls(runs_code)

    def _watch_stalls(self, on: bool) -> None:
        """Warn of stalls (``stall_warning``) from now on, or not: interactive workers watch
        only while a call runs (between calls, nothing happening is no stall)."""
        self._post({"op": "watch_stalls", "seconds": self.config.stall_warning if on else None})

    def signal_workers(
        self, signum: int, ranks: list[int] | None = None, *, group: bool = True
    ) -> None:
        """Send ``signum`` to the process group of every live worker of this run (or of
        ``ranks``): what an interactive worker's interrupt is. ``group=False``: to each
        worker's own pid only, none of the processes it started (a stack dump's SIGUSR2,
        which would end them). Nothing once it has ended."""
        if self._helper is not None and not self._gone.is_set():
            self._helper.signal(self.run_id, signum, ranks, group=group)

    def __repr__(self) -> str:
        return (
            f"<nbaccel.Run {self.run_id} {self._state.value} "
            f"world_size={self.world_size} run_dir={str(self.run_dir)!r}>"
        )

    def _value(self, rank: int, timeout: float | None) -> Any:
        state = self.wait(timeout)
        if state is RunState.FAILED:
            assert self._error is not None
            if self.kernel_names is not None:  # once: the same error is raised each time
                note_kernel_name(self._error, self.kernel_names, "launch")
                self.kernel_names = None
            raise self._error.with_traceback(None)  # fresh each time: tracebacks would pile up
        if state is RunState.CANCELLED:
            raise RunCancelled(
                f"run {self.run_id} was stopped before it finished; it has no result."
            )
        if state is RunState.STOPPED:
            return None  # saved and stopped: the checkpoint is the result (resume="auto")
        if rank not in self._results_cache:
            here = self._ranks.get(rank)
            # Rank 0 on another machine (a job whose machines each have a cell): its value
            # came from the job's store, through this machine's first worker.
            value = here.result if here is not None else self._rank0_value
            refs = here.result_refs if here is not None else ()
            box = here.result_map if here is not None else None
            self._results_cache[rank] = load_value(value, refs, box)
            if here is not None:
                # The value holds what it needs of the box: the run lets go of the mapping
                # now, not whenever the garbage collector frees the run (a cycle).
                here.result_map = None
        return self._results_cache[rank]
