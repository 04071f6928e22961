"""The worker side of a launch: runs in a child forked from the helper, never in the parent.

Order matters here: become a session leader (so a stop reaches grandchildren), die with the
helper, point fd 1 and 2 at the capture pipe (C/C++ output included), take the launch's
environment, then load the payload, start torch.distributed and call the function. The
result or the exception goes back on the event pipe; the worker then destroys its process
group and leaves with ``os._exit`` (a live gloo group at interpreter shutdown can SIGABRT).
What every worker does the same way, here or under torch_xla, is in ``worker_bootstrap.py``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from nbaccel.config.schema import Config
from nbaccel.context import ProcessContext
from nbaccel.events import WorkerStarted
from nbaccel.frames import EventWriter
from nbaccel.launcher.bootstrap.prctl import flush_c_stdio, set_parent_death_signal
from nbaccel.launcher.bootstrap.process_names import (
    child_title,
    name_children,
    name_process,
    worker_title,
)
from nbaccel.launcher.bootstrap.worker_bootstrap import capture_output, run_payload
from nbaccel.launcher.sharing.packing import take_shared

# Rank 0's TCPStore server: kept alive for the process's lifetime, reused by
# init_process_group() through the multi-tenant store registry.
_store: Any = None


def run_worker(request: dict[str, Any], fds: list[int], helper_pid: int) -> NoReturn:
    os.setsid()
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != helper_pid:  # the helper died between fork and prctl
        os._exit(1)
    # fds: payload, the rank's log and events pipes, its debug channel, then rank 0's
    # listening socket, or for
    # a torch_xla launch (one supervisor for every rank) the other ranks' pipes; last, the
    # payload's shared-memory segments and this rank's result box (sharing.packing).
    fds, data_fds, box = take_shared(fds, request)
    payload_fd, log_fd, events_fd, *rest = fds
    supervisor = "xla_plan" in request
    name_process(worker_title(request["rank"], request["run"], supervisor=supervisor))
    if not supervisor:  # torch_xla's supervisor forks the ranks themselves
        name_children(child_title(request["rank"], request["run"]))  # not a 2nd rank in ps
    # A rank's end of its debug channel (launcher/debug/), before rank 0's listening socket;
    # a torch_xla supervisor's ranks have none.
    debug_fd = None if supervisor else rest.pop(0)
    # A supervisor writes into rank 0's log too, and hands that pipe on to rank 0's worker.
    capture_output(os.dup(log_fd) if supervisor else log_fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if supervisor:
        from nbaccel.launcher.xla.supervisor import supervise

        code = supervise(request, [payload_fd, log_fd, events_fd, *rest], data_fds)
    else:
        events = EventWriter(events_fd)
        context: ProcessContext = request["context"]
        events.send(WorkerStarted(context.rank, os.getpid(), time.time()))
        listen_fd = rest[0] if rest else None
        code = run_payload(
            context,
            events,
            payload_fd,
            start=lambda config: _start_distributed(context, config, listen_fd),
            finish=lambda value: _finish_distributed(),
            data_fds=data_fds,
            box=box,
            debug_fd=debug_fd,
        )
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    flush_c_stdio()
    os._exit(code)


def _start_distributed(context: ProcessContext, config: Config, listen_fd: int | None) -> None:
    global _store
    timeout = timedelta(seconds=config.collective_timeout)
    if listen_fd is not None:
        # Rank 0 serves the rendezvous store on the socket the parent bound and handed over:
        # no port race, and peers never connect before it listens.
        _store = dist.TCPStore(  # type: ignore[attr-defined]
            context.master_addr,
            context.master_port,
            context.world_size,
            is_master=True,
            timeout=timeout,
            multi_tenant=True,
            master_listen_fd=listen_fd,
            wait_for_workers=False,
        )
    if not config.init_process_group:
        return
    use_cuda = torch.cuda.is_available() and not config.use_cpu
    if use_cuda:
        torch.cuda.set_device(context.local_rank)
    backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    dist.init_process_group(backend=backend, timeout=timeout)


def _finish_distributed() -> None:
    # The barrier keeps rank 0's store up until every peer is done with it. The group is not
    # destroyed: gloo's teardown costs ~20 ms, and os._exit follows, which runs no C++
    # destructors, so the SIGABRT a live group can cause at interpreter shutdown cannot occur.
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
