"""Count the accelerators this machine offers, without importing torch or touching CUDA.

The parent uses this to check ``num_processes`` before any process starts. NVML (from the
``nvidia-ml-py`` package) reads the driver without creating a CUDA context; without it,
the driver's ``/proc`` entries are counted. ``CUDA_VISIBLE_DEVICES`` narrows either, and
``choose_gpus`` narrows them further to a launch's ``gpu_ids``.
TPU chips are found in sysfs and ``/dev``, never by importing torch_xla (which takes
seconds and writes into ``os.environ``).
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from nbaccel.config.field_values import gpu_id_list
from nbaccel.errors import ConfigError

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
    entries = visible_device_entries(env)
    if entries is not None:
        if not entries:
            return 0
        installed = _installed_gpu_count(proc_root)
        return min(len(entries), installed) if installed else 0
    return _installed_gpu_count(proc_root)


def visible_device_entries(env: Mapping[str, str]) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` in ``env`` that CUDA honours (it stops at the
    first invalid one), or None when the variable is unset (every GPU is visible).

    >>> visible_device_entries({"CUDA_VISIBLE_DEVICES": "3, GPU-8a1f,-1,2"})
    ['3', 'GPU-8a1f']
    """
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    entries = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry or entry.startswith("-"):
            break
        entries.append(entry)
    return entries


@dataclass(frozen=True)
class GpuChoice:
    """The GPUs of this machine that a launch's workers use.

    ``count``: how many (0: CPU processes, or none chosen on a CPU run); ``visible_devices``:
    the ``CUDA_VISIBLE_DEVICES`` each worker gets, or None to keep the launching process's.
    """

    count: int
    visible_devices: str | None = None

    def worker_env(self) -> dict[str, str]:
        """What the workers' environment gets on top of the launching process's."""
        if self.visible_devices is None:
            return {}
        return {"CUDA_VISIBLE_DEVICES": self.visible_devices}


def choose_gpus(
    gpu_ids: str, env: Mapping[str, str], *, visible: int | None, source: str = "argument"
) -> GpuChoice:
    """The GPUs the workers use: every visible one, or those ``gpu_ids`` names (``"0,2"``).

    ``visible``: the GPUs ``env`` leaves visible (``visible_gpu_count``), or None for a run of
    CPU processes, which counts none (the workers still see only the GPUs named). The indices
    count among the GPUs ``env`` leaves visible, as CUDA counts: with
    ``CUDA_VISIBLE_DEVICES=4,5,6`` in ``env``, ``gpu_ids="0,2"`` gives the workers ``4,6``.
    An index beyond the visible GPUs (where their number is known: counted, or from
    ``CUDA_VISIBLE_DEVICES``) raises ConfigError, naming ``source``, before anything starts.

    >>> choose_gpus("2,0", {}, visible=4)
    GpuChoice(count=2, visible_devices='2,0')
    >>> choose_gpus("1,0", {"CUDA_VISIBLE_DEVICES": "4,5,6"}, visible=None)
    GpuChoice(count=0, visible_devices='5,4')
    >>> choose_gpus("all", {}, visible=4)
    GpuChoice(count=4, visible_devices=None)
    """
    ids = gpu_id_list(gpu_ids)
    entries = visible_device_entries(env)
    shown = env.get("CUDA_VISIBLE_DEVICES", "unset")
    if visible is None:  # CPU processes: the GPUs were not counted
        if ids is None:
            return GpuChoice(0)
        known = len(entries) if entries is not None else None
    elif ids is None:
        return GpuChoice(visible)
    elif not visible:
        raise ConfigError(
            f"gpu_ids={gpu_ids!r} (from {source}) picks GPUs, but no GPU is visible here "
            f"(CUDA_VISIBLE_DEVICES={shown}). Set gpu_ids to 'all', or use_cpu=True to run "
            "CPU processes.",
            field="gpu_ids",
        )
    else:
        known = visible
    if known is not None and max(ids) >= known:
        numbered = f"indices 0-{known - 1}" if known else "none"
        among = f", counted among CUDA_VISIBLE_DEVICES={shown}" if entries is not None else ""
        fix = f"Use indices below {known}, or 'all'." if known else "Set gpu_ids to 'all'."
        raise ConfigError(
            f"gpu_ids={gpu_ids!r} (from {source}) names GPU {max(ids)}, but {known} GPU(s) "
            f"are visible here ({numbered}{among}). {fix}",
            field="gpu_ids",
        )
    chosen = [entries[i] if entries is not None else str(i) for i in ids]
    return GpuChoice(0 if visible is None else len(ids), ",".join(chosen))


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
