"""The README's main job: `nbaccel demo` trains on 2 CPU processes and prints rank 0's result."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(180)
def test_demo_trains_and_prints_rank0_progress_and_result(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nbaccel.cli", "demo", "--epochs", "2"],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "epoch 1/2 loss" in out and "epoch 2/2 loss" in out
    assert "32/32" in out  # rank 0's progress bar, finished
    assert "[rank 1]" not in out  # other ranks are not shown by default
    assert "rank 0 returned: {'world_size': 2, 'steps': 64" in out
    summary = eval(out.split("rank 0 returned: ")[1].strip())
    assert summary["final_loss"] < summary["first_loss"] / 10
    assert len(list((tmp_path / "nbaccel_runs").glob("*/config.json"))) == 1  # one run
