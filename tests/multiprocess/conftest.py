"""Real 2-process CPU/gloo launches through nbaccel itself."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from nbaccel.launcher.local.helper import shutdown_shared_helper


@pytest.fixture
def runs_dir(tmp_path: Path) -> str:
    return str(tmp_path / "runs")


@pytest.fixture(scope="session", autouse=True)
def _stop_helper_at_the_end() -> Iterator[None]:
    yield
    shutdown_shared_helper()


def run_script(code: str, tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as ``python -`` (functions in it live in ``__main__``, as in a notebook)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-"],
        input=textwrap.dedent(code),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
        env=env,
    )
