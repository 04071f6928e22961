"""How the kernel gets a helper process: started from a clean interpreter (``start``), or
adopted, when an old helper's base became its successor (``Adopted``: not our child).

The helper is started with ``subprocess``, never forked from the kernel, so it inherits no
CUDA context, thread or socket of the kernel's; in its own session, so the kernel's
interrupts do not reach it.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping
from pathlib import Path

from nbaccel.launcher import control

ARROW_JEMALLOC_VAR = "JE_ARROW_MALLOC_CONF"  # pyarrow's bundled jemalloc reads its options here


class Adopted:
    """The process of a successor helper, with ``subprocess.Popen``'s names: the old helper
    forked it, so it is not our child. Watched through a pidfd, taken while it runs (its
    pid may be reused once it is gone); where there is none, by polling its pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd: int | None = None
        self._gone = False
        try:
            self._pidfd = os.pidfd_open(pid)
            weakref.finalize(self, os.close, self._pidfd)  # waited for by two threads: kept
        except ProcessLookupError:
            self._gone = True
        except (AttributeError, OSError):
            pass  # no pidfd here: poll

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait until it has exited; its exit code is its parent's to read (None)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._gone:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._pidfd is not None:
                self._gone = bool(select.select([self._pidfd], [], [], left)[0])
            else:
                self._gone = not _exists(self.pid)
                if not self._gone and left != 0.0:
                    time.sleep(min(0.01, left or 0.01))  # polling: no pidfd to wait on
            if not self._gone and left == 0.0:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
        return None

    def kill(self) -> None:
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            elif not self._gone:
                os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


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
    # pyarrow's jemalloc starts a background thread when it loads, which makes a process
    # unsafe to fork from: pyarrow, and pandas and datasets that import it, could never be
    # preloaded, and every launch of a notebook that uses them paid their imports (0.3-1 s
    # a worker). Without that thread jemalloc purges freed pages as it allocates instead
    # (the workers, forked from the helper, inherit this). A value the user set is kept.
    helper_env.setdefault(ARROW_JEMALLOC_VAR, "background_thread:false")
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
