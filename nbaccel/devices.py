"""Count the accelerators this machine offers, without importing torch or touching CUDA.

The parent uses this to check ``num_processes`` before any process starts. NVML (from the
``nvidia-ml-py`` package) reads the driver without creating a CUDA context; without it,
the driver's ``/proc`` entries are counted. ``CUDA_VISIBLE_DEVICES`` narrows either.
TPU chips are found in sysfs and ``/dev``, never by importing torch_xla (which takes
seconds and writes into ``os.environ``).
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

GOOGLE_PCI_VENDOR = "0x1ae0"
# Google's PCI device ids of TPU chips (those torch_xla and JAX check). Other Google devices,
# such as the gVNIC network card or NVMe disks of every GCE VM, are not TPUs.
TPU_PCI_DEVICES = {"0x0027": "v2/v3", "0x0056": "unnamed", "0x005e": "v4", "0x0062": "v5p"}
TPU_PCI_DEVICES |= {"0x0063": "v5e", "0x006f": "v6e", "0x0076": "v7x"}
# TPU generations whose chips hold two XLA devices (TensorCores torch_xla drives as threads).
TWO_CORE_GENERATIONS = frozenset({"v2/v3"})


@dataclass(frozen=True)
class TPUInfo:
    """TPU chips found on this machine, the evidence, and ``PJRT_DEVICE`` if set.

    ``generations`` names the TPU generations of the chips found on the PCI bus, in the
    order first seen (``("v5e",)``); it is empty when only ``/dev`` entries were found.

    >>> TPUInfo(4, ("/dev/accel0",), None).devices_per_chip
    2
    """

    chips: int
    evidence: tuple[str, ...]
    pjrt_device: str | None
    generations: tuple[str, ...] = ()

    @property
    def xla_device(self) -> str | None:
        """What torch_xla would use: ``PJRT_DEVICE`` when set, else TPU when chips exist."""
        if self.pjrt_device:
            return self.pjrt_device.upper()
        return "TPU" if self.chips else None

    @property
    def devices_per_chip(self) -> int:
        """XLA devices per chip: 2 on TPU v2/v3 (PCI id 0x0027, or only ``/dev/accelN``
        entries, as those generations show), 1 on v4 and later (and when there is no chip).
        """
        if self.generations:
            return 2 if set(self.generations) <= TWO_CORE_GENERATIONS else 1
        return 2 if self.evidence and self.evidence[0].startswith("/dev/accel") else 1


def detect_tpu(root: Path, env: Mapping[str, str]) -> TPUInfo:
    """Find TPU chips under ``root`` (normally ``/``) without importing torch_xla.

    Evidence, strongest first: Google TPU devices under ``sys/bus/pci/devices`` (PCI vendor
    0x1ae0), ``dev/accelN`` (TPU v2-v4), numeric ``dev/vfio/N`` entries (v5e and later).

    >>> info = detect_tpu(Path("/nonexistent"), {"PJRT_DEVICE": "TPU"})
    >>> info.chips, info.xla_device, info.generations
    (0, 'TPU', ())
    """
    pci, generations = [], []
    for vendor in sorted((root / "sys" / "bus" / "pci" / "devices").glob("*/vendor")):
        device = _read(vendor.parent / "device")
        if _read(vendor) == GOOGLE_PCI_VENDOR and device in TPU_PCI_DEVICES:
            generation = TPU_PCI_DEVICES[device]
            pci.append(f"PCI {vendor.parent.name} (TPU {generation}, id {device})")
            if generation not in generations:
                generations.append(generation)
    dev = root / "dev"
    accel = sorted(p.name for p in dev.glob("accel*") if p.name[5:].isdigit())
    vfio = sorted((p.name for p in (dev / "vfio").glob("*") if p.name.isdigit()), key=int)
    evidence = (*pci, *(f"/dev/{name}" for name in accel), *(f"/dev/vfio/{n}" for n in vfio))
    chips = len(pci) or len(accel) or len(vfio)
    return TPUInfo(chips, evidence, env.get("PJRT_DEVICE") or None, tuple(generations))


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


def _read(path: Path) -> str:
    try:
        return path.read_text().strip().lower()
    except OSError:
        return ""


@functools.cache  # read once per process: every worker of every launch asks
def loopback_interface() -> str | None:
    """The name of the network interface that holds 127.0.0.1 ("lo" on Linux, "lo0" on
    macOS), or None if there is none (psutil reads it; nothing is opened)."""
    import psutil  # only when asked: importing nbaccel stays light

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return None


def usable_cpu_cores() -> int:
    """Cores this process may run on (a container's CPU set, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1
