"""What the kernel's cache writes and keeps: the digest of the bytes it wrote (whatever a
thread does to the array meanwhile), one copy of a changed array at a time, no fd left
when the fds run out, and a tensor's segment gone with the tensor."""

from __future__ import annotations

import errno
import gc
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from nbaccel.launcher.sharing import cache as cache_module
from nbaccel.launcher.sharing import segments
from nbaccel.launcher.sharing.cache import SegmentCache
from nbaccel.launcher.sharing.late_check import await_check
from nbaccel.launcher.sharing.packing import Packed, close_fds, dumps_plain, unpack

LIMIT = 1 << 30
MIB = 1 << 20


def launch(cache: SegmentCache, value: Any, late: bool = False, dumps: Any = dumps_plain) -> Any:
    """One launch of ``value``: what a rank unpickles (checked late, as a local launch
    does, or before)."""
    packed, placement, notice = cache.pack(value, dumps, LIMIT, settle_later=late)
    assert placement is not None, notice
    sent = [os.dup(fd) for fd in placement.fds]
    try:
        refs = packed.refs
        if placement.check is not None:
            placement.check.settle(ranks=1)
            refs, sent = await_check(refs, sent)
        placement.close()
        return unpack(Packed(packed.data, refs), sent)
    finally:
        close_fds(fd for fd in sent if _is_open(fd))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def during_the_copy(monkeypatch: pytest.MonkeyPatch, act: Callable[[], None]) -> list[int]:
    """Call ``act`` once, when a segment's copy of an array begins (after the cache
    took the digest it compares with): the thread that changes an array in between, made
    deterministic. Returns the list the hook appends to (one item per call)."""
    calls: list[int] = []
    real = segments.as_bytes

    def hooked(buffer: memoryview) -> memoryview:
        if buffer.nbytes >= MIB and not calls:
            calls.append(1)
            act()
        return real(buffer)

    monkeypatch.setattr(segments, "as_bytes", hooked)
    return calls


@pytest.mark.parametrize("late", [False, True], ids=["checked-before", "checked-late"])
def test_the_digest_kept_is_of_the_bytes_written(
    cache: SegmentCache, monkeypatch: pytest.MonkeyPatch, late: bool
) -> None:
    data = np.ones(MIB, dtype="f4")
    launch(cache, data)  # written once
    data[0] = 5.0  # changed: the next launch writes it again...

    def mutate() -> None:
        data[0] = 6.0  # ...and a thread changes it again while it is being copied

    with monkeypatch.context() as patched:
        calls = during_the_copy(patched, mutate)
        assert launch(cache, data, late)[0] == 6.0  # what was copied
        assert calls
    data[0] = 5.0  # back to the bytes the first digest was taken of
    assert launch(cache, data, late)[0] == 5.0  # not the stale 6.0 of the segment


def test_a_new_array_changed_during_its_first_copy(
    cache: SegmentCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = np.ones(MIB, dtype="f4")

    def mutate() -> None:
        data[-1] = 2.0

    with monkeypatch.context() as patched:
        during_the_copy(patched, mutate)
        assert launch(cache, data)[-1] == 2.0
    data[-1] = 1.0
    assert launch(cache, data)[-1] == 1.0


def memfds() -> int:
    """This process's fds of data segments."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "nbaccel-data" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return count


@pytest.mark.parametrize("late", [False, True], ids=["checked-before", "checked-late"])
def test_a_changed_array_frees_its_old_copy_before_the_new_is_written(
    cache: SegmentCache, monkeypatch: pytest.MonkeyPatch, late: bool
) -> None:
    data = np.ones(4 * MIB, dtype="f4")  # 16 MiB
    launch(cache, data)
    assert cache.size == data.nbytes and memfds() == 1
    data[0] = 2.0
    seen: dict[str, int] = {}

    def account() -> None:
        seen["held"], seen["fds"] = cache.size, memfds()

    with monkeypatch.context() as patched:
        during_the_copy(patched, account)
        assert launch(cache, data, late)[0] == 2.0
    # While the new copy is written the cache holds no other. Checked before: this process
    # holds no fd of the old segment either (checked late, the launch and its rank still
    # hold theirs: the rank was handed it before the check).
    assert seen["held"] == 0, seen
    if not late:
        assert seen["fds"] == 1, seen  # the new segment's, being written
    assert data.nbytes <= cache.size < 2 * data.nbytes and memfds() == 1  # late: + a header


def test_an_unchanged_neighbour_keeps_the_old_segment(cache: SegmentCache) -> None:
    same, changed = np.ones(MIB, dtype="f4"), np.zeros(MIB, dtype="f4")
    launch(cache, {"same": same, "changed": changed})  # one segment holds both
    changed[0] = 1.0
    got = launch(cache, {"same": same, "changed": changed})
    assert got["same"].sum() == MIB and got["changed"].sum() == 1.0


def test_out_of_fds_closes_what_it_made_and_names_the_limit(
    cache: SegmentCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = np.ones(MIB, dtype="f4"), np.zeros(MIB, dtype="f4")
    launch(cache, first)  # a segment...
    value = {"first": first, "second": second}  # ...and a new one: two fds to make
    made: list[int] = []
    real = os.dup

    def dup_once(fd: int) -> int:
        if made:
            raise OSError(errno.EMFILE, "Too many open files")
        made.append(real(fd))
        return made[-1]

    monkeypatch.setattr(cache_module.os, "dup", dup_once)
    packed, placement, notice = cache.pack(value, dumps_plain, LIMIT)
    monkeypatch.undo()
    assert made and not _is_open(made[0])  # the fd made before the failure was closed
    assert memfds() == len(cache._segments) == 2  # the cache's own, and nothing more
    assert placement is None and notice is not None  # the data goes inside the pickle
    assert "ulimit -n" in notice and "RLIMIT_NOFILE" in notice, notice
    assert unpack(packed, [])["second"].sum() == 0.0


def test_a_tensors_segment_goes_when_the_tensor_goes(cache: SegmentCache) -> None:
    torch = pytest.importorskip("torch")
    from nbaccel.launcher.bootstrap import pickling

    tensor = torch.ones(MIB, dtype=torch.float32)
    got = launch(cache, tensor, dumps=pickling.dumps)
    assert float(got.sum()) == MIB and cache.size >= tensor.nbytes
    launch(cache, tensor, dumps=pickling.dumps)  # kept across launches while it lives
    assert cache.size >= tensor.nbytes
    del tensor
    gc.collect()
    assert cache.size == 0  # dropped at once, as docs/data.md says


def test_tensor_attributes_arrive_and_the_data_is_still_shared(cache: SegmentCache) -> None:
    torch = pytest.importorskip("torch")
    from nbaccel.launcher.bootstrap import pickling

    tensor = torch.arange(MIB, dtype=torch.float32)
    tensor.meta = {"source": "features.npy", "rows": 7}
    parameter = torch.nn.Parameter(torch.ones(MIB))
    parameter.tag = "embedding"
    packed, placement, _ = cache.pack(
        {"t": tensor, "p": parameter}, pickling.dumps, LIMIT, settle_later=False
    )
    assert placement is not None and len(packed.refs) == 2  # both out of band
    got = unpack(packed, placement.fds)
    placement.close()
    assert got["t"].meta == {"source": "features.npy", "rows": 7}
    assert got["p"].tag == "embedding" and isinstance(got["p"], torch.nn.Parameter)
    assert torch.equal(got["t"], tensor) and torch.equal(got["p"], parameter)
