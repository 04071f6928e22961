"""What the sharing tests share: a segment cache of their own, emptied after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nbaccel.launcher.sharing.cache import SegmentCache


@pytest.fixture
def cache() -> Iterator[SegmentCache]:
    made = SegmentCache()
    yield made
    made.clear()
