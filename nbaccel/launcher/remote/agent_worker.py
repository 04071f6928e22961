"""A worker started by torch elastic on a host of a several-machine launch (``agent_main.py``).

torch elastic forks it from the host's agent with the torch.distributed variables set (RANK,
LOCAL_RANK, WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT: the store the agent shares
with its workers, or on one machine the store rank 0 serves itself on MASTER_ADDR). It
connects three times to the agent's private socket (its output, its events, its debug
channel: ``launcher.debug``), each connection opened with one hello frame naming its rank
and attempt (elastic's restart count), and runs the shared bootstrap
(``worker_bootstrap.run_payload``). The process group is started from the environment
elastic set; nothing here chooses an address or a port.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from nbaccel.config.schema import Config
from nbaccel.context import ProcessContext
from nbaccel.events import SAVE_AND_STOP_SIGNALS, Rank0Value, WorkerStarted
from nbaccel.frames import EventWriter, encode_frame
from nbaccel.launcher.bootstrap.memory_reports import report_memory
from nbaccel.launcher.bootstrap.prctl import flush_c_stdio, set_parent_death_signal
from nbaccel.launcher.bootstrap.worker_bootstrap import capture_output, run_payload
from nbaccel.launcher.remote.store_socket import listen_where_reached

STOPPED_EXIT_CODE = 143  # 128 + SIGTERM: what a worker the stop reached would exit with


def run_elastic_worker(
    address: str,
    payload_fd: int,
    run_id: str,
    run_dir: str,
    stop_fd: int,
    share_rank0: bool,
    host: str | None,
    data_fds: tuple[int, ...] = (),
) -> None:
    """The entry point torch elastic calls in each forked worker (a module-level function).

    ``stop_fd``: the read end of the agent's stop pipe. Once the kernel has ended the run,
    a worker that elastic still restarts leaves at once instead of running the function
    again (elastic restarts a group whose workers a stop interrupted). ``share_rank0``: each
    machine has its own kernel (``num_nodes=``), and each returns rank 0's value. ``host``:
    the kernel's name for this host when it is another machine, whose processes the kernel
    cannot read: the worker reports its own memory (``memory_reports``). ``data_fds``: the
    payload's shared-memory segments, which the agent made (inherited, so duplicated here:
    elastic may fork this function again after a restart)."""
    os.setsid()  # a stop from the agent reaches this worker's children too (DataLoader)
    set_parent_death_signal(signal.SIGKILL)  # the agent gone: so are we
    # Forked from the agent, this process has the agent's handlers: its save-and-stop
    # forwarding would signal the other ranks, and swallow elastic's SIGTERM of a restart.
    # A rank's own answers are its loop's (the Accelerator installs them at its first step).
    for signum in SAVE_AND_STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    if select.select([stop_fd], [], [], 0)[0]:
        os._exit(STOPPED_EXIT_CODE)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the agent's stdin is the kernel's control channel, not ours
    os.close(null)
    rank = int(os.environ["RANK"])
    # Which attempt this is: torch elastic counts its restarts of the worker group.
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    capture_output(_connect(address, rank, "log", attempt))
    events = EventWriter(_connect(address, rank, "events", attempt))
    debug_fd = _connect(address, rank, "debug", attempt)  # relayed to the kernel's debug hub
    events.send(WorkerStarted(rank, os.getpid(), time.time(), attempt=attempt))
    context = ProcessContext(
        rank=rank,
        local_rank=int(os.environ["LOCAL_RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
        node_rank=int(os.environ["GROUP_RANK"]),
        master_addr=os.environ["MASTER_ADDR"],
        master_port=int(os.environ["MASTER_PORT"]),
        run_id=run_id,
        run_dir=run_dir,
    )
    timeout = timedelta(seconds=Config().collective_timeout)  # the launch's, once known

    stop_reports: Callable[[], None] = _nothing  # replaced once the device is chosen

    def start(config: Config) -> None:
        nonlocal timeout, stop_reports
        timeout = timedelta(seconds=config.collective_timeout)
        _start_distributed(config)
        if host is not None:
            stop_reports = report_memory(events, host, rank, cuda=_uses_cuda(config))

    def finish(value: bytes) -> None:
        if share_rank0:
            _share_rank0_value(value, events, timeout)
        _finish()

    try:
        data = [os.dup(fd) for fd in data_fds]
        code = run_payload(
            context,
            events,
            os.dup(payload_fd),
            start=start,
            finish=finish,
            data_fds=data,
            debug_fd=debug_fd,
        )
    finally:
        stop_reports()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    flush_c_stdio()
    if code:
        # torch elastic records a failure by the exit code; the error itself was sent.
        raise SystemExit(code)
    # Returning (not os._exit) lets elastic collect the return value it waits for; its fork
    # start method ends the process with os._exit, so no interpreter teardown runs.


def _connect(address: str, rank: int, channel: str, attempt: int) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    hello = {"rank": rank, "channel": channel, "pid": os.getpid(), "attempt": attempt}
    sock.sendall(encode_frame(hello))
    return sock.detach()


def _nothing() -> None:
    """No memory reports to stop (this machine's kernel reads them itself)."""


def _uses_cuda(config: Config) -> bool:
    import torch

    return torch.cuda.is_available() and not config.use_cpu


def _start_distributed(config: Config) -> None:
    if not config.init_process_group:
        return
    import torch

    use_cuda = _uses_cuda(config)
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    timeout = timedelta(seconds=config.collective_timeout)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    # Not shared (c10d's rendezvous: agent_run): rank 0 serves the store on a socket bound
    # to MASTER_ADDR, where its peers connect; a TCPStore binding the port itself would
    # listen on every interface.
    serves = not shared and rank == 0
    machines = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    listen_fd = listen_where_reached(address, port, machines=machines).detach() if serves else None
    store = dist.TCPStore(  # type: ignore[attr-defined]
        address,
        port,
        world_size,
        is_master=serves,
        timeout=timeout,
        multi_tenant=True,
        master_listen_fd=listen_fd,
    )
    # elastic's workers share one store across restarts (the rendezvous keeps it), so an
    # attempt's peers could read the addresses the previous attempt's workers left there
    # and fail to connect: each attempt keeps its keys under its own prefix.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"nbaccel/attempt-{attempt}", store),  # type: ignore[attr-defined]
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def _share_rank0_value(value: bytes, events: EventWriter, timeout: timedelta) -> None:
    """Rank 0 leaves its pickled value in the job's store (elastic's, which every machine
    reaches); the first worker of every other machine reads it for its kernel."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    on_machine_0 = int(os.environ["GROUP_RANK"]) == 0
    if rank != 0 and (local_rank != 0 or on_machine_0):
        return
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"nbaccel/attempt-{attempt}/rank0-value"
    if rank == 0:
        store.set(key, value)  # type: ignore[arg-type]  # bytes are taken as they are
    else:  # waits for rank 0 to return, at most the collective timeout
        events.send(Rank0Value(rank, store.get(key)))


def _finish() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
