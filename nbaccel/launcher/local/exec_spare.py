"""A spare started from a fresh interpreter, for a helper that may no longer fork.

When a library the helper preloaded turns out to have started a thread, opened a socket or
initialised CUDA (``preload.import_checked``), forking the helper is unsafe. The kernel
retires that helper, but a launch already on its way still needs workers from it. Such a
helper starts its spares with ``posix_spawn`` (no Python runs between the fork and the
exec) as ``python -m nbaccel.launcher.local.exec_spare FD HELPER_PID``: each imports torch
itself (a cold start, as a first launch's workers once did), then waits on its socket and
becomes the worker exactly as a forked spare does.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from nbaccel.launcher import control
from nbaccel.launcher.bootstrap.prctl import set_parent_death_signal
from nbaccel.launcher.bootstrap.process_names import name_process


def start_exec_spare() -> tuple[int, socket.socket] | None:
    """Start one such spare from the helper: its pid and the helper's end of its socket."""
    ours, theirs = control.socket_pair()
    os.set_inheritable(theirs.fileno(), True)
    argv = [sys.executable, "-m", "nbaccel.launcher.local.exec_spare"]
    try:
        pid = os.posix_spawn(
            sys.executable,
            [*argv, str(theirs.fileno()), str(os.getpid())],
            os.environ,
            setsigdef=(signal.SIGINT, signal.SIGIO, signal.SIGTERM),
        )
    except OSError:
        ours.close()
        return None
    finally:
        theirs.close()
    return pid, ours


def main(argv: list[str]) -> int:
    channel = socket.socket(fileno=int(argv[1]))
    helper_pid = int(argv[2])
    name_process("nbaccel spare (fresh interpreter)")
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != helper_pid:  # the helper died before prctl
        return 1
    from nbaccel.launcher.local.worker import run_worker  # imports torch

    message, fds = control.receive(channel)
    if message is None:
        return 0  # retired unused: the helper closed our socket
    channel.close()
    run_worker(message, fds, helper_pid=helper_pid)  # never returns


if __name__ == "__main__":
    os._exit(main(sys.argv))
