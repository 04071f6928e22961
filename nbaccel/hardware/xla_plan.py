"""Whether a launch goes through torch_xla, and how: decided in the parent, before any process.

Stdlib only: torch_xla is never imported here (``import torch_xla`` takes seconds and writes
into ``os.environ``). The plan travels to the workers inside the launch request. Every
``ConfigError`` raised here says what happened, why, and the fix.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from nbaccel.config.schema import Config
from nbaccel.errors import ConfigError
from nbaccel.hardware.devices import TPUInfo

MIN_TORCH_XLA = (2, 8)
VersionOf = Callable[[str], "str | None"]


@dataclass(frozen=True)
class XlaPlan:
    """How torch_xla runs a launch on this machine.

    Data parallel: torch_xla starts ``num_processes`` processes (``nprocs=None``: all local
    chips) or one process on one chip (``nprocs=1``, see ``spawn_nprocs``), each running
    ``devices_per_process`` threads. SPMD: one process drives every device; run it
    directly, not through ``spawn(nprocs=1)``, which would narrow it to one chip.

    >>> plan = XlaPlan(device="TPU", num_processes=8, devices_per_process=1, spmd=False)
    >>> plan.world_size
    8
    """

    device: str  # the PJRT device torch_xla uses: "TPU" or "CPU"
    num_processes: int  # processes torch_xla starts (1 for SPMD)
    devices_per_process: int  # threads per process: TPU v2/v3 2, the CPU device CPU_NUM_DEVICES
    spmd: bool = False  # FSDPv2: one process drives every device through the `fsdp` mesh axis
    start_method: str = "spawn"  # how torch_xla starts its processes: "spawn" or "fork"

    @property
    def world_size(self) -> int:
        """Ranks nbaccel reports (one per device; 1 under SPMD, where one process drives all)."""
        return 1 if self.spmd else self.num_processes * self.devices_per_process

    @property
    def spawn_nprocs(self) -> int | None:
        """``nprocs`` for torch_xla's ``spawn``: 1 for one device, None for all local devices.

        >>> XlaPlan("TPU", 1, 1).spawn_nprocs, XlaPlan("TPU", 4, 2).spawn_nprocs
        (1, None)
        """
        return 1 if self.num_processes * self.devices_per_process == 1 else None

    def describe(self) -> str:
        """One line for people.

        >>> XlaPlan("TPU", 4, 2).describe()
        '4 processes × 2 devices on TPU (spawn)'
        >>> XlaPlan("CPU", 1, 4, spmd=True).describe()
        '1 process × 4 devices on CPU (SPMD, spawn)'
        """
        processes = _plural(self.num_processes, "process", "processes")
        devices = _plural(self.devices_per_process, "device", "devices")
        mode = "SPMD, " if self.spmd else ""
        return f"{processes} × {devices} on {self.device} ({mode}{self.start_method})"


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None (read from metadata, not imported).

    >>> installed_version("surely-not-an-installed-distribution") is None
    True
    """
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def uses_xla(config: Config, tpu: TPUInfo) -> bool:
    """Whether a launch with ``config`` goes through torch_xla on this machine.

    ``strategy='xla'`` always does; ``use_cpu`` never; ``auto`` and ``fsdp`` do when TPU chips
    were found or ``PJRT_DEVICE`` is TPU or CPU (``PJRT_DEVICE=CPU`` runs torch_xla on the
    CPU); ``ddp`` and ``deepspeed`` never do. Another PJRT device (CUDA, which torch_xla
    writes into ``os.environ`` when imported on a GPU machine) leaves GPU launches as they are.

    >>> tpu = TPUInfo(chips=1, evidence=("/dev/vfio/0",), pjrt_device=None)
    >>> uses_xla(Config(), tpu), uses_xla(Config(strategy="ddp"), tpu)
    (True, False)
    >>> uses_xla(Config(), TPUInfo(chips=0, evidence=(), pjrt_device="CUDA"))
    False
    """
    if config.strategy == "xla":
        return True
    if config.use_cpu or config.strategy not in ("auto", "fsdp"):
        return False
    asked = (tpu.pjrt_device or "").strip().upper().split("_")[0]
    return bool(tpu.chips) or asked in ("TPU", "CPU")


def check_versions(version_of: VersionOf = installed_version) -> str | None:
    """Why torch_xla cannot be imported with the installed torch, with the fix; None when fine.

    Versions come from package metadata: nothing is imported.

    >>> versions = {"torch": "2.13.0", "torch_xla": "2.9.0"}
    >>> print(check_versions(versions.get))  # doctest: +ELLIPSIS
    torch 2.13.0 and torch_xla 2.9.0 differ in major.minor: ... pip install 'torch==2.9.*' ...
    >>> check_versions({"torch": "2.9.0+cpu", "torch_xla": "2.9.0"}.get) is None
    True
    """
    xla, torch = version_of("torch_xla"), version_of("torch")
    if xla is None:
        return (
            "This launch needs torch_xla (launches on TPUs, with PJRT_DEVICE set or with "
            "strategy='xla' go through it), which is not installed. On Colab and Kaggle TPU "
            "runtimes it is preinstalled: choose a TPU runtime. Elsewhere install it with a "
            "torch of the same major.minor: pip install 'nbaccel[xla]' (torch_xla >= 2.8)."
        )
    xla_mm = _major_minor(xla)
    if xla_mm is None or xla_mm < MIN_TORCH_XLA:
        return (
            f"torch_xla {xla} is too old: nbaccel supports torch_xla >= 2.8 (its launch and "
            "device APIs changed before). Upgrade torch and torch_xla together, e.g. "
            "pip install 'torch==2.9.*' 'torch_xla[tpu]==2.9.*'."
        )
    wanted = f"{xla_mm[0]}.{xla_mm[1]}"
    if torch is None:
        return (
            f"torch_xla {xla} is installed but torch is not. Install the matching torch: "
            f"pip install 'torch=={wanted}.*'."
        )
    if _major_minor(torch) != xla_mm:
        return (
            f"torch {torch} and torch_xla {xla} differ in major.minor: torch_xla is built "
            f"against torch {wanted} only, and `import torch_xla` would fail in every worker "
            "with `undefined symbol: ...`. Install the matching torch: "
            f"pip install 'torch=={wanted}.*' (its CPU build is enough on TPUs: add "
            "--index-url https://download.pytorch.org/whl/cpu), or a torch_xla built for "
            f"torch {torch}."
        )
    return None


def plan_xla(
    config: Config,
    tpu: TPUInfo,
    env: Mapping[str, str],
    *,
    version_of: VersionOf = installed_version,
    modules: Mapping[str, Any] = sys.modules,
) -> XlaPlan:
    """How torch_xla runs ``config`` on this machine, or a ``ConfigError`` with the fix.

    Checks, in order: torch_xla installed and matching torch; the XLA runtime not already
    started in this process; the PJRT device; the topology against ``num_processes``;
    precision and machine count. ``modules`` is only read (torch_xla is never imported).

    >>> versions = {"torch": "2.9.0+cpu", "torch_xla": "2.9.0"}.get
    >>> v5e_8 = TPUInfo(8, (), None, ("v5e",))
    >>> plan_xla(Config(), v5e_8, {}, version_of=versions).describe()
    '8 processes × 1 device on TPU (spawn)'
    >>> plan_xla(Config(num_processes=2), v5e_8, {}, version_of=versions)
    Traceback (most recent call last):
    ...
    nbaccel.errors.ConfigError: num_processes=2, but this TPU v5e machine has 8 chips: ...
    """
    problem = check_versions(version_of)
    if problem is not None:
        raise ConfigError(problem)
    if _runtime_initialized(modules):
        raise ConfigError(
            "The XLA runtime is already initialised in this kernel: a cell used the XLA "
            "device (torch_xla.device(), a tensor moved to 'xla', xr.world_size(), ...) "
            "before launching, and torch_xla cannot start workers after that. Restart the "
            "kernel and launch before touching the XLA device in the notebook (`import "
            "torch_xla` alone is fine)."
        )
    device = _device(tpu, env)
    spmd = config.strategy == "fsdp"
    if device == "TPU":
        per_process = tpu.devices_per_chip
        available = tpu.chips
        where = f"this {_tpu_name(tpu)} machine has {_plural(tpu.chips, 'chip', 'chips')}"
        if per_process > 1:
            where += f" of {per_process} devices each"
    else:
        per_process, available = _cpu_devices(env), 1
        where = f"the XLA CPU device has {_plural(per_process, 'device', 'devices')}"
        where += f" (CPU_NUM_DEVICES={per_process})"
    total = available * per_process
    plan = _topology(config.num_processes, device, available, per_process, spmd, where, total)
    if config.mixed_precision == "fp16" and device == "TPU":
        raise ConfigError(
            "mixed_precision='fp16' does not run on TPUs: they compute in bfloat16 and have "
            "no fp16 loss scaling. Use mixed_precision='bf16'.",
            field="mixed_precision",
        )
    if config.num_machines > 1:
        raise ConfigError(
            f"num_machines={config.num_machines} with XLA: launches across several TPU "
            "hosts (multi-host TPU pods) are not supported by nbaccel yet. Use "
            "num_machines=1 (the chips of this host), or launch on the pod with torch_xla's "
            "own tools.",
            field="num_machines",
        )
    return XlaPlan(
        device=device,
        num_processes=plan[0],
        devices_per_process=plan[1],
        spmd=spmd,
        start_method=config.xla_start_method,
    )


def xla_worker_env(plan: XlaPlan) -> dict[str, str]:
    """Variables the workers need before torch_xla is imported there.

    >>> xla_worker_env(XlaPlan("CPU", 1, 4))
    {'PJRT_DEVICE': 'CPU', 'CPU_NUM_DEVICES': '4'}
    >>> xla_worker_env(XlaPlan("TPU", 8, 1))
    {'PJRT_DEVICE': 'TPU'}
    """
    env = {"PJRT_DEVICE": plan.device}
    if plan.device == "CPU":
        env["CPU_NUM_DEVICES"] = str(plan.devices_per_process)
    return env


_BUSY = (
    "Another process holds the TPU chip, and a chip serves one process at a time: another "
    "notebook or kernel using the TPU, or workers of an earlier run still alive. Find it "
    "with `lsof -w /dev/vfio/* /dev/accel*` (then stop it by its PID), or restart the "
    "runtime (Colab: Runtime > Restart session), then launch again."
)
_FAILURES: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"open\(/dev/vfio/\d+\): Device or resource busy", re.IGNORECASE),
        "The TPU is busy (TPU v5e and later). " + _BUSY,
    ),
    (
        re.compile(r"open\(/dev/accel\d+\): Operation not permitted", re.IGNORECASE),
        "The TPU is busy (TPU v2-v4). " + _BUSY,
    ),
    (
        re.compile(r"max_workers must be greater than 0", re.IGNORECASE),
        "torch_xla found no TPU chip to start a worker on: PJRT_DEVICE=TPU but this machine "
        "has no TPU. Choose a TPU runtime (Colab: Runtime > Change runtime type; Kaggle: "
        "Accelerator: TPU), or unset PJRT_DEVICE, or set PJRT_DEVICE=CPU to try on the CPU.",
    ),
    (
        re.compile(r"Runtime is already initialized", re.IGNORECASE),
        "The XLA runtime was already initialised in the process that starts the workers: "
        "something used the XLA device (torch_xla.device(), a tensor moved to 'xla', ...) "
        "before the launch, and torch_xla cannot start workers after that. Restart the "
        "kernel and launch before touching the XLA device (`import torch_xla` alone is fine).",
    ),
)


def explain_xla_failure(text: str) -> str | None:
    """A clear explanation, with the fix, of known torch_xla/PJRT error text; else None.

    >>> print(explain_xla_failure("RuntimeError: open(/dev/vfio/3): Device or resource busy"))
    ... # doctest: +ELLIPSIS
    The TPU is busy (TPU v5e and later). Another process holds the TPU chip, ...
    >>> explain_xla_failure("ZeroDivisionError: division by zero") is None
    True
    """
    for pattern, explanation in _FAILURES:
        if pattern.search(text):
            return explanation
    return None


def _runtime_initialized(modules: Mapping[str, Any]) -> bool:
    """Ask an already imported torch_xla, as its own ``run_multiprocess`` does."""
    module = modules.get("torch_xla")
    if module is None:
        return False
    try:
        check = module._XLAC._xla_runtime_is_initialized
    except AttributeError:  # a partly imported torch_xla: its runtime cannot have started
        return False
    return bool(check())


def _device(tpu: TPUInfo, env: Mapping[str, str]) -> str:
    """The PJRT device: ``PJRT_DEVICE`` (upper-cased; "TPU_C_API" counts as TPU) or TPU."""
    asked = (env.get("PJRT_DEVICE") or "").strip().upper().split("_")[0]
    device = asked or ("TPU" if tpu.chips else "")
    if not device:
        raise ConfigError(
            "strategy='xla' asks for torch_xla, but this machine has no TPU and PJRT_DEVICE "
            "is not set. Choose a TPU runtime (Colab: Runtime > Change runtime type; Kaggle: "
            "Accelerator: TPU), set PJRT_DEVICE=CPU to try torch_xla on the CPU, or use "
            "strategy='auto'.",
            field="strategy",
        )
    if device == "TPU" and not tpu.chips:
        raise ConfigError(
            "PJRT_DEVICE=TPU, but there is no TPU on this machine (no Google TPU on the PCI "
            "bus, no /dev/accel* or /dev/vfio/* entries): torch_xla would fail with "
            "'max_workers must be greater than 0'. Choose a TPU runtime (Colab: Runtime > "
            "Change runtime type; Kaggle: Accelerator: TPU), or unset PJRT_DEVICE, or set "
            "PJRT_DEVICE=CPU to try torch_xla on the CPU."
        )
    if device not in ("TPU", "CPU"):
        raise ConfigError(
            f"PJRT_DEVICE={env.get('PJRT_DEVICE')}: nbaccel runs torch_xla on TPUs and on the "
            "CPU only. For GPUs use strategy='ddp' or 'fsdp' (NCCL) and unset PJRT_DEVICE; "
            "to try torch_xla on the CPU set PJRT_DEVICE=CPU."
        )
    return device


def _cpu_devices(env: Mapping[str, str]) -> int:
    text = env.get("CPU_NUM_DEVICES", "").strip() or "1"
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError(
            f"CPU_NUM_DEVICES={env.get('CPU_NUM_DEVICES')!r} is not a positive whole number: "
            "it sets how many XLA devices torch_xla's CPU device offers. Set it to 1 or more "
            "(e.g. CPU_NUM_DEVICES=4), or unset it for 1."
        )
    return count


def _topology(
    asked: int | None,
    device: str,
    available: int,
    per_process: int,
    spmd: bool,
    where: str,
    total: int,
) -> tuple[int, int]:
    """(processes, devices per process) for ``num_processes=asked``, or a ConfigError."""
    if spmd:
        if asked in (None, 1):
            return 1, total
        raise ConfigError(
            f"num_processes={asked} with strategy='fsdp' on XLA: SPMD (FSDPv2) runs one "
            f"process that drives every device ({where}, {total} in all). Use "
            "num_processes=1 or leave it unset, or strategy='xla' for data parallel.",
            field="num_processes",
        )
    if asked is None or asked == total:
        return (available, per_process) if device == "TPU" else (1, per_process)
    if asked == 1:
        return 1, 1
    one = "one chip" if device == "TPU" else "one device"
    offer = f"{total} (all) or 1 ({one})" if total > 1 else "only 1"
    raise ConfigError(
        f"num_processes={asked}, but {where}: num_processes can be {offer}. torch_xla "
        "runs either a single device or every local one (its spawn accepts nprocs=1 or "
        "None). Use one of those, or leave num_processes unset for all.",
        field="num_processes",
    )


def _tpu_name(tpu: TPUInfo) -> str:
    named = [g for g in tpu.generations if g != "unnamed"]
    if named:
        return "TPU " + "/".join(named)
    if tpu.evidence and tpu.evidence[0].startswith("/dev/accel"):
        return "TPU (v2/v3 by its /dev/accel* entries)"
    return "TPU"


def _major_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def _plural(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"
