"""``nbaccel env``: versions, devices, backends and config files, for pasting into bug reports.

Nothing here imports torch or torch_xla: versions come from ``importlib.metadata``, GPUs
from NVML or ``/proc``, TPUs from sysfs and ``/dev`` (``import torch_xla`` takes seconds and
writes into ``os.environ``), and the backends are inferred from packages and devices.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import nbaccel
from nbaccel.config_files import accelerate_default_file, default_file, nbaccel_default_file
from nbaccel.devices import visible_gpu_count

PACKAGES: tuple[str, ...] = ("torch", "torch_xla", "accelerate", "cloudpickle", "psutil", "pyyaml")
PACKAGES += ("ipykernel", "ipywidgets", "nvidia-ml-py")
GOOGLE_PCI_VENDOR = "0x1ae0"
# Google's PCI device ids of TPU chips (those torch_xla and JAX check). Other Google devices,
# such as the gVNIC network card or NVMe disks of every GCE VM, are not TPUs.
TPU_PCI_DEVICES = {"0x0027": "v2/v3", "0x0056": "unnamed", "0x005e": "v4", "0x0062": "v5p"}
TPU_PCI_DEVICES |= {"0x0063": "v5e", "0x006f": "v6e"}
SHOWN_PREFIXES = ("NBACCEL_", "ACCELERATE_")
SHOWN_VARS = ("CUDA_VISIBLE_DEVICES", "PJRT_DEVICE")


@dataclass(frozen=True)
class TPUInfo:
    """TPU chips found on this machine, the evidence, and ``PJRT_DEVICE`` if set."""

    chips: int
    evidence: tuple[str, ...]
    pjrt_device: str | None

    @property
    def xla_device(self) -> str | None:
        """What torch_xla would use: ``PJRT_DEVICE`` when set, else TPU when chips exist."""
        if self.pjrt_device:
            return self.pjrt_device.upper()
        return "TPU" if self.chips else None


def detect_tpu(root: Path, env: Mapping[str, str]) -> TPUInfo:
    """Find TPU chips under ``root`` (normally ``/``) without importing torch_xla.

    Evidence, strongest first: Google TPU devices under ``sys/bus/pci/devices`` (PCI vendor
    0x1ae0), ``dev/accelN`` (TPU v2-v4), numeric ``dev/vfio/N`` entries (v5e and later).

    >>> info = detect_tpu(Path("/nonexistent"), {"PJRT_DEVICE": "TPU"})
    >>> info.chips, info.xla_device
    (0, 'TPU')
    """
    pci = []
    for vendor in sorted((root / "sys" / "bus" / "pci" / "devices").glob("*/vendor")):
        device = _read(vendor.parent / "device")
        if _read(vendor) == GOOGLE_PCI_VENDOR and device in TPU_PCI_DEVICES:
            pci.append(f"PCI {vendor.parent.name} (TPU {TPU_PCI_DEVICES[device]}, id {device})")
    dev = root / "dev"
    accel = sorted(p.name for p in dev.glob("accel*") if p.name[5:].isdigit())
    vfio = sorted((p.name for p in (dev / "vfio").glob("*") if p.name.isdigit()), key=int)
    evidence = (*pci, *(f"/dev/{name}" for name in accel), *(f"/dev/vfio/{n}" for n in vfio))
    chips = len(pci) or len(accel) or len(vfio)
    return TPUInfo(chips, evidence, env.get("PJRT_DEVICE") or None)


def collect_report(env: Mapping[str, str], root: Path = Path("/")) -> dict[str, Any]:
    """Everything ``nbaccel env`` shows, as JSON-ready data (torch is never imported).

    >>> report = collect_report({"HOME": "/nonexistent"}, root=Path("/nonexistent"))
    >>> sorted(report)  # doctest: +NORMALIZE_WHITESPACE
    ['backends', 'config_files', 'devices', 'environment', 'nbaccel', 'packages', 'python',
     'warnings']
    """
    packages = {name: _version(name) for name in PACKAGES}
    gpus = visible_gpu_count(env, proc_root=root / "proc")
    tpu = detect_tpu(root, env)
    torch, xla = packages["torch"], packages["torch_xla"]
    warnings = []
    if torch is None:
        warnings.append("torch is not installed: workers need it. Install it: pip install torch")
    if torch and xla and _major_minor(torch) != _major_minor(xla):
        warnings.append(
            f"torch {torch} and torch_xla {xla} differ in major.minor: `import torch_xla` "
            "will fail (undefined symbol). Install matching versions, e.g. "
            f"pip install 'torch=={_major_minor(xla)}.*'."
        )
    cpu_build = bool(torch and "+cpu" in torch)
    if gpus and cpu_build:
        warnings.append(
            f"{gpus} GPU(s) visible but torch {torch} is a CPU build: install a CUDA build "
            "of torch to use them."
        )
    backends = (["gloo"] if torch else []) + (["nccl"] if torch and gpus and not cpu_build else [])
    named = env.get("NBACCEL_CONFIG")
    return {
        "nbaccel": nbaccel.__version__,
        "python": {
            "version": platform.python_version(),
            "executable": sys.executable,
            "platform": platform.platform(),
        },
        "packages": packages,
        "devices": {
            "cuda_gpus_visible": gpus,
            "gpu_names": _gpu_names(),
            "tpu": {
                "chips": tpu.chips,
                "evidence": list(tpu.evidence),
                "PJRT_DEVICE": tpu.pjrt_device,
                "xla_device": tpu.xla_device,
            },
            "cpu": _cpu(),
        },
        "backends": backends + (["xla"] if xla else []),
        "config_files": {
            "nbaccel default": _file(nbaccel_default_file(env)),
            "Accelerate default": _file(accelerate_default_file(env)),
            "NBACCEL_CONFIG": _file(Path(named)) if named else {"path": None, "status": "not set"},
            "read by default": str(default_file(env) or "") or None,
        },
        "environment": {
            var: env[var]
            for var in sorted(env)
            if var.startswith(SHOWN_PREFIXES) or var in SHOWN_VARS
        },
        "warnings": warnings,
    }


def format_report(report: Mapping[str, Any]) -> str:
    """The report as text, one section per heading.

    >>> text = format_report(collect_report({}, root=Path("/nonexistent")))
    >>> [line for line in text.splitlines() if line and not line.startswith(" ")][1:]
    ['Packages', 'Devices', 'Backends', 'Config files', 'Environment', 'Warnings']
    """
    python, devices = report["python"], report["devices"]
    tpu, cpu, packages = devices["tpu"], devices["cpu"], report["packages"]
    lines = [
        f"nbaccel {report['nbaccel']}, Python {python['version']} ({python['executable']}) "
        f"on {python['platform']}",
        "Packages",
        *(f"  {name:<13} {version or 'not installed'}" for name, version in packages.items()),
        "Devices",
        f"  CUDA GPUs visible: {devices['cuda_gpus_visible']}",
        *(f"    {name}" for name in devices["gpu_names"]),
        f"  TPU chips: {tpu['chips']}"
        + (f" ({', '.join(tpu['evidence'])})" if tpu["chips"] else ""),
        f"  XLA device: {tpu['xla_device'] or 'none'}"
        + (f" (PJRT_DEVICE={tpu['PJRT_DEVICE']})" if tpu["PJRT_DEVICE"] else ""),
        f"  CPU: {cpu['logical']} logical, {cpu['physical']} physical, {cpu['usable']} usable; "
        f"memory {cpu['memory_total_gib']} GiB, {cpu['memory_available_gib']} GiB available",
        "Backends",
        f"  {', '.join(report['backends']) or 'none (torch is not installed)'}",
        "Config files",
    ]
    for label, entry in report["config_files"].items():
        if isinstance(entry, Mapping):
            where = f"{entry['path']} ({entry['status']})" if entry["path"] else entry["status"]
        else:
            where = entry or "none"
        lines.append(f"  {label + ':':<20} {where}")
    lines.append("Environment")
    lines += [f"  {var}={value}" for var, value in report["environment"].items()] or ["  none set"]
    lines.append("Warnings")
    lines += [f"  ! {warning}" for warning in report["warnings"]] or ["  none"]
    return "\n".join(lines)


def register(subparsers: Any) -> None:
    """Add the ``env`` command.

    >>> parser = argparse.ArgumentParser(prog="nbaccel")
    >>> register(parser.add_subparsers())
    >>> parser.parse_args(["env", "--json"]).json
    True
    """
    command = subparsers.add_parser(
        "env",
        help="versions, devices, backends and config files, for bug reports",
        description="Print nbaccel's view of this machine for bug reports: versions, "
        "devices (CUDA, TPU, CPU), usable backends, config files and NBACCEL_*/ACCELERATE_* "
        "variables. Never imports torch or torch_xla.",
    )
    command.add_argument("--json", action="store_true", help="print the report as JSON")
    command.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    report = collect_report(os.environ)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _major_minor(version: str) -> str:
    match = re.match(r"(\d+)\.(\d+)", version)
    return f"{match[1]}.{match[2]}" if match else version


def _read(path: Path) -> str:
    try:
        return path.read_text().strip().lower()
    except OSError:
        return ""


def _file(path: Path) -> dict[str, Any]:
    return {"path": str(path), "status": "exists" if path.is_file() else "missing"}


def _gpu_names() -> list[str]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no nvidia-ml-py or no driver: names are optional
        return []
    names: list[str] = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30
            name = name.decode() if isinstance(name, bytes) else name
            names.append(f"{index}: {name}, {total:.1f} GiB")
    except Exception:  # noqa: BLE001 - a driver error: report what was read
        pass
    finally:
        pynvml.nvmlShutdown()
    return names


def _cpu() -> dict[str, Any]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu: dict[str, Any] = {"logical": os.cpu_count(), "physical": None, "usable": usable}
    cpu.update(memory_total_gib=None, memory_available_gib=None)
    try:
        import psutil

        memory = psutil.virtual_memory()
        cpu["physical"] = psutil.cpu_count(logical=False)
        cpu["memory_total_gib"] = round(memory.total / 2**30, 1)
        cpu["memory_available_gib"] = round(memory.available / 2**30, 1)
    except ImportError:
        pass
    return cpu
