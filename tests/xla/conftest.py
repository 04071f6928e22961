"""The Accelerator on torch_xla's CPU device (``PJRT_DEVICE=CPU``), in the XLA environment.

Skipped where torch_xla cannot be imported (the main environment; a torch_xla built for
another torch). The check reads package metadata instead of importing torch_xla: the import
takes seconds and writes ``PJRT_DEVICE`` into this process's environment, which would turn
every later Accelerator in the session into an XLA one. Each scenario runs in a fresh
interpreter, because the XLA runtime and SPMD mode are per-process state.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from nbaccel.hardware.xla_plan import check_versions


def _why_not_importable() -> str | None:
    if importlib.util.find_spec("torch_xla") is None:
        return "torch_xla is not installed (run with the XLA environment, .venv-xla)"
    return check_versions()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _why_not_importable()
    if reason is None:
        return
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.skip(reason=reason))


def run_scenario(code: str, cwd: Path, *, devices: int = 1, timeout: float = 180) -> Any:
    """Run ``code`` in a fresh interpreter on ``devices`` CPU XLA devices; returns the JSON
    value its last stdout line holds."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"  # XLA's C++ warnings would bury a failure's trace
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, (
        f"scenario exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n"
        f"--- stderr\n{done.stderr[-6000:]}"
    )
    return json.loads(lines[-1])
