"""Names for nbaccel's processes in ``ps``, ``top``, ``htop`` and ``nvidia-smi``.

The helper, its base, its spares and every worker are one interpreter started as ``python
-m nbaccel.launcher.local.helper_main FD PID`` and forked: without names, an idle spare looks
like a stray worker (or a stray training) and the base, whose parent is init, like a leak.
Each is named for what it is, twice: ``/proc/self/comm`` (``ps -e``, ``top``, ``pgrep``;
15 bytes at most) through ``prctl(PR_SET_NAME)``, and the command line (``ps aux``, ``htop``,
``nvidia-smi``) through the ``setproctitle`` package, which rewrites the memory the kernel
reads it from. Where setproctitle is missing, the command line stays as it was; where prctl
is (not Linux), nothing changes. A name is a label, never a way to find a process: nbaccel
finds its own by pid.

>>> short_name("nbaccel rank 12345 (run 20261129-070000-abcdef)")
'nbaccel r12345'
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

_PR_SET_NAME = 15
_COMM_BYTES = 15  # TASK_COMM_LEN - 1


def helper_title(kernel_pid: int) -> str:
    """The helper's name: it serves the process ``kernel_pid`` (a kernel, or a script)."""
    return f"nbaccel helper (for pid {kernel_pid})"


def base_title(kernel_pid: int) -> str:
    """The helper's base (``successor``): idle, ready to become the next helper."""
    return f"nbaccel base (next helper for pid {kernel_pid})"


def spare_title(kernel_pid: int) -> str:
    """An idle spare: it becomes a worker when a launch asks for one."""
    return f"nbaccel spare (for pid {kernel_pid})"


def worker_title(rank: int, run_id: str, *, supervisor: bool = False) -> str:
    """A worker (or, for torch_xla, the one process that starts every rank)."""
    what = "torch_xla supervisor" if supervisor else f"rank {rank}"
    return f"nbaccel {what} (run {run_id})"


def child_title(rank: int, run_id: str) -> str:
    """A process a worker forked (a DataLoader worker): the user's, not one of nbaccel's;
    named so, where it would otherwise look like a second ``rank N``."""
    return f"nbaccel child of rank {rank} (run {run_id})"


def name_children(title: str) -> None:
    """Name every process this one forks from now on ``title`` (``os.register_at_fork``);
    a fork that execs takes its new program's name. libc and setproctitle are loaded here,
    so that the child only makes the calls (no ``dlopen`` in the fork of a threaded process)."""
    _libc()
    _setproctitle()
    os.register_at_fork(after_in_child=lambda: name_process(title))


def short_name(title: str) -> str:
    """What fits in ``/proc/self/comm``: the title up to its parenthesis, else shortened.

    >>> short_name("nbaccel rank 3 (run x)"), short_name("nbaccel base (next helper for pid 1)")
    ('nbaccel rank 3', 'nbaccel base')
    >>> short_name("nbaccel torch_xla supervisor (run x)"), short_name(child_title(3, "x"))
    ('nbaccel xla sup', 'nbaccel child')
    """
    name = title.split(" (", 1)[0]
    if len(name) <= _COMM_BYTES:
        return name
    if name.startswith("nbaccel child of rank "):
        return "nbaccel child"
    if name.startswith("nbaccel rank "):
        return ("nbaccel r" + name.removeprefix("nbaccel rank "))[:_COMM_BYTES]
    return name.replace("torch_xla supervisor", "xla sup")[:_COMM_BYTES]


def name_process(title: str) -> None:
    """Name this process ``title`` (its command line) and ``short_name(title)`` (its comm).

    Cheap (microseconds): a forked spare names itself before it waits, a worker as it starts.
    Never raises: a name is worth no failure.
    """
    setter = _setproctitle()
    if setter is not None:
        try:
            setter(title)
        except Exception:  # noqa: BLE001 - a label only
            pass
    _set_comm(short_name(title))


def _setproctitle() -> Any:
    """setproctitle's setter, imported once (None where the package is missing). The helper
    imports it before it forks anything, so spares and workers find it loaded."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return None
    return setproctitle


_LIBC: list[Any] = []  # this process's libc, loaded once


def _libc() -> Any:
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def _set_comm(name: str) -> None:
    libc = _libc() if sys.platform.startswith("linux") else None
    if libc is None:
        return
    try:
        libc.prctl(_PR_SET_NAME, name.encode()[:_COMM_BYTES], 0, 0, 0)
    except AttributeError:
        pass  # a libc without prctl
