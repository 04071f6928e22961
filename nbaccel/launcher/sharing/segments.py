"""Memfd segments: buffers written once into anonymous shared memory, mapped by each process
that is handed the fd (``memfd.new_fd``: an unnamed /dev/shm file where no memfd can be had).

A segment is one memfd holding several buffers, each at a page-aligned offset, so that a
rank's write into one buffer copies only that buffer's pages. Its fd reaches other
processes with a launch's other fds (``SCM_RIGHTS`` over a local socket, or inherited), so
nothing can outlive the processes that hold it: no name in ``/dev/shm`` to reap, and no
``/dev/shm`` size limit to meet (Docker's 64 MB default does not apply to a memfd). The
memory is the machine's, as any process's is. A segment is sealed once written
(``memfd.seal``): no holder of its fd can write, shrink or grow it.

Receivers map it private and writable (``MAP_PRIVATE``): reading shares the pages; a write
copies the page it touches for that process alone, so a rank's write never reaches the
kernel's data or another rank's (a fork gives the same). Segments of 2 MiB or more are held
in huge pages where the kernel allows (Linux 6.1+, whatever ``shmem_huge_mode`` says but
"deny"), and every process maps them at a 2 MiB boundary, so that a rank reads them as fast
as a fork reads the kernel's own arrays. Stdlib only.

>>> segment, offsets = Segment.write([memoryview(b"abc"), memoryview(b"defg")])
>>> offsets, segment.size == 2 * PAGE
([0, 4096], True)
>>> view = map_private(segment.fd)
>>> bytes(view[4096:4100])
b'defg'
>>> view[0] = ord("x")  # private: the segment itself is unchanged
>>> bytes(map_private(segment.fd)[:3])
b'abc'
>>> segment.close()
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from nbaccel.launcher.sharing import memfd

PAGE = mmap.PAGESIZE
NAME = "nbaccel-data"  # how a segment shows in /proc/PID/fd: "/memfd:nbaccel-data (deleted)"
# Where the machine's owner says whether shared memory may use transparent huge pages.
SHMEM_HUGE_SETTING = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
HUGE_PAGE = 2 << 20  # below this a segment cannot hold a huge page (x86-64, arm64 4K)
MAP_FIXED = 0x10  # Linux's value on x86, arm, riscv and powerpc; the mmap module lacks it
MADV_COLLAPSE = 25  # Linux 6.1+; the mmap module names it from Python 3.13 only
T = TypeVar("T")


def aligned(size: int) -> int:
    """``size`` rounded up to whole pages.

    >>> aligned(1), aligned(PAGE), aligned(0)
    (4096, 4096, 0)
    """
    return -(-size // PAGE) * PAGE


class Segment:
    """A memfd this process owns (its fd closes with ``close``)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size

    @classmethod
    def write(
        cls, buffers: Sequence[memoryview], into: int | None = None, *, seal: bool = True
    ) -> tuple[Segment, list[int]]:
        """A segment holding ``buffers`` (contiguous), and each one's offset: a new memfd, or
        ``into`` (an empty one this process was given, which the segment then owns).
        ``seal``: sealed once written (``memfd.seal``; the caller seals it after writing
        more into it otherwise).

        Raises OSError when the memory cannot be had (the caller falls back to the pipe).
        """
        segment, offsets, _ = cls.write_with(buffers, _copy, into, seal=seal)
        return segment, offsets

    @classmethod
    def write_with(
        cls,
        buffers: Sequence[memoryview],
        copy: Callable[[memoryview, memoryview], T],
        into: int | None = None,
        *,
        seal: bool = True,
    ) -> tuple[Segment, list[int], list[T]]:
        """``write``, each buffer's bytes given to ``copy(target, source)`` to put into
        place: also what each ``copy`` returned (``digests.copy_digest`` returns the digest
        of what it wrote)."""
        offsets = layout(buffers)
        size = offsets[-1] + aligned(buffers[-1].nbytes) if buffers else 0
        fd = memfd.new_fd(NAME) if into is None else into
        try:
            os.ftruncate(fd, size)
            done = _fill(fd, size, buffers, offsets, copy)
            if seal:
                memfd.seal(fd)
        except BaseException:
            if into is None:
                os.close(fd)
            raise
        return cls(fd, size), offsets, done

    def close(self) -> None:
        """Close this process's fd (processes that mapped or hold it keep their pages)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def layout(buffers: Sequence[memoryview]) -> list[int]:
    """Where each buffer goes in a segment: each at a page boundary, in order.

    >>> layout([memoryview(b"abc"), memoryview(b"defg")])
    [0, 4096]
    """
    offsets, size = [], 0
    for buffer in buffers:
        offsets.append(size)
        size += aligned(buffer.nbytes)
    return offsets


def _copy(target: memoryview, source: memoryview) -> None:
    target[:] = source


def map_private(fd: int) -> memoryview:
    """The whole memfd ``fd``, mapped copy-on-write: reads share its pages, a write copies
    a page for this process only. The map lives as long as a view of it does (the fd may
    be closed at once)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return memoryview(bytearray())
    return _map(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)[1]


def _map(fd: int, size: int, flags: int, prot: int) -> tuple[mmap.mmap, memoryview]:
    # A huge page maps only where the address and the file offset agree modulo 2 MiB, and
    # the kernel places a shared-memory file anywhere unless its policy allows huge pages.
    # So the file goes over a 2 MiB boundary inside an anonymous mapping 2 MiB larger,
    # which Python owns: it is unmapped, file and all, once no view of it is left (or at
    # its ``close``).
    if size < HUGE_PAGE:
        whole = mmap.mmap(fd, size, flags=flags, prot=prot)
        return whole, memoryview(whole)
    room = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=prot)
    start = buffer_address(memoryview(room))
    skip = -start % HUGE_PAGE
    libc_mmap = _capi()[2]
    if libc_mmap(start + skip, size, prot, flags | MAP_FIXED, fd, 0) != start + skip:
        errno = ctypes.get_errno()
        room.close()
        raise OSError(errno, f"could not map a shared segment: {os.strerror(errno)}")
    return room, memoryview(room)[skip : skip + size]


def shmem_huge_mode(setting: str = SHMEM_HUGE_SETTING) -> str:
    """The machine's policy for huge pages in shared memory: the word in brackets of
    ``setting`` ("always", "within_size", "advise", "never"...; "never" where unreadable).

    >>> shmem_huge_mode("/no/such/file")
    'never'
    """
    try:
        with open(setting, encoding="ascii") as file:
            words = file.read().split()
    except OSError:
        return "never"
    return next((word[1:-1] for word in words if word.startswith("[")), "never")


def _fill(
    fd: int,
    size: int,
    buffers: Sequence[memoryview],
    offsets: list[int],
    copy: Callable[[memoryview, memoryview], T],
) -> list[T]:
    if size == 0:
        return [copy(memoryview(bytearray()), as_bytes(buffer)) for buffer in buffers]
    with writable(fd, size) as target:
        done = []
        for buffer, offset in zip(buffers, offsets, strict=True):
            data = as_bytes(buffer)
            done.append(copy(target[offset : offset + data.nbytes], data))
        return done


@contextlib.contextmanager
def writable(fd: int, size: int, *, prepare: bool = True) -> Iterator[memoryview]:
    """The memfd ``fd`` (``size`` bytes, > 0) mapped to be written, on huge pages where the
    machine allows; unmapped at the end, before the segment is sealed (a writable shared
    mapping left would refuse the seal). ``prepare=False``: a second process's mapping of a
    segment whose first one has prepared it (under "never" the preparation writes a byte in
    each 2 MiB: a second one would overwrite what had been written there).

    Memory written through ``pwrite`` or a plain mapping gets 4 KiB pages, which a rank
    reads at a third of the speed: 1 GiB in 0.14 s here, against 0.045 s for huge pages or
    a fork reading the kernel's arrays (numpy's are on huge pages); the cost is the page
    faults, 512 times as many. The policy "advise" gives huge pages to a mapping marked
    MADV_HUGEPAGE ("always", "within_size" and "force" to any); under "never", the usual
    default, MADV_COLLAPSE (Linux 6.1+) still builds them on request: it needs a page
    present in each 2 MiB, and then 1 GiB costs ~0.06 s, the time of zeroing it, after which
    the copies are plain (0.05 s, against 0.3 s or more into 4 KiB pages). Where neither is
    allowed ("deny", an older kernel, memory too fragmented) the copies get 4 KiB pages.
    """
    whole, target = _map(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        if size >= HUGE_PAGE:
            mode = shmem_huge_mode()
            if mode not in ("never", "deny"):
                _advise(target, mmap.MADV_HUGEPAGE, size)
            elif mode == "never" and prepare:
                huge = size - size % HUGE_PAGE
                for offset in range(0, huge, HUGE_PAGE):
                    os.pwrite(fd, b"\0", offset)
                _advise(target, MADV_COLLAPSE, huge)
        yield target
    finally:
        target.release()
        try:
            whole.close()
        except BufferError:  # a view still held by an error's traceback: unmapped with it
            pass


def _advise(view: memoryview, advice: int, size: int) -> None:
    # Advice only: where it is refused the memory still works, on 4 KiB pages.
    madvise = _capi()[3]
    madvise(buffer_address(view), size, advice)


def as_bytes(buffer: memoryview) -> memoryview:
    """A contiguous buffer as its bytes (format "B", one dimension), without a copy.

    >>> as_bytes(memoryview(bytearray(8)).cast("d")).nbytes, as_bytes(memoryview(b"ab")).format
    (8, 'B')
    """
    return buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer


def pwrite_all(fd: int, buffer: memoryview, offset: int) -> None:
    """Write all of ``buffer`` into ``fd`` at ``offset`` (``pwrite`` may write less)."""
    data = as_bytes(buffer)
    done = 0
    while done < data.nbytes:
        done += os.pwrite(fd, data[done:], offset + done)  # Linux writes <= 2 GiB per call


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (part of its stable ABI)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.py_object),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


@functools.cache
def _capi() -> tuple[Any, Any, Any, Any]:
    get = ctypes.pythonapi.PyObject_GetBuffer
    get.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
    get.restype = ctypes.c_int
    release = ctypes.pythonapi.PyBuffer_Release
    release.argtypes = [ctypes.POINTER(_PyBuffer)]
    release.restype = None
    libc = ctypes.CDLL(None, use_errno=True)
    libc_mmap = libc.mmap
    libc_mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc_mmap.restype = ctypes.c_void_p
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return get, release, libc_mmap, madvise


def buffer_address(buffer: memoryview) -> int:
    """Where a contiguous buffer's first byte lies in this process (read-only ones too,
    which ``ctypes.c_char.from_buffer`` refuses).

    >>> data = bytearray(b"xy")
    >>> buffer_address(memoryview(data)) == ctypes.addressof(ctypes.c_char.from_buffer(data))
    True
    """
    get, release, *_ = _capi()
    view = _PyBuffer()
    if get(buffer, ctypes.byref(view), 0) != 0:  # PyBUF_SIMPLE: contiguous bytes
        raise BufferError("not a contiguous buffer")
    try:
        return int(view.buf or 0)
    finally:
        release(ctypes.byref(view))
