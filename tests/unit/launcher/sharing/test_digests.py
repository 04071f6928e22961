"""The cache's content check: a digest that any changed byte changes, the same for the
same bytes however they are viewed, on one core or several."""

from __future__ import annotations

import numpy as np
import pytest

from nbaccel.launcher.sharing import digests
from nbaccel.launcher.sharing.digests import digest


@pytest.mark.parametrize("where", [0, digests.CHUNK - 1, digests.CHUNK, (80 << 20) - 1])
def test_any_byte_changed_changes_the_digest(where: int) -> None:
    data = np.zeros(80 << 20, dtype=np.uint8)  # two chunks, the second one short
    before = digest(memoryview(data))
    data[where] = 1
    assert digest(memoryview(data)) != before
    data[where] = 0
    assert digest(memoryview(data)) == before


def test_chunks_that_trade_places_change_the_digest() -> None:
    data = np.zeros(2 * digests.CHUNK, dtype=np.uint8)
    data[: digests.CHUNK] = 1
    swapped = np.concatenate([data[digests.CHUNK :], data[: digests.CHUNK]])
    assert digest(memoryview(swapped)) != digest(memoryview(data))


def test_the_bytes_count_not_their_shape_or_type() -> None:
    values = np.arange(12, dtype=np.float32)
    assert digest(memoryview(values.reshape(3, 4))) == digest(memoryview(values.tobytes()))
