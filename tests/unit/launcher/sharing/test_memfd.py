"""Shared memory where Python lacks ``os.memfd_create`` (uv's and some conda builds): the C
library's call, the raw system call, a /dev/shm file unlinked at once, else the pipe; each
said once, none failing a launch."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from nbaccel.launcher.results import ResultBoxes
from nbaccel.launcher.sharing import memfd
from nbaccel.launcher.sharing.cache import SegmentCache
from nbaccel.launcher.sharing.packing import dumps_plain, pack_fresh, unpack

LIMIT = 1 << 30
MIB = 1 << 20


@pytest.fixture(autouse=True)
def undecided(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test chooses afresh (the process keeps its choice otherwise)."""
    monkeypatch.setattr(memfd, "_chosen", None)
    monkeypatch.setattr(memfd, "_none_left", False)
    monkeypatch.setattr(memfd, "_told", False)
    yield


@pytest.fixture
def cache() -> Iterator[SegmentCache]:
    made = SegmentCache()
    yield made
    made.clear()


class NoMemfdLibc(ctypes.CDLL):
    """A C library without memfd_create or syscall (glibc < 2.27, a locked-down libc)."""

    def __getattr__(self, name: str) -> Any:
        if name in ("memfd_create", "syscall"):
            raise AttributeError(name)
        return super().__getattr__(name)


def without(monkeypatch: pytest.MonkeyPatch, *ways: str) -> None:
    if "os" in ways:
        monkeypatch.delattr(os, "memfd_create", raising=False)
    if "ctypes" in ways:
        monkeypatch.setattr(ctypes, "CDLL", NoMemfdLibc)
    if "shm" in ways:
        monkeypatch.setattr(memfd, "SHM_FOLDER", "/no/such/folder")


def fd_target(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def shm_names() -> list[str]:
    return [name for name in os.listdir("/dev/shm") if "nbaccel" in name]


def round_trip(cache: SegmentCache) -> tuple[Any, str | None, str]:
    """A launch's data packed and unpacked: the value, the notice, where it lay."""
    data = np.arange(MIB, dtype="f4")
    packed, placement, notice = cache.pack(data, dumps_plain, LIMIT)
    if placement is None:
        return unpack(packed, []), notice, "the pickle"
    where = fd_target(placement.fds[0])
    value = unpack(packed, placement.fds)
    placement.close()
    assert np.array_equal(value, data)
    return value, notice, where


def test_without_os_memfd_create_the_c_library_makes_the_memfd(
    monkeypatch: pytest.MonkeyPatch, cache: SegmentCache
) -> None:
    without(monkeypatch, "os")
    _, notice, where = round_trip(cache)
    assert where == "/memfd:nbaccel-data (deleted)" and notice is None
    told = memfd.take_notice()
    assert told is not None and "no os.memfd_create" in told and "C library" in told
    assert memfd.take_notice() is None  # said once


def test_without_the_c_library_function_the_system_call_makes_it(
    monkeypatch: pytest.MonkeyPatch, cache: SegmentCache
) -> None:
    # ctypes' libc without memfd_create, but syscall: hide only the libc function.
    class NoWrapper(ctypes.CDLL):
        def __getattr__(self, name: str) -> Any:
            if name == "memfd_create":
                raise AttributeError(name)
            return super().__getattr__(name)

    monkeypatch.delattr(os, "memfd_create", raising=False)
    monkeypatch.setattr(ctypes, "CDLL", NoWrapper)
    _, _, where = round_trip(cache)
    assert where == "/memfd:nbaccel-data (deleted)"
    assert "system call" in (memfd.take_notice() or "")


def test_without_any_memfd_a_dev_shm_file_unlinked_at_once(
    monkeypatch: pytest.MonkeyPatch, cache: SegmentCache
) -> None:
    without(monkeypatch, "os", "ctypes")
    before = shm_names()
    _, notice, where = round_trip(cache)
    assert where.startswith("/dev/shm/nbaccel-data-") and where.endswith(" (deleted)"), where
    assert shm_names() == before  # no name left while the segment lives
    assert notice is None and "/dev/shm" in (memfd.take_notice() or "")
    boxes = ResultBoxes()
    box = boxes.make(0)
    assert box is not None and fd_target(box).startswith("/dev/shm/nbaccel-result-")
    boxes.close()


def test_without_shared_memory_the_data_goes_through_the_pipe_said_once(
    monkeypatch: pytest.MonkeyPatch, cache: SegmentCache
) -> None:
    without(monkeypatch, "os", "ctypes", "shm")
    for _ in range(2):
        value, notice, where = round_trip(cache)
        assert where == "the pickle" and notice is None  # not once per launch
        assert float(value.sum()) == float(np.arange(MIB, dtype="f4").sum())
    told = memfd.take_notice()
    assert told is not None and "through the pipe" in told
    assert memfd.take_notice() is None
    assert ResultBoxes().make(0) is None  # a value comes back inside its pickle
    packed, segment = pack_fresh(np.ones(MIB, "f4"), dumps_plain)  # a rank's value
    assert segment is None and float(unpack(packed, []).sum()) == MIB


def test_running_out_of_fds_is_not_taken_for_a_missing_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_fds(name: str) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(memfd, "WAYS", (("os.memfd_create", no_fds), *memfd.WAYS[1:]))
    with pytest.raises(OSError) as raised:
        memfd.new_fd("nbaccel-data")
    assert raised.value.errno == errno.EMFILE and memfd._chosen is None


def test_the_prewarms_payload_does_not_take_the_launchs_notice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The prewarm builds a payload in the background at import (api.warm_planning): the
    # notice is the first launch's to say.
    from nbaccel.launcher.api import warm_planning

    without(monkeypatch, "os")
    warm_planning()
    told = memfd.take_notice()
    assert told is not None and "no os.memfd_create" in told
