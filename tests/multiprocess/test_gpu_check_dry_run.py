"""``make test-gpu`` end to end on the CPU (``--dry-run``): every part runs (the step-rate
benchmark with a tiny GPT-2, one parity program under both frameworks, the cuda tests
collected and skipped) and one report holds what each gave. What the GPU run will do, short
of the GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(400)


def test_the_dry_run_writes_one_report_with_every_part(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=360,
    )  # fmt: skip
    report = (tmp_path / "gpu-report.md").read_text()
    assert done.returncode == 0, report + done.stderr[-2000:]
    for part in ("install", "env", "step-rate", "parity", "cuda-tests"):
        assert f"| {part} | ok |" in report
        assert (tmp_path / f"{part}.log").exists()
    assert "| nbaccel | " in report and "| accelerate | " in report  # the step-rate table
    assert "| gradient_accumulation | ran | ran | yes |" in report  # the parity table
    assert "skipped" in report.split("## cuda tests")[1]
    assert len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back from $OUT
