"""Segments are held in huge pages and mapped at huge-page boundaries where the kernel allows
(a rank reads them as fast as a fork reads the kernel's arrays), and hold the same bytes
whichever way they are written."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest

from nbaccel.launcher.sharing import segments
from nbaccel.launcher.sharing.segments import Segment, map_private, shmem_huge_mode


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("always within_size advise [never] deny force\n", "never"),
        ("always within_size [advise] never deny force\n", "advise"),
        ("[always] within_size advise never\n", "always"),
        ("", "never"),
    ],
)
def test_the_policy_is_the_bracketed_word(tmp_path: Path, text: str, mode: str) -> None:
    setting = tmp_path / "shmem_enabled"
    setting.write_text(text)
    assert shmem_huge_mode(str(setting)) == mode


@pytest.mark.parametrize("mode", ["never", "advise", "within_size", "deny"])
def test_every_way_of_writing_holds_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    monkeypatch.setattr(segments, "shmem_huge_mode", lambda: mode)
    big = np.arange((3 << 20) // 8, dtype=np.float64)  # 3 MiB: past one huge page
    grid = np.arange(12, dtype=np.int32).reshape(3, 4)  # a 2-d buffer, not bytes
    small = memoryview(b"tail")
    segment, offsets = Segment.write([memoryview(big), memoryview(grid), small])
    try:
        view = map_private(segment.fd)
        assert bytes(view[offsets[0] : offsets[0] + big.nbytes]) == big.tobytes()
        assert bytes(view[offsets[1] : offsets[1] + grid.nbytes]) == grid.tobytes()
        assert bytes(view[offsets[2] : offsets[2] + 4]) == b"tail"
        assert offsets[1] % segments.PAGE == 0 and offsets[2] % segments.PAGE == 0
    finally:
        segment.close()


def _huge_kib_mapped_at(address: int) -> int:
    """KiB mapped through huge pages in this process's mapping that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header: "start-end perms ..."
            low, high = (int(part, 16) for part in first.split("-"))
            inside = low <= address < high
        elif inside and first == "ShmemPmdMapped:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _kernel_collapses() -> bool:
    major, minor = (int(part) for part in platform.release().split(".")[:2])
    return (major, minor) >= (6, 1)


def test_segments_are_held_and_mapped_in_huge_pages_where_the_kernel_allows() -> None:
    mode = shmem_huge_mode()
    if mode == "deny" or (mode == "never" and not _kernel_collapses()):
        pytest.skip(f"{segments.SHMEM_HUGE_SETTING} is {mode!r} on Linux {platform.release()}")
    data = np.ones((8 << 20) // 4 + 3, dtype=np.float32)  # 4 huge pages and a tail
    segment, _ = Segment.write([memoryview(data)])
    try:
        view = map_private(segment.fd)  # as a rank maps it
        assert segments.buffer_address(view) % segments.HUGE_PAGE == 0
        assert np.frombuffer(view, dtype=np.float32, count=data.size).sum() == data.size
        assert _huge_kib_mapped_at(segments.buffer_address(view)) == 8 << 10
    finally:
        segment.close()


def test_a_rank_s_write_into_a_huge_page_stays_its_own() -> None:
    data = np.zeros((4 << 20) // 8, dtype=np.float64)
    segment, _ = Segment.write([memoryview(data)])
    try:
        mine = np.frombuffer(map_private(segment.fd), dtype=np.float64)
        mine[1000] = 7.0  # copies one page for this mapping, whatever held it
        assert np.frombuffer(map_private(segment.fd), dtype=np.float64)[1000] == 0.0
        assert mine.sum() == 7.0
    finally:
        segment.close()
