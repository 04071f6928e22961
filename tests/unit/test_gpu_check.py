"""``make test-gpu``'s plumbing (benchmarks/gpu_check.py), without a GPU: a part over its time
limit is stopped with everything it started and the next part still runs; the report says
what each part did, also from the log of a pytest that was killed midway."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state  # ended, not yet reaped by whoever adopted it


def test_a_part_over_its_limit_is_killed_with_its_children(
    gpu_check: ModuleType, tmp_path: Path
) -> None:
    pid_file = tmp_path / "grandchild.pid"
    spawner = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(120)\n"
    )
    slow = gpu_check.Part("slow", [sys.executable, "-c", spawner], limit=3)
    failing = gpu_check.Part("failing", [sys.executable, "-c", "raise SystemExit(3)"], limit=30)
    started = time.monotonic()
    outcomes = [gpu_check.run_part(p, tmp_path, dict(os.environ)) for p in (slow, failing)]
    assert time.monotonic() - started < 60  # 3 s, the group's end and a start: 5x headroom
    assert outcomes[0].status.startswith("timed out after")
    assert outcomes[1].status == "exit 3"  # the next part ran
    assert "killed: over its limit of 3 s" in (tmp_path / "slow.log").read_text()
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the process table: a kill lands asynchronously
    assert gone(grandchild)


def test_a_command_that_cannot_start_is_reported_not_raised(
    gpu_check: ModuleType, tmp_path: Path
) -> None:
    part = gpu_check.Part("missing", [str(tmp_path / "no-such-program")], limit=5)
    outcome = gpu_check.run_part(part, tmp_path, dict(os.environ))
    assert outcome.status.startswith("not run:")


def test_the_test_summary_counts_a_killed_pytests_lines(gpu_check: ModuleType) -> None:
    log = (
        "tests/a.py::test_one PASSED [ 10%]\n"
        "tests/a.py::test_two[x] FAILED [ 20%]\n"
        "tests/b.py::test_three SKIPPED (needs 2 GPUs) [ 30%]\n"
        "tests/d.py::test_slow PASSED [ 40%]\n"
        "\n== killed: over its limit of 250 s\n"
    )
    lines = gpu_check.summarize_tests(log)
    assert lines[0] == "1 failed, 2 passed, 1 skipped"
    assert "- FAILED: `tests/a.py::test_two[x]`" in lines
    assert not any(line.startswith("pytest:") for line in lines)  # it never got that far
    finished = log + "==== 2 passed, 1 failed, 1 skipped in 12.50s ====\n"
    assert "pytest: 2 passed, 1 failed, 1 skipped in 12.50s" in gpu_check.summarize_tests(finished)


def test_the_report_names_every_part_and_the_unrun_multi_gpu_paths(
    gpu_check: ModuleType, tmp_path: Path
) -> None:
    (tmp_path / "env.log").write_text('ENV {"gpus": 1, "gpu 0": "NVIDIA H100 80GB HBM3"}\n')
    outcomes = [gpu_check.Outcome("env", "ok", 2.0), gpu_check.Outcome("parity", "exit 1", 9.0)]
    text = gpu_check.report(outcomes, tmp_path, tmp_path, dry_run=False)
    assert "- gpu 0: NVIDIA H100 80GB HBM3" in text
    assert "| parity | exit 1 | 9 |" in text
    assert "No figures: see step-rate.log." in text
    assert "one GPU" in text and "FSDP2 sharding across GPUs" in text


def test_only_files_with_cuda_tests_are_collected_deepspeed_last(gpu_check: ModuleType) -> None:
    files = gpu_check.cuda_test_files()
    assert "tests/multiprocess/test_cuda.py" in files
    assert "tests/unit/accel/tracking/test_step_timing_cuda_peaks.py" in files
    assert "tests/multiprocess/test_launch.py" not in files
    assert files[-1] == "tests/multiprocess/test_deepspeed_cuda.py"


def test_the_limits_fit_eight_minutes(gpu_check: ModuleType) -> None:
    assert sum(gpu_check.LIMITS.values()) <= 8 * 60 - 10  # Python's start and the report
