"""Count the accelerators this machine offers, without importing torch or touching CUDA.

The parent uses this to check ``num_processes`` before any process starts. NVML (from the
``nvidia-ml-py`` package) reads the driver without creating a CUDA context; without it,
the driver's ``/proc`` entries are counted. ``CUDA_VISIBLE_DEVICES`` narrows either.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def visible_gpu_count(env: Mapping[str, str], proc_root: Path = Path("/proc")) -> int:
    """GPUs that workers started with ``env`` would see.

    >>> visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""})
    0
    """
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",")]
        wanted = 0
        for entry in entries:  # CUDA stops at the first invalid entry, as do we
            if not entry or entry.startswith("-"):
                break
            wanted += 1
        if wanted == 0:
            return 0
        installed = _installed_gpu_count(proc_root)
        return min(wanted, installed) if installed else 0
    return _installed_gpu_count(proc_root)


def _installed_gpu_count(proc_root: Path) -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML, no driver, or no GPU: count /proc instead
        pass
    gpus = proc_root / "driver" / "nvidia" / "gpus"
    return sum(1 for _ in gpus.iterdir()) if gpus.is_dir() else 0
