"""Segments ask for huge pages where the machine's policy is "advise" (a rank reads them as
fast as a fork reads the kernel's arrays), and hold the same bytes whichever way they are
written."""

from __future__ import annotations

import mmap
import os
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


@pytest.mark.parametrize("mode", ["never", "advise", "within_size"])
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


def test_advised_writes_get_huge_pages_where_the_policy_allows() -> None:
    if shmem_huge_mode() not in ("advise", "within_size", "always"):
        pytest.skip(f"this machine's {segments.SHMEM_HUGE_SETTING} is {shmem_huge_mode()!r}")
    data = np.ones((8 << 20) // 4, dtype=np.float32)
    segment, _ = Segment.write([memoryview(data)])
    try:
        with mmap.mmap(segment.fd, segment.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
            np.frombuffer(m, dtype=np.float32).sum()  # map it: the pages show in smaps
            smaps = Path(f"/proc/{os.getpid()}/smaps_rollup").read_text()
        huge = [line.split()[1] for line in smaps.splitlines() if "ShmemPmdMapped" in line]
        assert int(huge[0]) >= 2048  # KiB mapped through huge pages
    finally:
        segment.close()
