"""The worker side of interactive workers: the function their long launch runs on every rank.

``serve`` connects back to the kernel (``workers.py``) at the address it was given (an
abstract Unix socket, or TCP on several machines: ``wire``), checks that the kernel holds
the launch's secret and proves it does too, says which rank it is, then runs commands until
the kernel closes the connection: a pickled call (``workers.run``), a cell's code
(``%%nbaccel``), values in (``push``) and out (``pull``), freeing memory. Every command runs
in this rank's one namespace, so what a cell builds is there for the next. The reply is the
value (pickled as a launch's result is) or the error as a launch reports one
(``worker_bootstrap.error_message``), with the memory held after the command.

An interrupt is SIGINT to this process (the kernel asks the helper to send it): it raises
``KeyboardInterrupt`` only while a command runs, and the command's reply says "interrupted".
Between commands SIGINT does nothing, so a late one cannot break the frame being read.
After each command a mark in the output (``output.mark_line``, taken out of the logs by the
kernel's pump) tells the kernel that the command's output has all been read (output and
replies travel on different pipes).
"""

from __future__ import annotations

import ast
import bdb
import builtins
import gc
import linecache
import os
import pickle
import signal
import socket
import sys
import time
import types
from typing import Any

import psutil
import torch

from nbaccel.context import WorkerSession, active_session
from nbaccel.events import SAVE_AND_STOP_SIGNALS
from nbaccel.launcher.bootstrap.pickling import cell_globals
from nbaccel.launcher.bootstrap.prctl import flush_c_stdio
from nbaccel.launcher.bootstrap.worker_bootstrap import dump_result, error_message, pack_result
from nbaccel.launcher.interactive.model_ops import find_model, full_entries, map_on_rank
from nbaccel.launcher.interactive.state_export import Prepacked, export_state
from nbaccel.launcher.interactive.wire import (
    connect,
    done_mark,
    recv_frame_fds,
    send_frame,
    worker_handshake,
)
from nbaccel.launcher.output import TRAINED_MARK, mark_line
from nbaccel.launcher.sharing.packing import Packed, close_fds, inline_chunks, unpack
from nbaccel.launcher.sharing.segments import Segment, map_private


class _Interrupts:
    """SIGINT raises KeyboardInterrupt only while a command runs (see the module's doc), and
    only in this process: the interrupt reaches the rank's whole process group, and a child
    forked during a command (a DataLoader worker) inherits this handler, which there does
    nothing, so persistent DataLoader workers outlive an interrupt."""

    def __init__(self) -> None:
        self.running = False
        self._pid = os.getpid()

    def __call__(self, signum: int, frame: types.FrameType | None) -> None:
        if self.running and os.getpid() == self._pid:
            self.running = False  # one KeyboardInterrupt per command, as in a kernel
            raise KeyboardInterrupt


def serve(
    address: str, token: str, namespace: dict[str, Any] | None = None, trained: bool = False
) -> None:
    """Run the kernel's commands on this rank until it closes the connection. ``namespace``:
    names the rank's namespace starts with (a kept launch's ``result``); ``trained``: the
    rank ran a launch's function first (``keep_workers``), so its save-and-stop signals go
    back to their default (the training they served has ended), and the last Accelerator
    it made is there as ``accelerator``."""
    if trained:
        for signum in SAVE_AND_STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
    session = active_session()
    if trained:
        # Everything the function printed and logged is read before the mark: the kernel
        # hands the ranks over to their group once every rank's mark and value are in.
        _mark_output(TRAINED_MARK, session)
        if session is not None and session.accelerator is not None:
            namespace = {**(namespace or {}), "accelerator": session.accelerator}
    rank = session.context.rank if session is not None else int(os.environ.get("RANK", "0"))
    sock = connect(address)
    if not worker_handshake(sock, token):
        raise ConnectionError(
            f"the kernel at {address} could not prove it started these workers; they stop."
        )
    sock.settimeout(None)
    send_frame(sock, pickle.dumps({"rank": rank, "pid": os.getpid()}))
    namespace = {"__name__": "__main__", "__builtins__": builtins, **(namespace or {})}
    interrupts = _Interrupts()
    signal.signal(signal.SIGINT, interrupts)
    local = sock.family == socket.AF_UNIX  # values' buffers go back in shared memory
    kept: dict[str, Any] = {"error": None}  # the last command's error: for a post-mortem
    try:
        while True:
            frame, fds = recv_frame_fds(sock)
            if frame is None:
                break
            command = pickle.loads(frame)
            command["fds"], command["kept"] = fds, kept
            reply, segment = _execute(command, namespace, rank, interrupts, local)
            _mark_output(done_mark(command["seq"]), session)
            send_frame(sock, pickle.dumps(reply, protocol=5), [segment.fd] if segment else [])
            if segment is not None:
                segment.close()  # the kernel holds it now
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sock.close()


def _mark_output(text: str, session: WorkerSession | None) -> None:
    """Everything printed (C's buffers too) and logged so far, then the mark ``text``: the
    kernel knows the output before it was read once the mark comes (output and events
    travel on different pipes). Batched metrics go before it, not up to 0.25 s later."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    flush_c_stdio()
    if session is not None:
        session.events.flush()
    sys.stdout.write(mark_line(text))
    sys.stdout.flush()


def _execute(
    command: dict[str, Any],
    namespace: dict[str, Any],
    rank: int,
    interrupts: _Interrupts,
    local: bool,
) -> tuple[dict[str, Any], Segment | None]:
    """Run one command; the reply, and the segment holding its value's large buffers."""
    reply: dict[str, Any] = {"seq": command["seq"], "rank": rank, "status": "ok", "value": None}
    segment = None
    started = time.monotonic()
    try:
        for filename, lines in command.get("sources", {}).items():
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        interrupts.running = True
        try:
            value = _OPERATIONS[command["op"]](command, namespace)
        finally:
            interrupts.running = False
            close_fds(command["fds"])  # what was mapped stays
        sent, keep = "returned or pulled", KEEP_IN_NAMESPACE
        if isinstance(value, Prepacked):  # a state dict, written into its segment already
            segment = value.segment
            if local:
                reply["value"], reply["refs"] = value.packed.data, value.packed.refs
            else:  # a copy inside the message, across machines
                maps = [map_private(segment.fd)] if segment is not None else []
                reply["value"] = b"".join(inline_chunks(value.packed, maps))
                if segment is not None:
                    segment.close()
                segment = None
        elif local:
            packed, segment = pack_result(rank, value, sent=sent, keep=keep)
            reply["value"], reply["refs"] = packed.data, packed.refs
        else:
            reply["value"] = dump_result(rank, value, sent=sent, keep=keep)
    except KeyboardInterrupt:
        reply["status"] = "interrupted"
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the kernel
        reply["status"] = "error"
        error = _from_user_code(error)
        if not isinstance(error, bdb.BdbQuit) and command["op"] != "debug":
            # Kept with its frames (the model and tensors they hold) until the next error,
            # as IPython keeps sys.last_traceback: workers.debug() opens pdb there.
            command["kept"]["error"] = error
        reply["error"] = error_message(error, rank)
    reply["seconds"] = time.monotonic() - started
    reply["memory"] = memory_now()
    return reply, segment


def _run(command: dict[str, Any], namespace: dict[str, Any]) -> Any:
    function, args, kwargs = _sent_call(command)
    value = in_namespace(function, namespace)(*args, **kwargs)
    if command.get("keep_as"):  # workers.launch: the value stays, as a kept launch's does
        namespace[command["keep_as"]] = value
    return value


def _sent_call(command: dict[str, Any]) -> Any:
    """The ``(function, args, kwargs)`` a command carries, its buffers mapped."""
    return unpack(Packed(command["call"], command.get("refs", ())), command["fds"])


def in_namespace(function: Any, namespace: dict[str, Any]) -> Any:
    """A function defined in the kernel's ``__main__`` (a cell's, sent by value) runs with
    this rank's namespace as its globals, as a ``%%nbaccel`` cell does (ipyparallel's rule
    for interactive functions): ``workers.run(evaluate)`` finds the model a cell built. The
    globals it took from the kernel fill in only the names the rank lacks. Functions of an
    importable module keep their own.

    >>> namespace = {"scale": 10}
    >>> exec("def f(x):\\n    return x * scale", kernel := {"__name__": "__main__", "scale": 1})
    >>> in_namespace(kernel["f"], namespace)(2), in_namespace(len, namespace)("ab")
    (20, 2)
    """
    kernel = cell_globals(function)
    if kernel is None or not isinstance(function, types.FunctionType):
        return function
    for name, value in kernel.items():
        namespace.setdefault(name, value)
    rebound = types.FunctionType(
        function.__code__, namespace, function.__name__, function.__defaults__, function.__closure__
    )
    rebound.__kwdefaults__ = function.__kwdefaults__
    rebound.__qualname__ = function.__qualname__
    return rebound


def _exec(command: dict[str, Any], namespace: dict[str, Any]) -> Any:
    """A cell's code; the value of its last line when that is an expression (its repr)."""
    filename: str = command["filename"]
    source: str = command["code"]
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    tree = ast.parse(source, filename, "exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    assert last is None or isinstance(last, ast.Expr)
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    expression = ast.Expression(last.value)
    value = eval(compile(expression, filename, "eval"), namespace)
    return None if value is None else repr(value)


def _push(command: dict[str, Any], namespace: dict[str, Any]) -> Any:
    _, _, values = _sent_call(command)  # packed as a call: dict(**values)
    namespace.update(values)
    return None


def _pull(command: dict[str, Any], namespace: dict[str, Any]) -> Any:
    missing = [name for name in command["names"] if name not in namespace]
    if missing:
        raise NameError(
            f"{', '.join(map(repr, missing))} not defined in this rank's namespace: define it in "
            "a %%nbaccel cell or with workers.push(name=value) first."
        )
    return {name: namespace[name] for name in command["names"]}


def _free_memory(command: dict[str, Any], namespace: dict[str, Any]) -> Any:
    command["kept"]["error"] = None  # the last error's frames hold what they held
    gc.collect()
    if _cuda_in_use():
        torch.cuda.empty_cache()
    return None


def _post_mortem(command: dict[str, Any], namespace: dict[str, Any]) -> Any:
    """pdb at the frame of this rank's last error (``workers.debug``), if it is the rank
    asked for; whether a session was held (nobody to type: skipped, said once)."""
    session = active_session()
    if command["rank"] != (session.context.rank if session is not None else 0):
        return None
    error = command["kept"]["error"]
    if error is None:
        raise ValueError(
            "this rank has raised nothing since the workers started, so there is no frame to "
            "debug: workers.debug() opens pdb where a rank's last call failed."
        )
    debugger = session.debugger if session is not None else None
    if debugger is None:
        raise RuntimeError("this rank has no debug channel to the kernel")
    return debugger.post_mortem(error)


def _state_dict(command: dict[str, Any], namespace: dict[str, Any]) -> Any:
    """The model's whole state dict, into the kernel through shared memory (``model_ops``)."""
    model = find_model(command.get("name"), namespace)
    return export_state(full_entries(model), _rank_and_world()[0])


def _map(command: dict[str, Any], namespace: dict[str, Any]) -> Any:
    """This rank's share of ``workers.map`` (``model_ops.map_on_rank``)."""
    _, (fn, dataset), options = _sent_call(command)
    fn = _named(fn, namespace, "fn") if isinstance(fn, str) else in_namespace(fn, namespace)
    if isinstance(dataset, str):
        dataset = _named(dataset, namespace, "dataset")
    rank, world_size = _rank_and_world()
    return map_on_rank(fn, dataset, rank=rank, world_size=world_size, **options)


def _named(name: str, namespace: dict[str, Any], what: str) -> Any:
    if name not in namespace:
        raise NameError(
            f"{what}={name!r} names nothing in this rank's namespace: define it in a "
            "%%nbaccel cell or with workers.push first, or pass the object itself."
        )
    return namespace[name]


def _rank_and_world() -> tuple[int, int]:
    session = active_session()
    if session is None:
        return 0, 1
    return session.context.rank, session.context.world_size


# What a value that cannot travel back should have done instead, beside plain data.
KEEP_IN_NAMESPACE = "; keep models and optimizers in the rank's namespace"

_OPERATIONS = {
    "run": _run,
    "exec": _exec,
    "push": _push,
    "pull": _pull,
    "free": _free_memory,
    "debug": _post_mortem,
    "state_dict": _state_dict,
    "map": _map,
}


def memory_now() -> dict[str, int]:
    """This process's resident memory, and its CUDA device's allocated/reserved bytes."""
    memory = {"rss": psutil.Process().memory_info().rss}
    if _cuda_in_use():
        memory["cuda_allocated"] = torch.cuda.memory_allocated()
        memory["cuda_reserved"] = torch.cuda.memory_reserved()
    return memory


def _cuda_in_use() -> bool:
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def _from_user_code(error: BaseException) -> BaseException:
    """The error with this module's frames dropped from the top of its traceback."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return error.with_traceback(tb)
