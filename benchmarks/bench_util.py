"""Small helpers shared by the benchmark scripts (run as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def run_command(
    command: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command in its own session; on timeout kill its whole process group."""
    with subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
