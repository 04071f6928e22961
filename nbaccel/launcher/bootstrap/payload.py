"""Serialise the user's function, arguments and config for the workers (parent side).

cloudpickle sends functions defined in a notebook cell or ``python -`` by value, closures
and referenced globals included (through ``pickling``, which keeps code's file names, ships
compiled classes by reference and refuses open files and sockets). When that fails, we find
and name the variable that cannot travel, before any process starts. The parent's
``sys.path`` and the source of notebook cells (held only in the kernel's linecache) travel
too, so imports resolve the same way and worker tracebacks show the cell's lines.

Large buffers (arrays, DataFrames, Arrow tables, tensors: a global, a closure's variable or
an argument) stay out of the pickle: they go into shared memory once, kept there between
launches while unchanged (``sharing``), and every rank maps the same pages.
"""

from __future__ import annotations

import linecache
import os
import pickle
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbaccel.config.schema import Config
from nbaccel.errors import SerializationError
from nbaccel.launcher.bootstrap import pickling
from nbaccel.launcher.sharing.cache import Placement, limit_bytes, pack_shared
from nbaccel.launcher.sharing.packing import Packed, gather

MAX_CELL_SOURCES_BYTES = 8 << 20


@dataclass(frozen=True)
class Payload:
    """What every worker of a launch reads (``data``: the file they are handed), the
    shared-memory segments its buffers lie in (their fds travel after the launch's other
    fds), and why its buffers were not shared, when they were refused (notices)."""

    data: bytes
    shared: Placement | None = None
    notices: tuple[str, ...] = ()

    @property
    def data_fds(self) -> list[int]:
        """The segments' fds, in the order the buffers refer to them (none: nothing shared)."""
        return self.shared.fds if self.shared is not None else []

    def settle(self, ranks: int) -> None:
        """Check the data reused from earlier launches, now that the ``ranks`` workers that
        wait for it are started (``sharing.late_check``); nothing to do without such data."""
        if self.shared is not None and self.shared.check is not None:
            self.shared.check.settle(ranks)

    def close(self) -> None:
        """Close this process's fds of the segments (once handed to every worker)."""
        if self.shared is not None:
            self.shared.close()


def build_payload(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    config: Config,
    settle_later: bool = False,
    notices: Sequence[str] = (),
    keep: tuple[Callable[[str, str, Any], None], str, str] | None = None,
) -> Payload:
    """What every worker reads: function, args, kwargs, config, sys.path, cell sources.
    ``settle_later``: data kept from earlier launches is checked once the workers are
    started (``Payload.settle``; workers of this machine, started by the kernel).
    ``keep``: ``(serve, address, secret)``: once the function returned, each rank calls
    ``serve(address, secret, names)`` to serve as interactive workers (``keep_workers``;
    ``serve`` travels by reference)."""
    limit = limit_bytes(config.shared_memory_limit_gb)
    packed, shared, notice = pack_call(function, args, kwargs, limit, settle_later)
    data = pickle.dumps(
        {
            "function": packed.data,
            "refs": packed.refs,
            "late": shared is not None and shared.check is not None,
            "config": config,
            "sys_path": list(sys.path),
            "sources": cell_sources(),
            "keep": keep,
        },
        protocol=5,
    )
    return Payload(data, shared, tuple(notices) + ((notice,) if notice else ()))


def pack_call(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    limit: int,
    settle_later: bool = False,
) -> tuple[Packed, Placement | None, str | None]:
    """``(function, args, kwargs)`` packed for this machine's workers (large buffers in
    shared memory, within ``limit`` bytes: 0 keeps them in the pickle), the placement of
    those buffers, and why they went inside the pickle when sharing was refused.
    SerializationError names the variable that cannot travel (interactive workers send
    each call this way too)."""
    call = (function, tuple(args), dict(kwargs))
    try:
        return pack_shared(call, pickling.dumps, limit, settle_later)
    except Exception as error:
        raise SerializationError(_explain(function, args, kwargs, error)) from error


def _explain(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any], error: Exception
) -> str:
    name = getattr(function, "__qualname__", repr(function))
    fix = (
        "Create such objects inside the function (each worker needs its own), or pass "
        "something that can be pickled (a path, a config) and build the object from it."
    )
    for label, value in _suspects(function, args, kwargs):
        try:
            pickling.dumps(value)
        except pickling.CannotTravel as inner:  # the message has its own fix
            return f"Cannot send {name!r} to the worker processes: {label} is {inner}."
        except Exception as inner:  # noqa: BLE001
            return (
                f"Cannot send {name!r} to the worker processes: {label} "
                f"(a {type(value).__name__}) cannot be pickled: {inner}. {fix}"
            )
    return f"Cannot send {name!r} to the worker processes: {error}. {fix}"


def _suspects(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Iterator[tuple[str, Any]]:
    for index, value in enumerate(args):
        yield f"args[{index}]", value
    for key, value in kwargs.items():
        yield f"keyword argument {key!r}", value
    code = getattr(function, "__code__", None)
    if code is None:
        return
    closure = getattr(function, "__closure__", None) or ()
    for var, cell in zip(code.co_freevars, closure, strict=False):
        try:
            yield f"the closure variable {var!r}", cell.cell_contents
        except ValueError:  # empty cell
            continue
    namespace = getattr(function, "__globals__", {})
    for var in sorted(_global_names(code)):
        if var in namespace and not isinstance(namespace[var], types.ModuleType):
            yield f"the global variable {var!r}", namespace[var]


def _global_names(code: types.CodeType) -> set[str]:
    """Names a function (and the functions nested in it) may read from its globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def cell_sources() -> dict[str, list[str]]:
    """Source lines that exist only in this process's linecache (Jupyter cells, exec'd code)."""
    sources: dict[str, list[str]] = {}
    total = 0
    for filename, entry in list(linecache.cache.items()):
        if len(entry) != 4 or entry[1] is not None or os.path.exists(filename):
            continue
        lines = list(entry[2])
        total += sum(map(len, lines))
        if total > MAX_CELL_SOURCES_BYTES:
            break
        sources[filename] = lines
    return sources


def for_other_hosts(payload: bytes, data_fds: Sequence[int]) -> tuple[bytes, list[bytes]]:
    """``payload`` and the bytes of its buffers for agents on other hosts: only the
    buffers it refers to (``packing.gather``), with its refs made to point there; its
    segments, kept by the kernel's cache, may hold other launches' data too."""
    outer = pickle.loads(payload)
    if not outer.get("refs"):
        return payload, []
    refs, data = gather(outer["refs"], data_fds)
    return pickle.dumps({**outer, "refs": refs}, protocol=5), [data]


def read_payload(fd: int) -> bytes:
    """The whole payload file behind ``fd`` (the launch hands it over as a file), read
    with ``pread`` so the file's offset stays where it is for the next reader.

    >>> import tempfile
    >>> with tempfile.TemporaryFile() as file:
    ...     _ = file.write(b"payload"); file.flush()
    ...     read_payload(file.fileno())
    b'payload'
    """
    size, chunks, offset = os.fstat(fd).st_size, [], 0
    while offset < size and (chunk := os.pread(fd, size - offset, offset)):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
