"""The worker side of a launch: runs in a child forked from the helper, never in the parent.

Order matters here: become a session leader (so a stop reaches grandchildren), die with the
helper, point fd 1 and 2 at the capture pipe (C/C++ output included), take the launch's
environment, then load the payload, start torch.distributed and call the function. The
result or the exception goes back on the event pipe; the worker then destroys its process
group and leaves with ``os._exit`` (a live gloo group at interpreter shutdown can SIGABRT).
"""

from __future__ import annotations

import faulthandler
import linecache
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from nbaccel.config.schema import Config
from nbaccel.context import ProcessContext, WorkerSession, activate
from nbaccel.events import EventWriter
from nbaccel.launcher import pickling, script
from nbaccel.launcher.prctl import flush_c_stdio, set_parent_death_signal
from nbaccel.xla_plan import XlaPlan

# Rank 0's TCPStore server: kept alive for the process's lifetime, reused by
# init_process_group() through the multi-tenant store registry.
_store: Any = None


def run_worker(request: dict[str, Any], fds: list[int], helper_pid: int) -> NoReturn:
    os.setsid()
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != helper_pid:  # the helper died between fork and prctl
        os._exit(1)
    # fds: payload, rank 0's log and events pipes, then rank 0's listening socket, or for
    # a torch_xla launch (one supervisor for every rank) the other ranks' pipes.
    payload_fd, log_fd, events_fd, *rest = fds
    supervisor = "xla_plan" in request
    # A supervisor writes into rank 0's log too, and hands that pipe on to rank 0's worker.
    capture_output(os.dup(log_fd) if supervisor else log_fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if supervisor:
        from nbaccel.launcher.xla_supervisor import supervise

        code = supervise(request, [payload_fd, log_fd, events_fd, *rest])
    else:
        events = EventWriter(events_fd)
        context: ProcessContext = request["context"]
        events.send({"kind": "started", "pid": os.getpid(), "time": time.time()})
        listen_fd = rest[0] if rest else None
        code = run_payload(
            context,
            events,
            payload_fd,
            start=lambda config: _start_distributed(context, config, listen_fd),
            finish=_finish_distributed,
        )
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    flush_c_stdio()
    os._exit(code)


def capture_output(log_fd: int) -> None:
    """Point fd 1 and 2 (C/C++ output included) at a rank's log pipe; dump stacks on SIGUSR1."""
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # A C-level handler, so it works from torch_xla's device threads too (signal.signal
    # would not): the arbiter's SIGUSR1 dumps every thread's stack for a hang report.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def run_payload(
    context: ProcessContext,
    events: EventWriter,
    payload_fd: int,
    start: Callable[[Config], None],
    finish: Callable[[], None],
    xla: XlaPlan | None = None,
    explain: Callable[[BaseException], str | None] = lambda error: None,
) -> int:
    """Load the payload, call the function, report its value or error; the exit code.

    ``start`` readies torch.distributed once the config is known (gloo/nccl, or xla);
    ``finish`` runs after the value was sent (a barrier that keeps rank 0's store up);
    ``explain`` may give a failure a note with the fix (kept: the exception keeps its type).
    """
    try:
        payload = pickle.loads(_read_all(payload_fd))
        os.close(payload_fd)
        sys.path[:] = payload["sys_path"]
        for filename, lines in payload["sources"].items():
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        config: Config = payload["config"]
        threaded = xla is not None and xla.devices_per_process > 1  # ranks are threads
        session = WorkerSession(context=context, config=config, events=events, xla=xla)
        activate(session, per_thread=threaded)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        start(config)
        function, args, kwargs = pickle.loads(payload["function"])
        try:
            value = function(*args, **kwargs)
        except SystemExit as exit_request:
            if exit_request.code not in (0, None):
                raise
            value = None
        events.send({"kind": "result", "value": _dump_result(context.rank, value)})
        finish()
        return 0
    except BaseException as error:  # noqa: BLE001 - every failure is reported, then we exit
        note = explain(error)
        if note is not None and hasattr(error, "add_note"):  # Python 3.11+; travels pickled
            error.add_note(note)
        events.send(error_message(error, context.rank))
        # sys.exit(n) keeps its code, as under torchrun; anything else exits with 1.
        code = getattr(error, "code", 1) if isinstance(error, SystemExit) else 1
        return code if isinstance(code, int) and 0 < code < 256 else 1


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


def _dump_result(rank: int, value: Any) -> bytes:
    try:
        return pickling.dumps(value)
    except Exception as error:
        raise TypeError(
            f"the value returned on rank {rank} ({type(value).__name__}) cannot be pickled "
            f"to send it back: {error}. Return plain data (numbers, lists, dicts, tensors)."
        ) from error


def error_message(error: BaseException, rank: int) -> dict[str, Any]:
    """The event describing an exception, with a traceback that starts in user code."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _LAUNCHER_FRAMES:
        tb = tb.tb_next
    try:
        pickled: bytes | None = pickling.dumps(error)
    except Exception:  # noqa: BLE001 - the parent falls back to WorkerError
        pickled = None
    return {
        "kind": "error",
        "rank": rank,
        "type": f"{type(error).__module__}.{type(error).__qualname__}",
        "message": str(error),
        "traceback": "".join(traceback.format_exception(type(error), error, tb)),
        "exception": pickled,
        "cause": classify_failure(error),
        "time": time.time(),
    }


# Frames above the user's code that a traceback need not show.
_LAUNCHER_FRAMES = frozenset({__file__, script.__file__, "<frozen runpy>"})
_PEER_FAILURES = ("closed by peer", "reset by peer", "broken pipe", "connection refused")


def classify_failure(error: BaseException) -> str:
    """'timeout' and 'peer' mark failures caused by another rank; 'error' is a rank's own.

    >>> classify_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    'peer'
    >>> classify_failure(ValueError("timed out"))
    'error'
    """
    if not isinstance(error, RuntimeError):
        return "error"
    text = str(error).lower()
    if "timed out" in text or "timeout" in text:
        return "timeout"
    if any(s in text for s in _PEER_FAILURES):
        return "peer"
    return "error"


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, size - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
