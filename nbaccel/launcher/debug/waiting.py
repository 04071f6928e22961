"""What a ``Run`` does with its debug channels: serve stops while it is waited for, and
read every rank's stacks now.

``wait_serving`` is ``Run.wait``'s loop: the thread that waits for the run (the cell of
``notebook_launcher``, ``run.result()``) serves its ranks' debugger stops one after the other
(``console.DebugConsole``), the stepping rank's first. ``collect_stacks`` asks every rank on
its channel and, for a rank that does not answer within the timeout (a thread holding the
GIL in C code, a worker with no channel), falls back to faulthandler's dump into its log
(SIGUSR2, as the hang report does), read back from the log. Stdlib only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from nbaccel.events import STACK_DUMP_SIGNAL
from nbaccel.launcher.debug.console import DebugConsole
from nbaccel.launcher.debug.hub import STEP_PATIENCE, DebugHub
from nbaccel.launcher.debug.stacks import STACKS_TIMEOUT, describe

DUMP_TIMEOUT = 2.0  # then how long faulthandler's dump may take to reach its log
_DUMP_HEADER = "(most recent call first)"


def wait_serving(
    hub: DebugHub | None,
    console: DebugConsole | None,
    done: threading.Event,
    timeout: float | None,
) -> bool:
    """Wait until ``done`` (True) or ``timeout`` passes (False), serving the hub's stops
    meanwhile if no other thread serves them. A session in progress is held to its end,
    past the timeout: the user is typing in it."""
    if hub is None or console is None or not hub.serving():
        return done.wait(timeout)  # nothing to serve here: another thread does, or nobody
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        prefer: int | None = None
        while not done.is_set():
            left = 0.25 if deadline is None else min(0.25, deadline - time.monotonic())
            if left <= 0:
                return False
            stop = hub.next_stop(left, prefer)
            if stop is not None:
                prefer = stop.rank if console.serve(stop) else None
            elif hub.closed:
                done.wait(left)
        return True
    finally:
        hub.done_serving()


def serve_pending(hub: DebugHub | None, console: DebugConsole | None) -> None:
    """Serve the stops waiting now, and a stepping rank's next ones, if no other thread
    serves them (interactive workers, between two looks at their replies)."""
    if hub is None or console is None or not hub.serving():
        return
    try:
        prefer: int | None = None
        while stop := hub.next_stop(STEP_PATIENCE if prefer is not None else 0.0, prefer):
            prefer = stop.rank if console.serve(stop) else None
    finally:
        hub.done_serving()


def collect_stacks(
    hub: DebugHub | None,
    ranks: Iterable[int],
    *,
    host_of: Callable[[int], str | None],
    signal_ranks: Callable[[int, list[int]], None],
    log_path: Callable[[int], Path],
    timeout: float = STACKS_TIMEOUT,
) -> dict[int, str]:
    """Each of ``ranks``' stacks now, as text (``stacks.describe``); ranks whose channel did
    not answer get faulthandler's dump from their log (``STACK_DUMP_SIGNAL`` to them)."""
    ranks = sorted(ranks)
    answers = hub.stacks(ranks, timeout) if hub is not None else {}
    texts = {rank: describe(rank, host_of(rank), answer) for rank, answer in answers.items()}
    missing = [rank for rank in ranks if rank not in answers]
    if missing:
        sizes = {rank: _size(log_path(rank)) for rank in missing}
        signal_ranks(int(STACK_DUMP_SIGNAL), missing)
        dumps = _read_dumps(log_path, sizes, DUMP_TIMEOUT)
        for rank in missing:
            where = f"rank {rank}" + (f" on {host}" if (host := host_of(rank)) else "")
            how = (
                "faulthandler's dump from its log (its channel did not answer within "
                f"{timeout:g} s: a thread holds the GIL in C code, or it has no channel):"
            )
            texts[rank] = f"{where}: {how}\n{dumps.get(rank) or '(no dump came)'}"
    return dict(sorted(texts.items()))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_dumps(
    log_path: Callable[[int], Path], sizes: dict[int, int], timeout: float
) -> dict[int, str]:
    """What each rank's log gained since ``sizes``, once it holds a whole dump (the dump's
    header and a line after it that stopped growing), within ``timeout``."""
    deadline = time.monotonic() + timeout
    dumps: dict[int, str] = {}
    last: dict[int, str] = {}
    while len(dumps) < len(sizes) and time.monotonic() < deadline:
        time.sleep(0.05)  # the pump copies the dump from the pipe into the log: poll it
        for rank, size in sizes.items():
            if rank in dumps:
                continue
            try:
                with open(log_path(rank), "rb") as log:
                    log.seek(size)
                    text = log.read().decode(errors="replace")
            except OSError:
                continue
            if _DUMP_HEADER in text and text == last.get(rank):
                dumps[rank] = text[text.index("Thread ") if "Thread " in text else 0 :]
            last[rank] = text
    for rank, text in last.items():
        dumps.setdefault(rank, text)
    return dumps
