"""What every worker runs, however it was started: the one bootstrap shared by the local
worker (``worker.py``, forked from the helper) and the torch_xla worker (``xla_worker.py``,
started by torch_xla's launcher under ``xla_supervisor.py``).

It points a rank's output at its log pipe, loads the payload, calls the function and
reports the value or the error on the event pipe. How torch.distributed is started and
finished is the caller's (``start`` / ``finish``): gloo/NCCL on a store the parent bound, or
XLA's. Nothing here imports another launcher module that starts workers, so the ways of
starting them depend on this module and never on each other.
"""

from __future__ import annotations

import bdb
import faulthandler
import linecache
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from nbaccel.config.schema import Config
from nbaccel.context import ProcessContext, WorkerSession, activate
from nbaccel.durable import is_url, newest_complete
from nbaccel.errors import TrainingStopped
from nbaccel.events import (
    STACK_DUMP_SIGNAL,
    ModulesImported,
    RankStopped,
    ResultReady,
    WorkerFailed,
)
from nbaccel.frames import EventWriter
from nbaccel.hardware.xla_plan import XlaPlan
from nbaccel.launcher.bootstrap import compile_cache, pickling, script
from nbaccel.launcher.bootstrap.payload import read_payload
from nbaccel.launcher.debug.rank_channel import RankDebugger
from nbaccel.launcher.sharing.late_check import await_check
from nbaccel.launcher.sharing.packing import Packed, close_fds, pack_fresh, unpack
from nbaccel.launcher.sharing.segments import Segment


def capture_output(log_fd: int) -> None:
    """Point fd 1 and 2 (C/C++ output included) at a rank's log pipe; dump stacks on
    ``STACK_DUMP_SIGNAL`` (SIGUSR2: SIGUSR1 and SIGTERM ask a rank to save and stop)."""
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # A C-level handler, so it works from torch_xla's device threads too (signal.signal
    # would not): the arbiter's signal dumps every thread's stack for a hang report.
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)


def run_payload(
    context: ProcessContext,
    events: EventWriter,
    payload_fd: int,
    start: Callable[[Config], None],
    finish: Callable[[bytes], None],
    xla: XlaPlan | None = None,
    explain: Callable[[BaseException], str | None] = lambda error: None,
    data_fds: Sequence[int] = (),
    box: int | None = None,
    debug_fd: int | None = None,
) -> int:
    """Load the payload, call the function, report its value or error; the exit code.

    ``start`` readies torch.distributed once the config is known (gloo/nccl, or xla);
    ``finish`` runs after the value was sent, with it pickled (a barrier that keeps rank
    0's store up; where machines launch from their own cells, rank 0's value travels);
    ``explain`` may give a failure a note with the fix (kept: the exception keeps its type).
    ``data_fds``: the shared-memory segments of the payload's buffers (mapped, then closed);
    ``box``: where the value's large buffers go (``Run._result_box``), else in the pickle.
    ``debug_fd``: the rank's debug channel (``launcher.debug``): stacks are answered from
    now on, and once the config is known ``breakpoint()`` opens pdb in the cell.
    """
    loaded_before = set(sys.modules)  # what the helper (or the interpreter) had already
    debugger = RankDebugger(debug_fd, context.rank, socket.gethostname())
    debugger.start()
    config: Config | None = None
    try:
        payload = pickle.loads(read_payload(payload_fd))
        os.close(payload_fd)
        sys.path[:] = payload["sys_path"]
        for filename, lines in payload["sources"].items():
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        config = payload["config"]
        assert config is not None
        threaded = xla is not None and xla.devices_per_process > 1  # ranks are threads
        session = WorkerSession(
            context=context, config=config, events=events, xla=xla, debugger=debugger
        )
        # torch.compile's caches in the project's folder (not /tmp, lost with the machine);
        # each checkpoint carries this rank's compiled artifacts, a resume loads them first.
        session.checkpoint_extras = compile_cache.save_artifacts
        compile_cache.use_project_caches(config)
        activate(session, per_thread=threaded)
        debugger.install(enabled=config.debugger)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        start(config)
        if (resumed := resume_folder(config.resume)) is not None:
            compile_cache.load_artifacts(resumed, context.rank)
        refs = payload.get("refs", ())
        if payload.get("late"):  # the kernel checks data it kept while we started
            refs, data_fds = await_check(refs, data_fds)
        call = Packed(payload["function"], refs)
        function, args, kwargs = unpack(call, data_fds)
        close_fds(data_fds)  # the mapped buffers stay
        keep = payload.get("keep")  # keep_workers: (how, address, secret) to serve at the end
        del call, payload
        try:
            value = function(*args, **kwargs)
        except SystemExit as exit_request:
            if exit_request.code not in (0, None):
                raise
            value = None
        except TrainingStopped as stopped:  # every rank saved at the same step: a clean end
            steps, where = stopped.completed_steps, stopped.checkpoint_dir
            events.send(RankStopped(context.rank, steps, where, stopped.why, time.time()))
            _barrier()
            return 0
        for at_end in session.at_function_end:  # the last background save finishes
            at_end()
        if session.stop_agreed is not None:  # nbaccel.save_due() said stop: it returned
            steps, where, why = session.stop_agreed
            events.send(RankStopped(context.rank, steps, where, why, time.time()))
            _barrier()
            return 0
        if box is None:
            packed = Packed(dump_result(context.rank, value))
        else:
            packed, segment = pack_result(context.rank, value, into=box)
            if segment is not None:
                segment.close()  # the kernel holds the box too
        if context.rank == 0 and config.preload_libraries:
            events.send(ModulesImported(0, imported_since(loaded_before)))
        events.send(ResultReady(context.rank, packed.data, packed.refs))
        if keep is not None:  # keep_workers: this rank serves the kernel's calls now
            serve_kept, address, token = keep  # interactive.on_rank.serve_kept
            # The namespace starts as a cell's function sent to workers.run would find it:
            # what the function took from the kernel, and its value as `result`.
            names = {**(pickling.cell_globals(function) or {}), "result": value}
            del function, args, kwargs
            serve_kept(address, token, names)
        finish(packed.data)
        return 0
    except BaseException as error:  # noqa: BLE001 - every failure is reported, then we exit
        if isinstance(error, bdb.BdbQuit) and debugger.quit_where is not None:
            error.args = (debugger.quit_where,)  # where ``q`` was typed, for the run's error
        elif config is not None and config.post_mortem and config.debugger:
            post_mortem(debugger, error)
        note = explain(error)
        if note is not None and hasattr(error, "add_note"):  # Python 3.11+; travels pickled
            error.add_note(note)
        events.send(error_message(error, context.rank))
        # sys.exit(n) keeps its code, as under torchrun; anything else exits with 1.
        code = getattr(error, "code", 1) if isinstance(error, SystemExit) else 1
        return code if isinstance(code, int) and 0 < code < 256 else 1


def _barrier() -> None:
    """A stopped rank has no value to share (what ``finish`` may do first): it only keeps
    rank 0's store up until every peer is through, as ``finish`` does."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def resume_folder(resume: str) -> Path | None:
    """The local state folder a launch resumes from (``resume`` as the kernel settled it: a
    checkpoint root, a state folder, a URL the ranks fetch later, or ``"never"``)."""
    if resume == "never" or is_url(resume):
        return None
    if (Path(resume) / "meta.json").exists():
        return Path(resume)  # a state folder itself (a durable copy fetched by the kernel)
    point = newest_complete(resume)
    return Path(point.location) / point.name if point is not None else None


def post_mortem(debugger: RankDebugger, error: BaseException) -> None:
    """``post_mortem=True``: pdb at the frame that raised, before the error is reported (and
    the run ended), for an error of the rank's own: not a peer's end, an interrupt or exit."""
    if isinstance(error, (KeyboardInterrupt, SystemExit, bdb.BdbQuit)):
        return
    if classify_failure(error) != "error":
        return  # a peer failed first, or timed out: its frame tells nothing of this rank
    try:
        debugger.post_mortem(error)
    except KeyboardInterrupt:
        pass  # the run is being stopped: the error is reported as it is


def imported_since(loaded_before: set[str]) -> tuple[tuple[str, str | None], ...]:
    """The modules imported since ``loaded_before``, with their files (plain strings)."""
    return tuple(
        (name, getattr(module, "__file__", None))
        for name, module in list(sys.modules.items())
        if name not in loaded_before
    )


def dump_result(rank: int, value: Any, *, sent: str = "returned", keep: str = "") -> bytes:
    """``value`` pickled to go back to the kernel, or a TypeError that says what to send
    instead (``sent``: how the value was sent; ``keep``: a further hint)."""
    try:
        return pickling.dumps(value)
    except Exception as error:
        raise _not_sendable(rank, value, error, sent, keep) from error


def pack_result(
    rank: int, value: Any, into: int | None = None, *, sent: str = "returned", keep: str = ""
) -> tuple[Packed, Segment | None]:
    """``value`` packed to go back to the kernel, its large buffers in a new segment or in
    ``into`` (a result box the kernel holds too); the caller closes the segment once the
    kernel has it. Errors as ``dump_result``'s."""
    try:
        return pack_fresh(value, pickling.dumps, into=into)
    except Exception as error:
        raise _not_sendable(rank, value, error, sent, keep) from error


def _not_sendable(rank: int, value: Any, error: Exception, sent: str, keep: str) -> TypeError:
    return TypeError(
        f"the value {sent} on rank {rank} ({type(value).__name__}) cannot be pickled to "
        f"send it back: {error}. Return plain data (numbers, lists, dicts, tensors){keep}."
    )


def error_message(error: BaseException, rank: int) -> WorkerFailed:
    """The message describing an exception, with a traceback that starts in user code."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _LAUNCHER_FRAMES:
        tb = tb.tb_next
    try:
        pickled: bytes | None = pickling.dumps(error)
    except Exception:  # noqa: BLE001 - the parent falls back to WorkerError
        pickled = None
    return WorkerFailed(
        rank=rank,
        type=f"{type(error).__module__}.{type(error).__qualname__}",
        message=str(error),
        traceback="".join(traceback.format_exception(type(error), error, tb)),
        exception=pickled,
        cause=classify_failure(error),
        time=time.time(),
    )


# Frames above the user's code that a traceback need not show.
# worker.py's frames (its start/finish callbacks) are named by path: importing it here would
# make the circle this module exists to avoid.
_LAUNCHER_FRAMES = frozenset(
    {__file__, os.path.join(os.path.dirname(os.path.dirname(__file__)), "local", "worker.py")}
    | {script.__file__}
    | {"<frozen runpy>"}
)
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
