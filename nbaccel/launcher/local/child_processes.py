"""Pieces of the helper process: how it imports (no garbage collection, then frozen), how
many spares it forks first and when it forks them again, how it collects exits, signals a
worker's process group (or the worker alone), drains its wake-up pipe, and tells a torch_xla
machine.

Stdlib and nbaccel's base modules only (the helper imports it before torch is needed).

>>> signal_group(2**22 + 12345, 0)  # no such process: nothing happens, nothing raised
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

from nbaccel.hardware.devices import visible_gpu_count

# Spares forked as soon as the helper is ready, before any launch says how many it wants.
FIRST_SPARES = 2
MAX_SPARES = 16


# Missing spares wait while a launch's workers start: forking a copy of this torch-sized
# process copies its page tables (~10 ms of a core a spare), which the starting ranks need:
# a 2-rank launch on 2 cores took 0.072 s instead of 0.048 (docs/benchmarks.md). They are
# forked once the workers have exited, or this long after the last request.
SPARES_AFTER_REQUEST_SECONDS = 0.3


def spares_held_for(*, missing: bool, workers_alive: bool, quiet_for: float) -> float:
    """How long missing spares still wait (0: fork them now, or none is missing).

    >>> spares_held_for(missing=True, workers_alive=True, quiet_for=0.1)  # ranks starting
    0.2
    >>> spares_held_for(missing=True, workers_alive=False, quiet_for=0.0)  # they exited
    0.0
    """
    if not missing or not workers_alive:
        return 0.0
    return max(0.0, round(SPARES_AFTER_REQUEST_SECONDS - quiet_for, 6))


def xla_machine() -> bool:
    """Whether launches here go through torch_xla (a TPU, or PJRT_DEVICE set) with a
    torch_xla that can be imported: then each launch's supervisor, forked from us, finds it
    imported (2-4 s saved per launch; the import starts no thread, so forking stays safe)."""
    from pathlib import Path

    from nbaccel.hardware.devices import detect_tpu
    from nbaccel.hardware.xla_plan import check_versions

    tpu = detect_tpu(Path("/"), os.environ)
    return bool(tpu.chips or os.environ.get("PJRT_DEVICE")) and check_versions() is None


def first_spares() -> int:
    """Spares to fork before any launch: one per visible GPU, at least FIRST_SPARES."""
    return min(MAX_SPARES, max(FIRST_SPARES, visible_gpu_count(os.environ)))


def next_exit(among: set[int] | None) -> tuple[int, int]:
    """(pid, wait status) of an exited child (one of ``among`` if given), or (0, 0)."""
    if among is None:
        try:
            return os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 0, 0
    for pid in among:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if done:
            return done, status
    return 0, 0


def signal_group(pid: int, signum: int) -> None:
    """Send ``signum`` to the process group a worker leads (gone or not ours: nothing)."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        try:  # not yet its own group leader (signalled right after fork)
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    except PermissionError:
        pass


def signal_pid(pid: int, signum: int) -> None:
    """Send ``signum`` to a worker alone, none of the processes it started (gone or not
    ours: nothing): what a stack dump needs, whose SIGUSR2 would end a DataLoader worker,
    a subprocess or a tracker's service the rank started.

    >>> signal_pid(2**22 + 12345, 0)  # no such process: nothing happens, nothing raised
    """
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def drain(fd: int) -> bool:
    """Read what a non-blocking pipe holds (up to 4 KiB); whether there was anything."""
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


@contextlib.contextmanager
def frozen_imports() -> Iterator[None]:
    """No garbage collection while importing, then what was imported is frozen.

    With torch loaded, each full collection walks ~0.3 M objects (~0.1 s here): measured,
    the nbaccel part of PRELOAD took 0.2 s with collections and 0.06-0.1 s without. Frozen
    objects are skipped by every later collection, in the helper and in its forked workers,
    whose collections then neither walk them nor copy their pages (what gc.freeze is for).
    """
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
