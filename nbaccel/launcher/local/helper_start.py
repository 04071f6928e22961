"""How the kernel gets a helper process: started from a clean interpreter (``start``), or
adopted, when an old helper's base became its successor (``Adopted``: not our child).

The helper is started with ``subprocess``, never forked from the kernel, so it inherits no
CUDA context, thread or socket of the kernel's; in its own session, so the kernel's
interrupts do not reach it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from nbaccel.launcher import control


class Adopted:
    """The process of a successor helper: the old helper forked it, so it is not our child
    and is waited for by polling (psutil), with ``subprocess.Popen``'s names."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def wait(self, timeout: float | None = None) -> int | None:
        import psutil

        try:
            return psutil.Process(self.pid).wait(timeout)
        except psutil.NoSuchProcess:
            return None
        except psutil.TimeoutExpired:
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0) from None

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(env: Mapping[str, str]) -> tuple[socket.socket, subprocess.Popen[bytes]]:
    """Start a helper process with ``env``: our end of its socket, and the process."""
    ours, helper_end = control.socket_pair()
    package_root = str(Path(__file__).resolve().parents[3])  # above nbaccel/launcher/local
    helper_env = dict(env)
    # The helper must never create a CUDA context: a forked worker could not use CUDA.
    helper_env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    helper_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, env.get("PYTHONPATH", "")) if p
    )
    # No parent-death signal for the helper: the kernel may start it from a short-lived
    # thread (the prewarm), and PR_SET_PDEATHSIG fires when that *thread* ends. The helper
    # watches the kernel's pid and its socket instead.
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nbaccel.launcher.local.helper_main",
                str(helper_end.fileno()),
                str(os.getpid()),
            ],
            pass_fds=[helper_end.fileno()],
            env=helper_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # the kernel's interrupt must not reach it
        )
    except BaseException:
        ours.close()
        raise
    finally:
        helper_end.close()
    return ours, process
