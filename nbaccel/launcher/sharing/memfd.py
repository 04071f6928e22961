"""How this process makes a shared-memory fd: a memfd, by whatever way this Python allows.

``os.memfd_create`` is missing from some Pythons although every Linux since 3.17 has the
system call: those built by python-build-standalone before its mid-2026 releases (uv's and
mise's managed Pythons, astral-sh/uv#15081) and some conda builds. So ``new_fd`` tries, in
turn: ``os.memfd_create``; the C library's ``memfd_create`` through ctypes (glibc 2.27+);
the raw system call (``syscall(319)`` on x86-64, 279 on arm64); a private file in
``/dev/shm`` (tmpfs, shared memory too), unlinked at once so that no name outlives this
call. The first way that works is kept for the process. Where none does, ``new_fd``
raises ``NoSharedMemory`` (an ``OSError``: callers already send such data inside the
pickle, a copy per rank). ``take_notice`` says once which way was taken, where it was not
the first.

A memfd is made sealable (``MFD_ALLOW_SEALING``): ``seal`` forbids, once a segment is
written, any write, shrink or growth through any fd or shared mapping of it, so that no
process handed the fd can cut the pages under the kernel's mappings (a read past the end
of a shrunk file is a SIGBUS) or change data the kernel's cache vouches for. A ``/dev/shm``
file cannot be sealed: there a holder could still shrink it. Stdlib only.

>>> fd = new_fd("nbaccel-doc")
>>> os.write(fd, b"abc"), seal(fd)
(3, True)
>>> try:
...     os.ftruncate(fd, 0)
... except PermissionError:
...     print("sealed")
sealed
>>> os.close(fd)
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import tempfile
import threading
from collections.abc import Callable

MFD_CLOEXEC = 0x1  # <linux/memfd.h>: the os module has these only where it has memfd_create
MFD_ALLOW_SEALING = 0x2
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
SEALS = 0x2 | 0x4 | 0x8  # F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE
SYSCALL_NUMBERS = {"x86_64": 319, "aarch64": 279, "arm64": 279}
SHM_FOLDER = "/dev/shm"
# What says that a way is not there at all (as opposed to a lack of memory or fds, which
# the next way would meet too and which the caller must hear about).
ABSENT = {errno.ENOSYS, errno.EINVAL, errno.EPERM, errno.EACCES, errno.ENOENT, errno.EOPNOTSUPP}


class NoSharedMemory(OSError):
    """No way to make shared memory in this process: the data goes through the pipe."""


def _os(name: str) -> int:
    return os.memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING)


def _libc(name: str) -> int:
    function = ctypes.CDLL(None, use_errno=True).memfd_create  # AttributeError: glibc < 2.27
    function.argtypes, function.restype = [ctypes.c_char_p, ctypes.c_uint], ctypes.c_int
    return _checked(function(name.encode(), MFD_CLOEXEC | MFD_ALLOW_SEALING))


def _syscall(name: str) -> int:
    number = SYSCALL_NUMBERS.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"no memfd_create system call number for {platform.machine()}")
    function = ctypes.CDLL(None, use_errno=True).syscall
    function.restype = ctypes.c_long
    flags = ctypes.c_uint(MFD_CLOEXEC | MFD_ALLOW_SEALING)
    return _checked(function(ctypes.c_long(number), ctypes.c_char_p(name.encode()), flags))


def _shm_file(name: str) -> int:
    # Private (0600, from mkstemp), not inherited (PEP 446), and nameless at once: the
    # file lives only as long as some process holds its fd or maps it, as a memfd does.
    fd, path = tempfile.mkstemp(prefix=f"{name}-", dir=SHM_FOLDER)
    os.unlink(path)
    return fd


def _checked(fd: int) -> int:
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return fd


WAYS: tuple[tuple[str, Callable[[str], int]], ...] = (
    ("os.memfd_create", _os),
    ("the C library's memfd_create", _libc),
    ("the memfd_create system call", _syscall),
    ("a file in /dev/shm", _shm_file),
)
NOTICES = {
    "the C library's memfd_create": (
        "this Python has no os.memfd_create (uv's and some conda builds): shared memory for "
        "the workers' data is made through the C library instead, with the same effect"
    ),
    "the memfd_create system call": (
        "this Python has no os.memfd_create (uv's and some conda builds): shared memory for "
        "the workers' data is made by the memfd_create system call instead, with the same "
        "effect"
    ),
    "a file in /dev/shm": (
        "this system has no memfd_create, so the workers' data is shared through unnamed "
        "files in /dev/shm, whose size limits it (Docker's default is 64 MB: raise it with "
        "--shm-size, or use a Python with os.memfd_create)"
    ),
    "": (
        "no shared memory can be made here (no memfd_create, no writable /dev/shm), so "
        "arrays and tensors go to the workers through the pipe, a copy per rank, and their "
        "values come back the same way; a Linux Python with os.memfd_create shares them"
    ),
}

_lock = threading.Lock()
_chosen: tuple[str, Callable[[str], int]] | None = None
_none_left = False
_told = False


def new_fd(name: str) -> int:
    """A new, empty shared-memory fd (close-on-exec) named ``name`` where names show
    (``/proc/PID/fd``); NoSharedMemory where this process has no way to make one."""
    if _chosen is not None:
        return _chosen[1](name)
    return _choose(name)


def _choose(name: str) -> int:
    global _chosen, _none_left
    with _lock:
        if _chosen is not None:
            return _chosen[1](name)
        if _none_left:
            raise NoSharedMemory(errno.ENOSYS, NOTICES[""])
        for way in WAYS:
            try:
                fd = way[1](name)
            except AttributeError:
                continue  # this Python or C library lacks it
            except OSError as error:
                if error.errno in ABSENT:
                    continue
                raise  # out of memory or fds: the next way would fail as well
            _chosen = way
            return fd
        _none_left = True
        raise NoSharedMemory(errno.ENOSYS, NOTICES[""])


def take_notice() -> str | None:
    """Which way this process makes shared memory, where it is not ``os.memfd_create``:
    said once per process (None after, and where nothing needs saying)."""
    global _told
    if _chosen is None and not _none_left:
        try:
            os.close(new_fd("nbaccel-probe"))
        except OSError:
            pass
    with _lock:
        if _told or (_chosen is None and not _none_left):  # undecided yet (no fds left)
            return None
        _told = True
        way = "" if _none_left or _chosen is None else _chosen[0]
    return NOTICES.get(way)


def seal(fd: int) -> bool:
    """Forbid writing, shrinking and growing ``fd``'s memory from now on (every fd and
    mapping of it); False where it cannot be sealed (a /dev/shm file). No shared writable
    mapping of it may be left (EBUSY)."""
    try:
        fcntl.fcntl(fd, F_ADD_SEALS, SEALS)
    except OSError as error:
        if error.errno in (errno.EPERM, errno.EINVAL):  # not sealable: a file, an old memfd
            return False
        raise
    return True
