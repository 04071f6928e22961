"""A torch_xla worker's side of a launch: the carrier ``torch_xla.launch`` calls per device.

``xla_entry`` lives in an importable module so that torch_xla's ``spawn`` start method can
find it by name; the user's function (defined in a cell, so only cloudpickle can carry it)
travels inside the payload this carrier fetches from the supervisor with its ordinal.

torch_xla has already started the XLA runtime when the carrier runs (data parallel), or
has not (SPMD, where the Accelerator must turn SPMD on first), so nothing here touches the
device before the user's code, except to read memory once the runtime is up.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from nbaccel.config.schema import Config
from nbaccel.context import ProcessContext
from nbaccel.events import WorkerStarted
from nbaccel.frames import EventWriter
from nbaccel.hardware.xla_plan import XlaPlan, explain_xla_failure
from nbaccel.launcher import control
from nbaccel.launcher.bootstrap.prctl import flush_c_stdio, set_parent_death_signal
from nbaccel.launcher.bootstrap.worker_bootstrap import capture_output, error_message, run_payload
from nbaccel.launcher.sharing.packing import take_shared

_process_lock = threading.Lock()
_process_ready = False
# Threaded devices (TPU v2/v3, the CPU device with several devices): Python output of each
# rank's thread goes to that rank's log; C/C++ output of the process goes to the first's.
_thread_streams = threading.local()


def xla_entry(index: int, address: str) -> None:
    """Run rank ``index`` (torch_xla's global ordinal) of the launch served at ``address``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.connect(address)
        control.send(conn, {"rank": index, "pid": os.getpid()})
        request, fds = control.receive(conn)
        if request is None or "error" in request:
            raise RuntimeError(f"nbaccel's supervisor refused rank {index}: {request}")
        own, data_fds, _ = take_shared(fds, request)
        payload_fd, log_fd, events_fd = own
        plan: XlaPlan = request["xla_plan"]
        context: ProcessContext = request["context"]
        events = EventWriter(events_fd)
        try:
            code = _run_rank(request, plan, context, events, payload_fd, log_fd, data_fds)
        except BaseException as error:  # noqa: BLE001 - our own set-up failed: say so
            events.send(error_message(error, context.rank))
            code = 1
        finally:
            _flush()
        events.close()
        control.send(conn, {"done": code})


def _run_rank(
    request: dict[str, Any],
    plan: XlaPlan,
    context: ProcessContext,
    events: EventWriter,
    payload_fd: int,
    log_fd: int,
    data_fds: list[int],
) -> int:
    _set_up(request, log_fd, threaded=plan.devices_per_process > 1)
    events.send(WorkerStarted(context.rank, os.getpid(), time.time()))
    stop_memory = _report_memory(events, plan, context.rank)
    try:
        return run_payload(
            context,
            events,
            payload_fd,
            start=lambda config: _start_group(plan, config),
            finish=lambda value: None,
            xla=plan,
            explain=lambda error: explain_xla_failure(str(error)),
            data_fds=data_fds,
        )
    finally:
        stop_memory()


def _set_up(request: dict[str, Any], log_fd: int, threaded: bool) -> None:
    """Once per process: die with the supervisor, take the launch's environment and output."""
    global _process_ready
    with _process_lock:
        first = not _process_ready
        _process_ready = True
        if first:
            set_parent_death_signal(signal.SIGKILL)
            env = dict(request["env"])
            if threaded:  # one process, several ranks: no per-rank variable is true for all
                for name in ("RANK", "LOCAL_RANK"):
                    env.pop(name, None)
            os.environ.update(env)
            os.chdir(request["cwd"])
            capture_output(log_fd)
            if threaded:
                sys.stdout = _RankStream(sys.stdout)
                sys.stderr = _RankStream(sys.stderr)
            return
    # A further device thread of this process: its Python output goes to its own log.
    _thread_streams.log = io.TextIOWrapper(
        io.FileIO(log_fd, "w"), line_buffering=True, errors="backslashreplace"
    )


class _RankStream(io.TextIOBase):
    """stdout/stderr that write to the calling thread's rank log when it has one."""

    def __init__(self, default: TextIO) -> None:
        self._default = default

    def _target(self) -> TextIO:
        target: TextIO | None = getattr(_thread_streams, "log", None)
        return target if target is not None else self._default

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def fileno(self) -> int:
        return self._target().fileno()

    def isatty(self) -> bool:
        return False


def _start_group(plan: XlaPlan, config: Config) -> None:
    """The torch.distributed default group over XLA, as the gloo/nccl launch creates one.

    Only with one device per process: torch.distributed's default group is per process, so
    threaded devices use torch_xla's own collectives (the Accelerator does). Under SPMD there
    is one process and nothing to group; its runtime must not start before SPMD is on.
    """
    if plan.spmd or plan.world_size == 1 or plan.devices_per_process > 1:
        return
    if not config.init_process_group:
        return
    from datetime import timedelta

    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401 - registers the "xla" backend

    dist.init_process_group(
        "xla", init_method="xla://", timeout=timedelta(seconds=config.collective_timeout)
    )


def _report_memory(events: EventWriter, plan: XlaPlan, rank: int) -> Callable[[], None]:
    """Send this device's memory readings (``xm.get_memory_info``) while the function runs.

    Data parallel only: there torch_xla started the runtime before calling us, so reading
    the device is safe. Under SPMD the runtime must not start before the Accelerator turns
    SPMD on, so there is no reading (the dashboard shows n/a).
    """
    if plan.spmd:
        return lambda: None
    import torch_xla
    import torch_xla.core.xla_model as xm

    from nbaccel.launcher.bootstrap.device_memory import start_device_memory_reports

    device = torch_xla.device()  # this thread's device (threaded devices differ per thread)
    label = f"{plan.device}:{rank}"
    read = lambda: xm.get_memory_info(device)  # noqa: E731 - the reporter's reading
    return start_device_memory_reports(events.send, label, read, rank=rank)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    flush_c_stdio()
