"""The start-up half of ``Run``: every rank's pipes opened, the workers asked of the helper.

``start`` asks for one worker per rank (or, for torch_xla, for one supervisor that stands for
every rank), each handed its pipes, its debug channel, the payload's shared segments and an
empty result box; then it starts the pump thread (``pump.py``), which owns the run's state
until it ends. The state itself is set up by ``Run.__init__`` (``run.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

from nbaccel.errors import HelperError
from nbaccel.events import Notice, RunStarted, RunState
from nbaccel.launcher.debug.console import DebugConsole
from nbaccel.launcher.debug.hub import DebugHub
from nbaccel.launcher.long_runs.kernel_signals import SaveOnSignal
from nbaccel.launcher.pump import RunPump
from nbaccel.launcher.run_folder import private_file
from nbaccel.launcher.sharing.packing import shared_fds
from nbaccel.launcher.starter import WorkerStarter


class RunStart(RunPump):
    """``Run.start`` and what it calls (its state is set up by ``Run.__init__``)."""

    notices: list[str]
    _debug: DebugHub | None
    _save_on_signal: SaveOnSignal  # made by Run.__init__ with the run

    def start(
        self,
        helper: WorkerStarter,
        requests: list[dict[str, Any]],
        payload_fd: int,
        listen_fd: int | None,
        data_fds: Sequence[int] = (),
        result_boxes: bool = False,
    ) -> None:
        """Ask ``helper`` for the workers of ``requests``. ``data_fds``: the shared-memory
        segments of the payload's buffers, for every worker; ``result_boxes``: give each
        rank an empty memfd for its value's large buffers (workers on this machine)."""
        self._helper = helper
        with self._wake_lock:
            self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        # Block-buffered, flushed once per pump wake-up: a write call per line cost ~40 us of
        # parent CPU per metric, taken from the workers on a small machine.
        self._events_file = private_file(self.run_dir / "events.jsonl", "a")
        helper.subscribe(self.run_id, self._post)
        # A detached run's supervisor has no cell to type into: its ranks skip breakpoints.
        refuse = "a detached run has no cell to type into" if self.config.detach else None
        self._debug = DebugHub(refuse=refuse, notice=self._post_notice)
        self._console = DebugConsole(self._debug)
        child_fds: list[int] = []
        try:
            if self._xla is not None:
                self._start_supervisor(helper, requests, payload_fd, data_fds)
            for request in requests if self._xla is None else ():
                rank = request["context"].rank
                log_write, event_write = self._open_rank(rank)
                child_fds += [log_write, event_write]
                debug = self._debug.open(rank)  # the rank's end of its debug channel
                child_fds.append(debug)
                rendezvous = [listen_fd] if rank == 0 and listen_fd is not None else []
                made = self._boxes.make(rank) if result_boxes else None
                box = [made] if made is not None else []  # none: no shared memory here
                fds = [payload_fd, log_write, event_write, debug, *rendezvous, *data_fds, *box]
                shared = shared_fds(len(data_fds), box=bool(box))
                message = {**request, **shared, "run": self.run_id, "rank": rank}
                helper.spawn(message, fds)
                for fd in child_fds:
                    os.close(fd)
                child_fds.clear()
        except BaseException:
            for fd in child_fds:
                os.close(fd)
            if self._ranks:  # some workers may already run: take them down with us
                try:
                    helper.signal(self.run_id, signal.SIGKILL)
                except HelperError:
                    pass  # the helper is gone, and its workers die with it
            self._close_everything()
            raise
        self._debug.start()
        self._state = RunState.RUNNING
        if not self.config.detach:  # a detached run's supervisor answers its own signals
            self._save_on_signal.install()
        self._emit(RunStarted(self.run_id, self.world_size, str(self.run_dir), time.time()))
        for text in self.notices:
            self._emit(Notice(text, time.time()))
        threading.Thread(target=self._pump, name=f"nbaccel-run-{self.run_id}", daemon=True).start()

    def _start_supervisor(
        self,
        helper: WorkerStarter,
        requests: list[dict[str, Any]],
        payload_fd: int,
        data_fds: Sequence[int],
    ) -> None:
        """One process for every rank: torch_xla starts the workers (xla_supervisor.py),
        handing each the payload's segments (values come back inside the pickle)."""
        fds = [payload_fd]
        pipes: list[int] = []
        try:
            for request in requests:
                pipes += self._open_rank(request["context"].rank)
            shared = shared_fds(len(data_fds), box=False)
            ranks = [{**request, **shared, "xla_plan": self._xla} for request in requests]
            message = {**requests[0], **shared, "run": self.run_id, "rank": 0, "processes": 1}
            helper.spawn(
                {**message, "xla_plan": self._xla, "ranks": ranks}, [*fds, *pipes, *data_fds]
            )
        finally:
            for fd in pipes:
                os.close(fd)
