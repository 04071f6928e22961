"""Data reused from the cache is checked while the ranks start: what changed reaches them
through the late segment, what did not is not copied, and a check that fails or never
comes stops them with an error instead of letting them read unchecked data."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from nbaccel.launcher.sharing.cache import SegmentCache
from nbaccel.launcher.sharing.late_check import await_check
from nbaccel.launcher.sharing.packing import Packed, close_fds, dumps_plain, unpack

LIMIT = 1 << 30
MIB = 1 << 20


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def launch_late(cache: SegmentCache, value: Any, settle: bool = True) -> Any:
    """A launch of ``value`` with a late check, and what one rank unpickles."""
    packed, placement, _ = cache.pack(value, dumps_plain, LIMIT, settle_later=True)
    assert placement is not None and placement.check is not None
    sent = [os.dup(fd) for fd in placement.fds]  # what the rank is handed
    try:
        if settle:
            placement.check.settle(ranks=1)
        placement.close()
        refs, fds = await_check(packed.refs, sent)
        return unpack(Packed(packed.data, refs), fds)
    finally:
        close_fds(fd for fd in sent if _is_open(fd))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_what_changed_arrives_and_only_it_is_written_again(cache: SegmentCache) -> None:
    same, changed = np.ones(MIB, dtype="f4"), np.zeros(MIB, dtype="f4")
    value = {"same": same, "changed": changed, "same again": same}  # one buffer asked twice
    cache.pack(value, dumps_plain, LIMIT)
    written = cache.bytes_written
    changed[-1] = 3.0
    got = launch_late(cache, value)
    assert got["changed"][-1] == 3.0 and got["changed"].sum() == 3.0
    assert got["same"].sum() == MIB and got["same again"].sum() == MIB
    assert cache.bytes_written == written + changed.nbytes  # not the unchanged one
    changed[0] = 1.0  # and the next launch checks against what was written last
    assert launch_late(cache, value)["changed"].sum() == 4.0


def test_nothing_changed_writes_nothing(cache: SegmentCache) -> None:
    data = np.arange(MIB, dtype="f4")
    cache.pack(data, dumps_plain, LIMIT)
    written = cache.bytes_written
    assert np.array_equal(launch_late(cache, data), data)
    assert cache.bytes_written == written


def test_a_check_that_fails_stops_the_rank_and_leaves_no_fd(
    cache: SegmentCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = np.ones(MIB, dtype="f4")
    cache.pack(data, dumps_plain, LIMIT)
    before = open_fds()

    def no_memory(*args: Any) -> dict[int, Any]:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(cache, "settle", no_memory)
    packed, placement, _ = cache.pack(data, dumps_plain, LIMIT, settle_later=True)
    assert placement is not None and placement.check is not None
    sent = [os.dup(fd) for fd in placement.fds]
    with pytest.raises(OSError, match="allocate"):
        placement.check.settle(ranks=1)
    placement.close()
    with pytest.raises(RuntimeError, match="stopped before it had checked"):
        await_check(packed.refs, sent)
    close_fds(fd for fd in sent if _is_open(fd))
    del placement
    assert open_fds() == before


def test_a_launch_dropped_before_its_check_stops_its_ranks(cache: SegmentCache) -> None:
    data = np.ones(MIB, dtype="f4")
    cache.pack(data, dumps_plain, LIMIT)
    with pytest.raises(RuntimeError, match="stopped before it had checked"):
        launch_late(cache, data, settle=False)


def test_without_earlier_data_there_is_nothing_to_check_late(cache: SegmentCache) -> None:
    packed, placement, _ = cache.pack(np.ones(MIB, "f4"), dumps_plain, LIMIT, settle_later=True)
    assert placement is not None and placement.check is None  # new data: written and sent
    assert len(placement.fds) == packed.segments == 1
    placement.close()
