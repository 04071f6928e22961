"""A helper's successor, ready in milliseconds: a copy of the helper taken before it
preloaded anything the kernel or a worker asked for.

A preloaded library can make a helper unusable: its files changed on disk (a ``pip install``
in the notebook: ``installed_files``), or it made forking unsafe (``preload``). What the
helper imported of its own accord before "ready" (torch, nbaccel's worker code) is still
good then, and a fresh interpreter would spend seconds importing torch again (more with
CUDA). So right after "ready", before it serves anything, the helper forks a *base*: an
idle process that holds that state and waits on a socket. To replace the helper, the kernel
sends it ``succeed`` with one end of a new socket pair; the helper hands that end to its
base, which becomes a helper of its own (``leave_old_helper``): in a session of its own, it
serves the kernel on the new socket and says "ready". The old helper stops forking, ends its
runs in flight, and exits when the kernel closes it.

The base is no descendant of its helper: it is forked through a child that exits at once,
before the helper becomes a child subreaper, so it goes to init (or to whatever subreaper is
above the kernel). A helper adopts what its workers leave behind and kills every descendant
when it exits (``kill_descendants``); a successor among them, or the successor's own
successor (orphaned to the old helper once the one between them exited), was taken for an
orphan and killed with the old helper's runs. Outside the tree, no helper can touch another,
whichever outlives which. The base exits when its helper closes its socket or dies.

If a file the base itself holds changed (torch upgraded), the kernel starts a fresh helper
instead. The successor forks a base of its own, the same way, when it says "ready".
"""

from __future__ import annotations

import os
import select
import signal
import socket
from collections.abc import Callable
from typing import Any

from nbaccel.launcher import control
from nbaccel.launcher.bootstrap.process_names import name_process


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
    close_in_child: Callable[[], None], become: Become, title: str = "nbaccel base"
) -> tuple[int, socket.socket] | None:
    """Fork the base: (its pid, our end of its socket), or None if fork failed. Call it
    before this process becomes a child subreaper (or the base would come back to it).

    ``close_in_child`` closes, in the base, what it must not hold: the kernel's socket (or
    the kernel would never see it close), spares' sockets, fds of requests waiting.
    The base runs ``become(message, fds)`` with what ``succeed`` sends it (the exit code it
    returns ends it), or exits on EOF: its helper retired it or is gone (the socket's other
    end is ours alone: every process we fork after closes it). ``title``: its name in ps
    (``process_names``): its parent is init, and it should not look like a leak.
    """
    ours, theirs = control.socket_pair()
    try:
        between = os.fork()
    except OSError:
        ours.close()
        theirs.close()
        return None
    if between == 0:  # exits at once, leaving the base to init; never returns
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            ours.close()
            close_in_child()
            base = os.fork()
            if base == 0:
                name_process(title)
                code = _serve_as_base(theirs, become)
            else:
                control.send(theirs, {"op": "base", "pid": base})
                code = 0
        finally:
            os._exit(code)
    theirs.close()
    try:
        os.waitpid(between, 0)
        told, _ = control.receive(ours)
    except OSError:
        told = None
    if told is None:  # the second fork failed: no base
        ours.close()
        return None
    return int(told["pid"]), ours


def _serve_as_base(theirs: socket.socket, become: Become) -> int:
    """In the base: wait for ``succeed`` (or EOF), then become the helper it names."""
    message, fds = control.receive(theirs)
    theirs.close()
    return become(message, fds) if message is not None else 0


def leave_old_helper(message: dict[str, Any], fds: list[int]) -> tuple[socket.socket, ParentWatch]:
    """In the base, told to succeed: in a session of our own, the kernel's new socket and a
    watch on the kernel (``serve_as_helper`` makes it a subreaper once its base is forked)."""
    os.setsid()
    sock = socket.socket(fileno=fds[0])
    for fd in fds[1:]:
        os.close(fd)
    return sock, ParentWatch(int(message["parent_pid"]), child=False)


def kill_descendants() -> None:
    """Kill and reap every process under this one: workers, spares, what they left (no
    successor is among them: ``fork_base``)."""
    import psutil

    me = psutil.Process()
    try:
        found = me.children(recursive=True)
    except psutil.Error:
        found = []
    for process in found:
        try:
            process.kill()
        except psutil.Error:
            pass
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while True:  # our children now: the killed, and orphans that came back to us
        try:
            children = me.children()
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
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
