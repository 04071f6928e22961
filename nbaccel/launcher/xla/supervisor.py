"""The supervisor of a torch_xla launch: one process between the helper and the TPU workers.

torch_xla starts its own workers (``torch_xla.launch``: a process pool, one process per chip,
one thread per device in it) and gives them nothing but an index. So nbaccel forks one
supervisor per launch from the helper, holding every rank's payload, log and event pipes;
it calls ``torch_xla.launch`` with a carrier that lives in an importable module (so
``spawn`` can find it), and each worker fetches its rank's request and pipes from here over
a Unix socket (``SCM_RIGHTS``), by its XLA ordinal. The supervisor leads its own process
group, which torch_xla's workers join: a stop signals the group, so an interrupt ends every
worker at once (a plain ``torch_xla.launch`` in a kernel waits for them to finish).

A worker that dies (a signal, a crash in the XLA runtime) cannot report itself; the
supervisor notices its socket closing and reports it on the rank's event pipe, as it does
for torch_xla's own start-up errors (a busy chip, ...), explained with the fix.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import threading
import traceback
from collections.abc import Sequence
from typing import Any

from nbaccel.frames import EventWriter
from nbaccel.hardware.xla_plan import XlaPlan, explain_xla_failure
from nbaccel.launcher import control
from nbaccel.launcher.bootstrap.worker_bootstrap import error_message

ACCEPT_POLL_SECONDS = 0.2


class Handout:
    """Serves each rank's request and pipes to the worker that asks with that ordinal."""

    def __init__(
        self,
        requests: list[dict[str, Any]],
        payload_fd: int,
        pipes: list[tuple[int, int]],
        data_fds: Sequence[int] = (),
    ) -> None:
        self.requests = requests
        self.payload_fd = payload_fd
        self.data_fds = list(data_fds)  # the payload's shared-memory segments, for every rank
        self.pipes = pipes  # rank -> (log write end, event write end)
        self.connected: set[int] = set()
        self.finished: set[int] = set()  # ranks that reported their value or error
        self.died: set[int] = set()
        # Linux abstract socket: no file to clean up, gone with the process.
        self.address = f"\0nbaccel-xla-{os.getpid()}-{secrets.token_hex(4)}"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._server.bind(self.address)
        self._server.listen(64)
        self._server.settimeout(ACCEPT_POLL_SECONDS)
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._serve, name="nbaccel-xla-handout", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._closing.is_set():
                conn.close()
                return
            threading.Thread(target=self._serve_one, args=(conn,), daemon=True).start()

    def _serve_one(self, conn: socket.socket) -> None:
        with conn:
            if not control.same_user(conn):
                return  # another user's process: no payload, no pipes
            message, _ = control.receive(conn)
            if message is None:
                return
            rank = int(message["rank"])
            if not 0 <= rank < len(self.requests) or rank in self.connected:
                control.send(conn, {"error": f"no rank {rank} to hand out (or handed out twice)"})
                return
            with self._lock:
                self.connected.add(rank)
            log_fd, event_fd = self.pipes[rank]
            fds = [self.payload_fd, log_fd, event_fd, *self.data_fds]
            control.send(conn, self.requests[rank], fds)
            done, _ = control.receive(conn)  # the worker's last word, or EOF if it died
            with self._changed:
                (self.finished if done is not None else self.died).add(rank)
                self._changed.notify_all()
        if done is None:
            report(
                self.pipes[rank][1],
                rank,
                RuntimeError(
                    f"rank {rank}'s torch_xla worker process ended before reporting a result "
                    "(killed by a signal or crashed in the XLA runtime; on a TPU host, running "
                    "out of host memory is the usual cause). Its log above shows what it did last."
                ),
                cause="exit",
            )

    def unsettled(self, timeout: float) -> set[int]:
        """Ranks that never connected or have not ended, after waiting up to ``timeout`` s
        for connected ones to end (a pool failure and a worker's death arrive together)."""
        with self._changed:
            self._changed.wait_for(lambda: self.connected <= self.finished | self.died, timeout)
            return set(range(len(self.requests))) - self.finished - self.died

    def close(self) -> None:
        self._closing.set()
        try:  # wake accept() now rather than at its poll timeout (0.2 s on every launch)
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as waker:
                waker.connect(self.address)
        except OSError:
            pass
        self._thread.join(timeout=2)
        self._server.close()


def report(event_fd: int, rank: int, error: BaseException, cause: str = "error") -> None:
    """Write a failure onto a rank's event pipe (only once that rank's worker is gone)."""
    EventWriter(event_fd).send(dataclasses.replace(error_message(error, rank), cause=cause))


def supervise(request: dict[str, Any], fds: list[int], data_fds: Sequence[int] = ()) -> int:
    """Run the launch described by ``request``; the supervisor's exit code. ``data_fds``:
    the payload's shared-memory segments, handed to every rank."""
    plan: XlaPlan = request["xla_plan"]
    requests: list[dict[str, Any]] = request["ranks"]
    payload_fd, *pipe_fds = fds
    pipes = [(pipe_fds[2 * r], pipe_fds[2 * r + 1]) for r in range(len(requests))]
    handout = Handout(requests, payload_fd, pipes, data_fds)
    try:
        _launch(plan, handout.address)
        return 0
    except BaseException as error:  # noqa: BLE001 - reported on the ranks' pipes
        _report_launch_failure(error, handout, pipes)
        return 1
    finally:
        handout.close()


def _launch(plan: XlaPlan, address: str) -> None:
    from nbaccel.launcher.xla.worker import xla_entry

    if plan.spmd:
        # SPMD: one process drives every device, and torch_xla.launch refuses SPMD. This
        # process is that worker (the Accelerator turns SPMD on before the runtime starts).
        xla_entry(0, address)
        return
    import torch_xla.distributed.xla_multiprocessing as xmp

    if plan.spawn_nprocs == 1:
        # One device (Colab's single chip, num_processes=1): torch_xla runs it in this very
        # process, set up as a one-chip topology; no second interpreter to start.
        xmp.spawn(xla_entry, args=(address,), nprocs=1)
        return
    # Every local device: a process per chip (threads per device inside, on TPU v2/v3 and
    # the CPU device), started with spawn unless the config asks for fork.
    xmp.spawn(xla_entry, args=(address,), nprocs=None, start_method=plan.start_method)


def _report_launch_failure(
    error: BaseException, handout: Handout, pipes: list[tuple[int, int]]
) -> None:
    """torch_xla.launch raised: name the rank that failed first, with the fix when known."""
    text = "".join(traceback.format_exception(error))
    if isinstance(error, KeyboardInterrupt):
        return  # a stop: the parent is ending the run
    print(f"nbaccel: torch_xla.launch failed:\n{text}", flush=True)  # into rank 0's log
    explained = explain_xla_failure(text)
    unreported = handout.unsettled(timeout=1.0)
    if not unreported:
        return  # every rank told its own story (a death is reported by the handout)
    rank = min(unreported)
    if explained is not None:
        error = RuntimeError(f"{explained}\n\ntorch_xla reported: {error}")
    report(pipes[rank][1], rank, error)
