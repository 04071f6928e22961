"""The pump thread of a ``Run``: every rank's output and events, exits, failures, the end.

The pump thread alone owns the run's state. It reads every rank's output pipe and event
pipe, takes exit codes from the helper through an inbox, decides which rank failed first,
stops the others (SIGTERM, then SIGKILL; SIGINT first for a user's stop), and ends when
every worker is reaped and its pipes are drained (or a short drain deadline passes, since
grandchildren may hold a pipe open). Subscribers get events on the pump thread.

With ``max_restarts``, torch elastic restarts every worker after a failure: a failure in an
attempt that has restarts left is recorded (``events.jsonl``) and stops nothing here, since
elastic stops and restarts the workers on every host itself; the starter's ``restarted``
message then emits ``RunRestarted`` with the culprit of the attempt that failed. A rank's
state is its latest worker's (its ``started`` event says which attempt). A failure in the
last attempt ends the run as without restarts; a stop ends it at once in any attempt
(``outcome.restarts.RestartsSeen`` is that part of the pump). Each rank's output, metric
and finished step is a sign of life for the stall warning (``debug.stall.StallReports``:
after ``stall_warning`` quiet seconds, every rank's stack, once per stall).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import selectors
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbaccel.config.schema import Config
from nbaccel.errors import HelperError
from nbaccel.events import (
    CheckpointSaved,
    DeviceMemory,
    Event,
    LogLine,
    Metric,
    ModelPrepared,
    ModulesImported,
    OutputMark,
    Rank0Value,
    RankExited,
    RankStopped,
    ResultReady,
    RunEnded,
    RunState,
    SettingsApplied,
    StepBreakdown,
    Waiting,
    WorkerFailed,
    WorkerMessage,
    WorkerStarted,
)
from nbaccel.frames import UnreadableFrame
from nbaccel.hardware.xla_plan import XlaPlan
from nbaccel.launcher.debug.console import DebugConsole
from nbaccel.launcher.debug.stall import StallReports
from nbaccel.launcher.long_runs.saved_stops import SavedStops
from nbaccel.launcher.outcome.arbiter import Arbiter
from nbaccel.launcher.outcome.failures import Failure, build_error, last_output
from nbaccel.launcher.outcome.kept import HandOver
from nbaccel.launcher.outcome.restarts import Attempts, RestartsSeen
from nbaccel.launcher.output import TRAINED_MARK, Mark, render
from nbaccel.launcher.results import RankPipes as RankPipes  # Run's, and the tests'
from nbaccel.launcher.results import ResultBoxes, keep_in_folder
from nbaccel.launcher.run_folder import private_file
from nbaccel.launcher.sharing.packing import Packed
from nbaccel.launcher.starter import WorkerStarter

DRAIN_SECONDS = 1.0  # after the last exit, how long pipes held by grandchildren may stay open

Subscriber = Callable[[Event], None]


class RunPump(StallReports, RestartsSeen, SavedStops, HandOver):
    """The pump thread's half of ``Run`` (its state is set up by ``Run.__init__``)."""

    run_id: str
    run_dir: Path
    config: Config
    world_size: int
    ranks: tuple[int, ...]
    _xla: XlaPlan | None
    _state: RunState
    _subscribers: list[Subscriber]
    _metrics: deque[dict[str, Any]]
    _metrics_seen: int
    _records_lock: threading.Lock
    _done: threading.Event
    _gone: threading.Event
    kept_error: BaseException | None
    _inbox: queue.SimpleQueue[dict[str, Any]]
    _wake_read: int
    _wake_write: int
    _wake_lock: threading.Lock
    _ranks: dict[int, RankPipes]  # by global rank: the ranks this run's workers are
    _rank0_value: bytes | None  # rank 0's value when it runs on another machine
    _arbiter: Arbiter
    _drain_deadline: float | None
    _error: BaseException | None
    _started: float
    _helper: WorkerStarter | None
    _events_file: Any
    _attempts: Attempts
    _boxes: ResultBoxes  # each rank's result box, until its value came
    _console: DebugConsole | None  # serves the debug channels' stops (launcher/debug/)

    def logs(self, rank: int = 0) -> str:
        """All that rank ``rank`` wrote to stdout and stderr so far (``\\r`` redraws collapsed)."""
        if rank not in self.ranks:
            elsewhere = 0 <= rank < self.world_size  # a job whose machines each have a cell
            raise ValueError(
                f"rank {rank} runs on another machine: the cell there shows its output"
                if elsewhere
                else f"rank {rank} is not in this run (world size {self.world_size})"
            )
        return render((self.run_dir / f"rank{rank}.log").read_bytes())

    def _open_rank(self, rank: int) -> tuple[int, int]:
        """A rank's log file and pipes; the write ends (log, events) for its worker."""
        log_read, log_write = os.pipe()
        event_read, event_write = os.pipe()
        for fd in (log_read, event_read):
            os.set_blocking(fd, False)
        log_file = private_file(self.run_dir / f"rank{rank}.log", "wb")
        self._ranks[rank] = RankPipes(rank, log_file, log_read, event_read)
        return log_write, event_write

    # ----- the pump thread --------------------------------------------------------
    def _post(self, message: dict[str, Any]) -> None:
        """Hand a message to the pump thread (from the helper reader or the user's thread)."""
        with self._wake_lock:
            if self._wake_write == -1:
                return  # the run has ended (or was never started)
            self._inbox.put(message)
            try:
                os.write(self._wake_write, b"\0")
            except BlockingIOError:
                pass  # already woken

    def _pump(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_read, selectors.EVENT_READ, None)
        for r in self._ranks.values():
            selector.register(r.log_fd, selectors.EVENT_READ, (r, "log"))
            selector.register(r.event_fd, selectors.EVENT_READ, (r, "events"))
        try:
            while not self._finished():
                for key, _ in selector.select(self._select_timeout()):
                    if key.data is None:
                        os.read(self._wake_read, 4096)
                    else:
                        self._read(selector, *key.data)
                while not self._inbox.empty():
                    self._handle(self._inbox.get(), selector)
                with self._records_lock:
                    if self._events_file is not None:
                        self._events_file.flush()
                self._tick()
        finally:
            selector.close()
            self._finalize()

    def _read(self, selector: selectors.BaseSelector, r: RankPipes, kind: str) -> bool:
        """Read one chunk from a rank's pipe; False when nothing was there or it closed."""
        fd = r.log_fd if kind == "log" else r.event_fd
        if fd == -1:
            return False
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if not data:
            selector.unregister(fd)
            os.close(fd)
            if kind == "log":
                r.log_fd = -1
                self._take_output(r, *r.output.close())
            else:
                r.event_fd = -1
            return False
        if kind == "log":
            self._take_output(r, *r.output.feed(data), selector)
        else:
            for message in r.decoder.feed(data):
                self._on_worker_message(r, message)
        return True

    def _take_output(
        self,
        r: RankPipes,
        data: bytes,
        items: list[tuple[str, bool, bool] | Mark],
        selector: selectors.BaseSelector | None = None,
    ) -> None:
        """A rank's output, its marks taken out: the bytes into its log, lines and marks out."""
        r.log_file.write(data)
        now = time.time()
        for item in items:
            if isinstance(item, Mark):
                # What the rank sent on its event pipe before the mark (an interactive
                # call's metrics) is handed out before it: the pipes are read apart.
                while selector is not None and self._read(selector, r, "events"):
                    pass
                if item.text == TRAINED_MARK:  # keep_workers: its function has returned
                    r.trained = True
                    self._maybe_hand_over()
                else:
                    self._emit(OutputMark(r.rank, item.text, now))
            else:
                self._emit(LogLine(r.rank, *item, now))

    def _on_worker_message(self, r: RankPipes, message: object) -> None:
        if isinstance(message, UnreadableFrame):  # the run goes on without that message
            self._record({"event": "unreadable", "rank": r.rank, "reason": message.reason})
            print(f"nbaccel: a message of rank {r.rank}: {message.reason}", file=sys.__stderr__)
            return
        if not isinstance(message, WorkerMessage):
            return  # not one of nbaccel's messages: a stray write to the pipe is ignored
        # The pipe says which rank sent it: no worker speaks for another.
        message = dataclasses.replace(message, rank=r.rank)
        match message:
            case WorkerStarted():
                if message.attempt != r.attempt:  # a new attempt's worker: nothing is kept
                    r.attempt, r.result, r.has_result = message.attempt, None, False
                r.pid = message.pid
                host = self._helper.host_of(r.rank) if self._helper is not None else None
                self._emit(dataclasses.replace(message, host=host))
            case SettingsApplied() if r.rank == self.ranks[0]:
                # Beside config.json (the launch's): what the Accelerator made of it.
                with private_file(self.run_dir / "accelerator_config.json") as file:
                    record = {"values": message.values, "sources": message.sources}
                    json.dump(record, file, indent=2, default=str)
                self._record({"event": "settings", "rank": r.rank, "values": message.values})
                self._emit(message)
            case Metric():
                entry = {"event": "metric", "rank": r.rank, "step": message.step}
                self._record({**entry, "values": message.values})
                if r.rank == self.ranks[0]:  # rank 0, or this machine's first rank
                    with self._records_lock:
                        self._metrics.append({**message.values, "step": message.step})
                        self._metrics_seen += 1
                self._emit(message)
            case StepBreakdown():
                window = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
                del window["rank"], window["time"]
                self._record({"event": "step_breakdown", "rank": r.rank, **window})
                self._emit(message)
            case ResultReady():
                r.result, r.result_refs, r.has_result = message.value, message.buffers, True
                r.result_map = self._boxes.take(r.rank, message.buffers)
                value = Packed(message.value, message.buffers)
                keep_in_folder(self.run_dir / f"result-rank{r.rank}.pkl", value, r.result_map)
                self._maybe_hand_over()
            case Rank0Value():  # rank 0 ran on another machine: kept as its own value is
                self._rank0_value = message.value
                keep_in_folder(self.run_dir / "result-rank0.pkl", Packed(message.value))
            case RankStopped():
                self._on_rank_stopped(r, message)
            case CheckpointSaved():
                self._on_checkpoint_saved(message)
            case WorkerFailed():
                self._fail(Failure(r.rank, message.cause, message.time, report=message), r.attempt)
            case ModulesImported() if self._helper is not None:  # for the next launch
                self._helper.offer_modules(list(message.modules))
            case ModelPrepared() | DeviceMemory():  # DeviceMemory: torch_xla reads its own
                self._emit(message)

    def _handle(self, message: dict[str, Any], selector: selectors.BaseSelector) -> None:
        op = message["op"]
        if op in ("stall", "watch_stalls", "notice"):
            self._on_stall_message(message)
        elif op == "stop" and message.get("save"):
            self._ask_to_save(message.get("why", "run.stop(save=True)"))
        elif op == "stop":
            self._arbiter.cancel(time.monotonic())
        elif op == "release":  # kept workers being closed: they leave on their own
            self._releasing = True
        elif op == "exited" and self._xla is not None:
            # The supervisor is gone, and torch_xla's workers with it (same process group).
            # Ranks that sent their value finished; for the others its status is theirs.
            status = message["status"] or 1
            for r in self._ranks.values():
                self._on_exit(r, 0 if r.has_result else status, selector)
        elif op == "exited":
            r = self._ranks[message["rank"]]
            if r.exitcode is None:  # else its last worker's end was already taken
                self._on_exit(r, message["status"], selector)
        elif op == "worker_ended":
            self._on_worker_ended(message, selector)
        elif op == "restarted":
            self._on_restarted(int(message["attempt"]))
        elif op == "waiting":  # the starter says what the workers wait for (starter.py)
            self._record({"event": "waiting", "for": message["text"]})
            # The starter's word and a worker's start come by different channels: said after
            # a worker started, the wait is over (the header stayed "starting" for good).
            if all(r.pid is None for r in self._ranks.values()):
                self._emit(Waiting(message["text"], time.time()))
        elif op in ("spawn_failed", "helper_died"):
            rank = message.get("rank", 0)
            # Its time is now: a rank's own error reported before it stays the culprit.
            failure = Failure(rank, "error", time.time(), error=HelperError(message["error"]))
            self._fail(failure)
            everyone = op == "helper_died" or self._xla is not None
            for r in self._ranks.values():
                if r.exitcode is None and (everyone or r.rank == message["rank"]):
                    self._on_exit(r, -int(signal.SIGKILL), selector)

    def _on_exit(self, r: RankPipes, status: int, selector: selectors.BaseSelector) -> None:
        # The worker is gone, so everything it wrote is already in its event pipe: read it
        # first, or an exit could overtake the result or the error it reported.
        while self._read(selector, r, "events"):
            pass
        r.exitcode = status
        self._record({"event": "exited", "rank": r.rank, "exitcode": status})
        self._emit(RankExited(r.rank, status, time.time()))
        asked_to_end = self._arbiter.cancelled or self._arbiter.saving or self._releasing
        # A kept worker's value came when its function returned: its exit, unless asked
        # for, is the kept group's failure.
        finished = r.has_result and not self._handed_over
        if not finished and not r.stopped and not asked_to_end:
            self._fail(Failure(r.rank, "exit", time.time(), exitcode=status))
        if all(x.exitcode is not None for x in self._ranks.values()):
            self._drain_deadline = time.monotonic() + DRAIN_SECONDS

    def _tick(self) -> None:
        live = [r.rank for r in self._ranks.values() if r.exitcode is None]
        self._check_max_duration(time.monotonic())
        self._check_stall(live, time.monotonic())
        everyone_exited = not live
        for signum, ranks in self._arbiter.due(time.monotonic(), live, everyone_exited):
            if self._helper is not None:
                # torch_xla's workers share the supervisor's process group: all or none.
                self._helper.signal(self.run_id, signum, ranks if self._xla is None else None)

    def _select_timeout(self) -> float | None:
        stall = self._stall.next_deadline() if self._debug is not None else None
        pending = (self._arbiter.next_deadline(), self._drain_deadline, stall)
        deadlines = [d for d in (*pending, self._max_duration_deadline()) if d]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _finished(self) -> bool:
        if any(r.exitcode is None for r in self._ranks.values()):
            return False
        pipes_open = any(r.log_fd != -1 or r.event_fd != -1 for r in self._ranks.values())
        return not pipes_open or (
            self._drain_deadline is not None and time.monotonic() >= self._drain_deadline
        )

    def _finalize(self) -> None:
        culprit, stuck = self._arbiter.final_culprit(), self._arbiter.stuck
        if culprit is not None:
            stuck_logs = {r: last_output(self.logs(r)) for r in stuck}
            self._error = build_error(
                culprit,
                world_size=self.world_size,
                collective_timeout=self.config.collective_timeout,
                stuck_ranks=stuck,
                stuck_logs=stuck_logs,
                host=self._helper.host_of(culprit.rank) if self._helper is not None else None,
                restarts=self._attempts.restarts_used(),
                run_dir=self.run_dir,
            )
            self._note_debugged(self._error, stuck)  # a stuck rank that was in pdb
            state = RunState.FAILED
        elif self._stopped is not None:
            state = RunState.STOPPED
            self._say_stopped(self._stopped)
        elif (self._arbiter.cancelled or self._arbiter.saving) and not all(
            r.has_result for r in self._ranks.values()
        ):
            state = RunState.CANCELLED
        else:
            state = RunState.SUCCEEDED
        for r in self._ranks.values():
            if r.log_fd != -1:
                self._take_output(r, *r.output.close())
        if self._handed_over:  # the run succeeded earlier; its kept workers ended now
            self.kept_error, self._error = self._error, None
            self._record({"event": "workers_ended", "error": str(self.kept_error or "")})
            self._close_everything()
            self._gone.set()
            return
        self._record({"event": "ended", "state": state.value})
        self._close_everything()
        self._state = state
        self._emit(RunEnded(state, self._error, time.monotonic() - self._started, time.time()))
        self._done.set()
        self._gone.set()

    def _close_everything(self) -> None:
        self._boxes.close()  # ranks that sent no value
        if self._debug is not None:
            self._debug.close()  # a thread serving stops is woken: nothing more comes
        if self._helper is not None:
            self._helper.unsubscribe(self.run_id)
        for r in self._ranks.values():
            for fd in (r.log_fd, r.event_fd):
                if fd != -1:
                    os.close(fd)
            r.log_fd = r.event_fd = -1
            r.log_file.close()
        with self._records_lock:
            if self._events_file is not None:
                self._events_file.close()
                self._events_file = None
        with self._wake_lock:
            os.close(self._wake_read)
            os.close(self._wake_write)
            self._wake_read = self._wake_write = -1

    # ----- helpers ----------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        if isinstance(event, (LogLine, Metric, StepBreakdown)):
            self._stall.activity(time.monotonic())  # a sign of life: no stall
        for subscriber in self._subscribers:
            try:
                subscriber(event)
            except Exception as error:  # noqa: BLE001 - a broken display must not stop the run
                print(f"nbaccel: a run subscriber failed: {error!r}", file=sys.__stderr__)

    def _record(self, entry: dict[str, Any]) -> None:
        with self._records_lock:  # run.metrics may flush the file from another thread
            if self._events_file is not None:
                self._events_file.write(json.dumps({"time": time.time(), **entry}) + "\n")
