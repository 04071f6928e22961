"""``nbaccel env``: versions, devices, backends and config files, for pasting into bug reports.

Nothing here imports torch or torch_xla: versions come from ``importlib.metadata``, GPUs
from NVML or ``/proc``, TPUs from sysfs and ``/dev`` (``import torch_xla`` takes seconds and
writes into ``os.environ``), and the backends are inferred from packages and devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import nbaccel
from nbaccel.config.files import accelerate_default_file, default_file, nbaccel_default_file
from nbaccel.config.schema import Config, usable_cpu_cores
from nbaccel.env_names import CONFIG_FILE_VAR
from nbaccel.errors import ConfigError
from nbaccel.hardware.devices import TPUInfo, detect_tpu, visible_gpu_count
from nbaccel.hardware.xla_plan import check_versions, plan_xla, uses_xla

PACKAGES: tuple[str, ...] = ("torch", "torch_xla", "accelerate", "cloudpickle", "psutil", "pyyaml")
PACKAGES += ("ipykernel", "ipywidgets", "nvidia-ml-py")
SHOWN_PREFIXES = ("NBACCEL_", "ACCELERATE_")
SHOWN_VARS = ("CUDA_VISIBLE_DEVICES", "PJRT_DEVICE")


def collect_report(env: Mapping[str, str], root: Path = Path("/")) -> dict[str, Any]:
    """Everything ``nbaccel env`` shows, as JSON-ready data (torch is never imported).

    >>> report = collect_report({"HOME": "/nonexistent"}, root=Path("/nonexistent"))
    >>> sorted(report)  # doctest: +NORMALIZE_WHITESPACE
    ['backends', 'config_files', 'devices', 'environment', 'nbaccel', 'packages', 'python',
     'warnings', 'xla']
    """
    packages = {name: _version(name) for name in PACKAGES}
    gpus = visible_gpu_count(env, proc_root=root / "proc")
    tpu = detect_tpu(root, env)
    torch, xla = packages["torch"], packages["torch_xla"]
    warnings = []
    if torch is None:
        warnings.append("torch is not installed: workers need it. Install it: pip install torch")
    xla_report = _xla(tpu, env, packages)
    if xla and xla_report["version_check"] != "ok":
        warnings.append(xla_report["version_check"])
    if xla_report["error"] and xla_report["error"] not in warnings:
        warnings.append(xla_report["error"])
    cpu_build = bool(torch and "+cpu" in torch)
    if gpus and cpu_build:
        warnings.append(
            f"{gpus} GPU(s) visible but torch {torch} is a CPU build: install a CUDA build "
            "of torch to use them."
        )
    backends = (["gloo"] if torch else []) + (["nccl"] if torch and gpus and not cpu_build else [])
    named = env.get(CONFIG_FILE_VAR)
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
            CONFIG_FILE_VAR: _file(Path(named)) if named else {"path": None, "status": "not set"},
            "read by default": str(default_file(env) or "") or None,
        },
        "environment": {
            var: env[var]
            for var in sorted(env)
            if var.startswith(SHOWN_PREFIXES) or var in SHOWN_VARS
        },
        "xla": xla_report,
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
        _xla_line(report["xla"]),
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


def _xla(tpu: TPUInfo, env: Mapping[str, str], packages: Mapping[str, Any]) -> dict[str, Any]:
    """Whether a launch with the schema's default config goes through torch_xla, and how."""
    config = Config()
    report: dict[str, Any] = {"used": uses_xla(config, tpu), "plan": None, "error": None}
    report["version_check"] = (
        (check_versions(packages.get) or "ok") if packages["torch_xla"] else "not installed"
    )
    if report["used"]:
        try:
            plan = plan_xla(config, tpu, env, version_of=packages.get)
        except ConfigError as error:
            report["error"] = str(error)
        else:
            report["plan"] = {
                **dataclasses.asdict(plan),
                "world_size": plan.world_size,
                "summary": plan.describe(),
            }
    return report


def _xla_line(xla: Mapping[str, Any]) -> str:
    if xla["plan"]:
        return f"  XLA launch: {xla['plan']['summary']}"
    if xla["error"]:
        return "  XLA launch: not possible (see Warnings)"
    return "  XLA launch: not used (no TPU found, PJRT_DEVICE not set)"


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
    cpu: dict[str, Any] = {
        "logical": os.cpu_count(),
        "physical": None,
        "usable": usable_cpu_cores(),
    }
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
