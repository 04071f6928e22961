"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest


@pytest.fixture
def nothing_started(tmp_path: Path) -> Iterator[Path]:
    """Yields a runs_dir; afterwards asserts it, and any new process or fd, never appeared."""
    me = psutil.Process()
    children, fds = {p.pid for p in me.children(recursive=True)}, me.num_fds()
    runs = tmp_path / "runs"
    yield runs
    assert not runs.exists()
    assert {p.pid for p in me.children(recursive=True)} <= children
    assert me.num_fds() == fds
