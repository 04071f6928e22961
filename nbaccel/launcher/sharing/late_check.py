"""Data reused from the kernel's cache, checked while the ranks start instead of before.

A warm launch sends data it finds in the cache (``cache``); whether its bytes are still
the ones kept is known only once their digest is taken (~0.02 s per GiB here), and the
ranks need the data only once their process group is up. So a launch on this machine
starts its ranks first and checks after (``LateCheck.settle``), and each rank waits for
the answer before it unpickles the call (``await_check``): the check costs the launch
nothing while it is shorter than the ranks' start.

Two more fds travel last among the launch's data fds: an empty memfd (the *late* segment)
and the read end of a pipe. Data that changed in place is written into the late segment,
after a header at its start: the refs every rank must use instead (a count, then three
64-bit integers per ref); the segment is sealed, then one byte per rank goes down the
pipe. A rank that reads end of file instead (the kernel failed or died while checking)
stops with an error: no rank ever reads data that was not checked.

>>> import numpy, os
>>> from nbaccel.launcher.sharing.cache import SegmentCache
>>> from nbaccel.launcher.sharing.packing import Packed, dumps_plain, unpack
>>> cache, data = SegmentCache(), numpy.ones(1 << 18, "f4")
>>> _ = cache.pack(data, dumps_plain, 1 << 30)  # the first launch writes it
>>> data[0] = 7.0  # changed in place before the next
>>> packed, placement, _ = cache.pack(data, dumps_plain, 1 << 30, settle_later=True)
>>> sent = [os.dup(fd) for fd in placement.fds]  # what a rank is handed
>>> placement.check.settle(ranks=1)  # the kernel, once its ranks are started
>>> refs, fds = await_check(packed.refs, sent)  # the rank
>>> float(unpack(Packed(packed.data, refs), fds)[0])
7.0
>>> placement.close(); close_fds(fds)
"""

from __future__ import annotations

import os
import struct
import weakref
from collections.abc import Callable, Sequence

from nbaccel.launcher.sharing.memfd import new_fd, seal
from nbaccel.launcher.sharing.packing import BufferRef, close_fds
from nbaccel.launcher.sharing.segments import NAME, pwrite_all

COUNT = struct.Struct("<q")
REF = struct.Struct("<qqq")

# The cache's part (``SegmentCache.settle``), given the late segment's fd, its index among
# the launch's segments and the bytes to leave free at its start for the header: the
# distinct buffers that changed, by index, each with its new ref (in the late segment).
Settle = Callable[[int, int, int], dict[int, BufferRef]]


class LateCheck:
    """The kernel's end of one launch's late check (see the module's doc)."""

    def __init__(self, refs: Sequence[BufferRef], asked: Sequence[int], settle: Settle) -> None:
        self.refs, self.asked, self._settle = list(refs), list(asked), settle
        self.late = new_fd(NAME)
        try:
            self.ready, self._ready_write = os.pipe()
        except BaseException:
            os.close(self.late)
            raise
        # Dropped unsettled (a launch that failed before its ranks): nothing stays open.
        self._closer = weakref.finalize(self, close_fds, [self.late, self.ready, self._ready_write])

    @property
    def fds(self) -> list[int]:
        """What travels after the launch's segments: the late segment, the pipe's read end."""
        return [self.late, self.ready]

    def settle(self, ranks: int) -> None:
        """Check the reused data, write what changed and the refs to use instead, then let
        ``ranks`` ranks go on. On an error the pipe closes unanswered: the ranks stop."""
        try:
            late_index = 1 + max(ref[0] for ref in self.refs)  # it travels after them
            changed = self._settle(self.late, late_index, COUNT.size + REF.size * len(self.asked))
            if changed:
                refs = [changed.get(index, ref) for index, ref in enumerate(self.refs)]
                header = COUNT.pack(len(self.asked))
                header += b"".join(REF.pack(*refs[index]) for index in self.asked)
                pwrite_all(self.late, memoryview(header), 0)
            seal(self.late)  # written: no rank can change or cut it under the others
            os.write(self._ready_write, b"\1" * ranks)
        finally:
            self.close()

    def close(self) -> None:
        """Close the kernel's fds; a rank still waiting then reads end of file."""
        self._closer()
        self._settle = _settled


def await_check(
    refs: tuple[BufferRef, ...], fds: Sequence[int]
) -> tuple[tuple[BufferRef, ...], list[int]]:
    """A rank's side: wait for the kernel's check, then the refs to unpack with and the
    segments' fds (the late one last; the pipe's end is closed here)."""
    *segments, late, ready = fds
    try:
        answered = os.read(ready, 1)
    finally:
        os.close(ready)
    if not answered:
        raise RuntimeError(
            "the kernel stopped before it had checked the data this launch sends (it failed "
            "or was interrupted while comparing arrays kept from an earlier launch); the "
            "kernel's error says why: launch again"
        )
    if os.fstat(late).st_size:  # some data changed: every ref as the kernel now says
        (count,) = COUNT.unpack(os.pread(late, COUNT.size, 0))
        table = os.pread(late, REF.size * count, COUNT.size)
        refs = tuple(REF.iter_unpack(table))
    return refs, [*segments, late]


def _settled(late: int, late_index: int, room: int) -> dict[int, BufferRef]:
    raise RuntimeError("this launch's data was checked already (or its check was dropped)")
