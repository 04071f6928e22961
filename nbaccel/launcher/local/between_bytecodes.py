"""Run a handler in the main thread between two bytecodes of whatever it is doing.

The helper imports heavy modules (``warm_up.WARM_LATER``) while it keeps serving the
kernel: ``serving_while`` calls the handler as soon as the kernel writes to the control
socket (SIGIO: the socket is put in async mode, owned by this process) and every ``every``
seconds (a timer, for what raises no SIGIO, such as the workers' exits). Python runs signal
handlers in the main thread between two bytecodes, so the import just pauses; system calls
interrupted by either signal are restarted, so an import's C code does not see EINTR.
Without SIGIO, a launch during an import waited for the next tick: half a tick on average.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
from collections.abc import Callable, Iterator

SIGNALS = (signal.SIGALRM, signal.SIGIO)


@contextlib.contextmanager
def serving_while(fd: int, handler: Callable[[], None], every: float) -> Iterator[None]:
    """Call ``handler()`` when ``fd`` has input and every ``every`` s while the body runs;
    never inside itself (a signal during the handler is left for the next one).

    >>> import socket
    >>> ours, theirs = socket.socketpair()
    >>> heard = []
    >>> with serving_while(ours.fileno(), lambda: heard.append(ours.recv(9)), 60.0):
    ...     _ = theirs.send(b"spawn")
    ...     while not heard: pass
    >>> heard
    [b'spawn']
    """
    inside = done = False

    def signalled(*_: object) -> None:
        nonlocal inside
        if inside or done:
            return
        inside = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            handler()
        finally:
            signal.setitimer(signal.ITIMER_REAL, every, every)
            inside = False

    previous = {signum: signal.signal(signum, signalled) for signum in SIGNALS}
    for signum in SIGNALS:
        signal.siginterrupt(signum, False)
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_ASYNC)
    signal.setitimer(signal.ITIMER_REAL, every, every)
    try:
        yield
    finally:
        # A signal handled from here on (Python runs handlers between any two bytecodes,
        # these too) must not re-arm the timer after it is disarmed: with SIGALRM back to
        # its default, the next tick would kill the helper (seen: "exited (code -14)").
        done = True
        signal.setitimer(signal.ITIMER_REAL, 0)  # disarmed before SIG_DFL could kill us
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        signal.signal(signal.SIGALRM, previous[signal.SIGALRM])
        # SIGIO's default ends the process: one raised just before the socket left async
        # mode must find it ignored.
        signal.signal(signal.SIGIO, signal.SIG_IGN)
