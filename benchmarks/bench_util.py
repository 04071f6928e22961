"""Small helpers shared by the benchmark scripts (run as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


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


def start_driver(
    command: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: str | None = None
) -> subprocess.Popen[bytes]:
    """Start a driver process in its own session, its output (both streams) to ``log_path``."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_until(condition: Callable[[], bool], timeout: float, poll: float = 0.01) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` s pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return True


def become_subreaper() -> None:
    """Orphaned descendants (nbaccel's helper, stray workers) are re-parented here."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def sweep_descendants(grace: float) -> list[str]:
    """Wait ``grace`` s for every process under this one to end, kill the rest (and wait
    for them); returns what had to be killed."""
    import psutil

    _, running = psutil.wait_procs(psutil.Process().children(recursive=True), timeout=grace)
    killed = []
    for process in running:
        with contextlib.suppress(psutil.Error):
            killed.append(f"{process.pid} {' '.join(process.cmdline())[:80]}")
            process.kill()
    psutil.wait_procs(running, timeout=5.0)
    return killed


MAX_FAILURES = 3  # a driver gives up on a way after this many failed launches


def launch_folders(scratch: str, count: int) -> Iterator[str]:
    """One fresh output folder per launch, under ``scratch``."""
    return (os.path.join(scratch, f"launch{index}") for index in range(count))


def later_samples(
    measure: Callable[[str], dict[str, Any]],
    folders: Iterator[str],
    repeats: int,
    failed_before: int = 0,
) -> list[dict[str, Any]]:
    """Up to ``repeats`` launches measured by ``measure(folder)``, one folder each; stops
    once ``MAX_FAILURES`` samples (those with an "error", ``failed_before`` included) failed."""
    samples: list[dict[str, Any]] = []
    failures = failed_before
    for _ in range(repeats):
        if failures >= MAX_FAILURES:
            break
        sample = measure(next(folders))
        failures += "error" in sample
        samples.append(sample)
    return samples


# A cell's (or a script's) helper, defined untimed beside the function: a free port for
# Accelerate's use_port and torchrun.
FREE_PORT = (
    "def _free_port():\n"
    "    import socket\n"
    "    with socket.socket() as s:\n"
    "        s.bind(('127.0.0.1', 0))\n"
    "        return s.getsockname()[1]\n"
)
