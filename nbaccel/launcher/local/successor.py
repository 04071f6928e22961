"""A helper's successor, ready in milliseconds: a copy of the helper taken before it
preloaded anything the kernel or a worker asked for.

A preloaded library can make a helper unusable: its files changed on disk (a ``pip install``
in the notebook: ``installed_files``), or it made forking unsafe (``preload``). What the
helper imported of its own accord (torch, nbaccel's worker code, ...) is still good then,
and a fresh interpreter would spend seconds importing torch again (more with CUDA). So just
before its first preload the helper forks a *base*: an idle child that holds that state and
waits on a socket. To replace the helper, the kernel sends it ``succeed`` with one end of a
new socket pair; the helper hands that end to its base, which becomes a helper of its own
(``become_helper``): it leaves the old helper's session and parent-death signal, serves the
kernel on the new socket and says "ready". The old helper stops forking, ends its runs in
flight, and exits when the kernel closes it, leaving its successor's processes alone.

If a file the base itself holds changed (torch upgraded), the kernel starts a fresh helper
instead. The successor forks a base of its own before its first preload.
"""

from __future__ import annotations

import os
import select
import signal
import socket
from collections.abc import Callable
from typing import Any

from nbaccel.launcher import control
from nbaccel.launcher.bootstrap.prctl import set_child_subreaper, set_parent_death_signal


class ParentWatch:
    """Whether the kernel that owns a helper still runs.

    The first helper is the kernel's child: its parent pid says. A successor was forked by
    the old helper and outlives it: it watches the kernel through a pidfd (readable once the
    process has exited; immune to pid reuse), or ``kill(pid, 0)`` where there is none.

    >>> ParentWatch(os.getppid(), child=True).alive()
    True
    """

    def __init__(self, pid: int, *, child: bool) -> None:
        self.pid = pid
        self._pidfd: int | None = None
        self._child = child
        if not child:
            try:
                self._pidfd = os.pidfd_open(pid)
            except (AttributeError, OSError):
                self._pidfd = None

    def alive(self) -> bool:
        if self._child:
            return os.getppid() == self.pid
        if self._pidfd is not None:
            exited, _, _ = select.select([self._pidfd], [], [], 0)
            return not exited
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


Become = Callable[[dict[str, Any], list[int]], int]


def fork_base(
    close_in_child: Callable[[], None], become: Become
) -> tuple[int, socket.socket] | None:
    """Fork the base: (its pid, our end of its socket), or None if fork failed.

    ``close_in_child`` closes, in the base, what it must not hold: the kernel's socket (or
    the kernel would never see it close), spares' sockets, fds of requests waiting.
    The base runs ``become(message, fds)`` with what ``succeed`` sends it (the exit code it
    returns ends it), or exits on EOF: its helper retired it or is gone.
    """
    ours, theirs = control.socket_pair()
    helper_pid = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        ours.close()
        theirs.close()
        return None
    if pid == 0:  # the base; never returns
        code = 0
        try:
            signal.set_wakeup_fd(-1)
            ours.close()
            close_in_child()
            set_parent_death_signal(signal.SIGKILL)  # until it succeeds the helper
            if os.getppid() == helper_pid:
                message, fds = control.receive(theirs)
                theirs.close()
                if message is not None:
                    code = become(message, fds)
        finally:
            os._exit(code)
    theirs.close()
    return pid, ours


def leave_old_helper(message: dict[str, Any], fds: list[int]) -> tuple[socket.socket, ParentWatch]:
    """In the base, told to succeed: outlive the old helper, in a session of our own, as
    subreaper of what we start; the kernel's new socket and a watch on the kernel."""
    set_parent_death_signal(0)
    os.setsid()
    set_child_subreaper()
    sock = socket.socket(fileno=fds[0])
    for fd in fds[1:]:
        os.close(fd)
    return sock, ParentWatch(int(message["parent_pid"]), child=False)


def kill_descendants(keep: int | None) -> None:
    """Kill and reap every process under this one except ``keep`` and what runs under it
    (the successor, which outlives us). Ours are listed before the successor's: a process
    the successor forks meanwhile is never taken for ours."""
    import psutil

    me = psutil.Process()
    kept: set[int] = set()
    try:
        found = me.children(recursive=True)
    except psutil.Error:
        found = []
    if keep is not None:
        kept.add(keep)
        try:
            kept |= {p.pid for p in psutil.Process(keep).children(recursive=True)}
        except psutil.Error:
            pass  # it is gone: nothing of it to spare
    for process in found:
        if process.pid not in kept:
            try:
                process.kill()
            except psutil.Error:
                pass
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while True:  # our children now: the killed, and orphans that came back to us
        try:
            children = [p for p in me.children() if p.pid != keep]
        except psutil.Error:
            children = []
        if not children:
            break
        for child in children:
            try:
                child.kill()
                os.waitpid(child.pid, 0)
            except (psutil.Error, ChildProcessError):
                pass
    if keep is None:
        while True:
            try:
                os.wait()
            except ChildProcessError:
                break
