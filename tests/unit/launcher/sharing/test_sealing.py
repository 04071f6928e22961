"""Every segment is sealed once written: no holder of its fd (a rank, a tool it started)
can shrink the kernel's cached segment under the kernel's mappings (a read past the end of
a shrunk file is a SIGBUS), grow it, or change the bytes the cache vouches for."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from nbaccel.launcher.sharing.cache import SegmentCache
from nbaccel.launcher.sharing.packing import dumps_plain, unpack
from nbaccel.launcher.sharing.segments import Segment, map_private

LIMIT = 1 << 30
MIB = 1 << 20


@pytest.mark.parametrize("size", [MIB, 4 * MIB])  # a plain segment, one in huge pages
def test_a_written_segment_is_sealed(size: int) -> None:
    segment, _ = Segment.write([memoryview(bytearray(b"\1" * size))])
    try:
        for change in (
            lambda: os.ftruncate(segment.fd, 0),  # would SIGBUS every mapping's reader
            lambda: os.ftruncate(segment.fd, 2 * size),
            lambda: os.pwrite(segment.fd, b"x", 0),
            lambda: mmap.mmap(segment.fd, size, flags=mmap.MAP_SHARED),
        ):
            with pytest.raises(PermissionError):
                change()
        view = map_private(segment.fd)  # a rank's private, writable map still works
        view[0] = 7
        assert os.pread(segment.fd, 1, 0) == b"\1"
    finally:
        segment.close()


def test_the_kernels_cached_segment_cannot_be_cut_by_a_holder(cache: SegmentCache) -> None:
    data = np.ones(MIB, dtype="f4")
    _, placement, _ = cache.pack(data, dumps_plain, LIMIT)
    assert placement is not None
    received = os.dup(placement.fds[0])  # what a rank (or any holder) is handed
    placement.close()
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(received, 0)
    finally:
        os.close(received)
    packed, again, _ = cache.pack(data, dumps_plain, LIMIT)  # the next launch reads it whole
    assert again is not None
    assert float(unpack(packed, again.fds).sum()) == MIB
    again.close()


def test_a_result_box_is_sealed_once_the_rank_wrote_its_value() -> None:
    # The kernel maps a rank's result box to read the value: a rank that cut it short
    # afterwards would kill the kernel with SIGBUS.
    from nbaccel.launcher.results import ResultBoxes
    from nbaccel.launcher.sharing.packing import pack_fresh

    boxes = ResultBoxes()
    box = boxes.make(0)
    assert box is not None
    ranks_box = os.dup(box)  # what the rank is handed
    try:
        packed, segment = pack_fresh(np.ones(MIB, "f4"), dumps_plain, into=ranks_box)
        assert segment is not None and segment.fd == ranks_box
        with pytest.raises(PermissionError):
            os.ftruncate(ranks_box, 0)
        view = boxes.take(0, packed.refs)
        assert view is not None and float(unpack(packed, [ranks_box]).sum()) == MIB
    finally:
        os.close(ranks_box)
        boxes.close()
