"""Agents on other hosts are sent the buffers a launch uses, not the kernel's whole cached
segments (which hold other launches' data too)."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator

import numpy as np
import pytest

from nbaccel.config.schema import Config
from nbaccel.launcher.bootstrap.payload import build_payload, for_other_hosts
from nbaccel.launcher.sharing.cache import CACHE
from nbaccel.launcher.sharing.packing import Packed, unpack
from nbaccel.launcher.sharing.segments import Segment

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    CACHE.clear()
    yield
    CACHE.clear()


def _use(data: np.ndarray) -> float:
    return float(data.sum())


def test_only_this_launchs_buffers_cross_to_other_hosts() -> None:
    used, other = np.ones(2 * MIB, dtype="f4"), np.zeros(4 * MIB, dtype="f4")
    earlier = build_payload(_use, ({"used": used, "other": other},), {}, Config())
    earlier.close()  # one segment in the cache holds both (24 MiB)
    payload = build_payload(_use, (used,), {}, Config())
    try:
        assert len(payload.data_fds) == 1
        assert os.fstat(payload.data_fds[0]).st_size >= used.nbytes + other.nbytes
        sent, data = for_other_hosts(payload.data, payload.data_fds)
    finally:
        payload.close()
    assert [len(blob) for blob in data] == [used.nbytes]  # not the other launch's 16 MiB
    outer = pickle.loads(sent)
    segment, _ = Segment.write([memoryview(blob) for blob in data])  # as the agent does
    try:
        function, args, _ = unpack(Packed(outer["function"], outer["refs"]), [segment.fd])
    finally:
        segment.close()
    assert function(*args) == float(used.sum())


def test_a_payload_without_buffers_is_sent_as_it_is() -> None:
    payload = build_payload(_use, (np.ones(8, "f4"),), {}, Config())
    assert for_other_hosts(payload.data, payload.data_fds) == (payload.data, [])
