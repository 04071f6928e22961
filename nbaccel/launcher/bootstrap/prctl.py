"""Linux process controls that keep the worker tree tidy (no-ops on other systems)."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(option, value, 0, 0, 0) == 0)


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``signum`` to this process when its parent thread dies."""
    return _prctl(_PR_SET_PDEATHSIG, int(signum))


def set_child_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def flush_c_stdio() -> None:
    """Flush C-level stdio buffers (output of C/C++ code) before ``os._exit``."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
