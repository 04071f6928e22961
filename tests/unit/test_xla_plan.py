"""XLA launch planning in the parent: detection, guard rails and topology, with fake sysfs,
fake package versions and a fake torch_xla module (torch_xla is never imported here)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from nbaccel.config.schema import Config
from nbaccel.errors import ConfigError
from nbaccel.hardware.devices import TPUInfo, detect_tpu
from nbaccel.hardware.xla_plan import (
    XlaPlan,
    check_versions,
    explain_xla_failure,
    plan_xla,
    uses_xla,
    xla_worker_env,
)
from tests.unit.fake_hosts import dev_entries, tpu_host

MATCHING = {"torch": "2.9.0+cpu", "torch_xla": "2.9.0"}


def tpu_machine(root: Path, chips: int, device_id: str = "0x0063") -> TPUInfo:
    """What detect_tpu finds on a fake TPU VM (see fake_hosts.tpu_host)."""
    return detect_tpu(tpu_host(root, chips, device_id), {})


def fake_torch_xla(initialized: bool) -> types.ModuleType:
    module = types.ModuleType("torch_xla")
    module._XLAC = types.SimpleNamespace(  # type: ignore[attr-defined]
        _xla_runtime_is_initialized=lambda: initialized
    )
    return module


def plan(
    config: Config,
    tpu: TPUInfo,
    env: dict[str, str] | None = None,
    versions: dict[str, str] | None = None,
    modules: dict[str, Any] | None = None,
) -> XlaPlan:
    return plan_xla(
        config,
        tpu,
        env or {},
        version_of=(MATCHING if versions is None else versions).get,
        modules={} if modules is None else modules,
    )


def error(
    config: Config,
    tpu: TPUInfo,
    env: dict[str, str] | None = None,
    versions: dict[str, str] | None = None,
    modules: dict[str, Any] | None = None,
) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        plan(config, tpu, env, versions, modules)
    return info.value


NO_TPU = TPUInfo(0, (), None)
V5E_1 = TPUInfo(1, ("/dev/vfio/0",), None, ("v5e",))


# Detection ------------------------------------------------------------------------------


def test_generations_come_from_pci_ids_only(tmp_path: Path) -> None:
    info = tpu_machine(tmp_path / "v5e", 8)
    assert info.chips == 8 and info.generations == ("v5e",) and info.devices_per_chip == 1
    info = tpu_machine(tmp_path / "v3", 4, "0x0027")
    assert info.generations == ("v2/v3",) and info.devices_per_chip == 2
    info = tpu_machine(tmp_path / "v4", 4, "0x005e")
    assert info.generations == ("v4",) and info.devices_per_chip == 1
    only_dev = tmp_path / "dev-only"
    dev_entries(only_dev, "vfio/0", "vfio/1")
    info = detect_tpu(only_dev, {})
    assert (info.chips, info.generations, info.devices_per_chip) == (2, (), 1)
    dev_entries(only_dev / "accel", "accel0", "accel1", "accel2", "accel3")
    info = detect_tpu(only_dev / "accel", {})
    assert (info.chips, info.generations, info.devices_per_chip) == (4, (), 2)


# uses_xla -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "tpu", "expected"),
    [
        (Config(strategy="xla"), NO_TPU, True),  # asked for explicitly: plan_xla explains
        (Config(), V5E_1, True),
        (Config(strategy="fsdp"), V5E_1, True),
        (Config(), TPUInfo(0, (), "CPU"), True),  # PJRT_DEVICE=CPU asks for XLA on CPU
        (Config(), NO_TPU, False),
        (Config(strategy="fsdp"), NO_TPU, False),
        (Config(use_cpu=True), V5E_1, False),
        (Config(strategy="ddp"), V5E_1, False),
        (Config(strategy="deepspeed"), TPUInfo(0, (), "TPU"), False),
    ],
)
def test_uses_xla(config: Config, tpu: TPUInfo, expected: bool) -> None:
    assert uses_xla(config, tpu) is expected


# a/b: installed and matching versions ---------------------------------------------------


def test_torch_xla_not_installed_says_where_to_get_it() -> None:
    message = str(error(Config(), V5E_1, versions={"torch": "2.9.0"}))
    assert "needs torch_xla" in message and "not installed" in message
    assert "Colab and Kaggle TPU runtimes it is preinstalled" in message
    assert "pip install 'nbaccel[xla]'" in message


def test_too_old_torch_xla_names_the_supported_versions() -> None:
    message = str(error(Config(), V5E_1, versions={"torch": "2.7.1", "torch_xla": "2.7.0"}))
    assert "torch_xla 2.7.0 is too old" in message and ">= 2.8" in message
    assert "pip install 'torch==2.9.*' 'torch_xla[tpu]==2.9.*'" in message


def test_torch_and_torch_xla_mismatch_names_both_and_the_fix() -> None:
    versions = {"torch": "2.13.0", "torch_xla": "2.9.0"}
    message = str(error(Config(), V5E_1, versions=versions))
    assert "torch 2.13.0 and torch_xla 2.9.0 differ in major.minor" in message
    assert "undefined symbol" in message and "pip install 'torch==2.9.*'" in message
    assert check_versions(versions.get) == message
    missing_torch = str(error(Config(), V5E_1, versions={"torch_xla": "2.8.0"}))
    assert "torch is not" in missing_torch and "pip install 'torch==2.8.*'" in missing_torch


@pytest.mark.parametrize(
    "versions",
    [
        {"torch": "2.8.0", "torch_xla": "2.8.0"},
        {"torch": "2.9.1+cpu", "torch_xla": "2.9.0"},
        {"torch": "2.10.0.dev20251101", "torch_xla": "2.10.0rc1"},
    ],
)
def test_supported_matching_versions_pass(versions: dict[str, str]) -> None:
    assert check_versions(versions.get) is None
    assert plan(Config(), V5E_1, versions=versions).world_size == 1


# c: runtime already initialised in the kernel -------------------------------------------


def test_runtime_initialised_in_the_kernel_says_restart_and_launch_first() -> None:
    message = str(error(Config(), V5E_1, modules={"torch_xla": fake_torch_xla(True)}))
    assert "already initialised in this kernel" in message
    assert "Restart the kernel" in message and "`import torch_xla` alone is fine" in message


def test_imported_but_unused_torch_xla_is_fine() -> None:
    assert plan(Config(), V5E_1, modules={"torch_xla": fake_torch_xla(False)}).world_size == 1
    half_imported = types.ModuleType("torch_xla")  # no _XLAC: its runtime never started
    assert plan(Config(), V5E_1, modules={"torch_xla": half_imported}).device == "TPU"


def test_default_modules_are_this_process_and_torch_xla_is_never_imported() -> None:
    before = {name for name in sys.modules if name.split(".")[0] in ("torch", "torch_xla")}
    plan_xla(Config(), V5E_1, {}, version_of=MATCHING.get)
    after = {name for name in sys.modules if name.split(".")[0] in ("torch", "torch_xla")}
    assert after == before


# d: the PJRT device ---------------------------------------------------------------------


def test_pjrt_device_tpu_without_chips_explains_there_is_no_tpu() -> None:
    message = str(error(Config(), NO_TPU, env={"PJRT_DEVICE": "TPU"}))
    assert "there is no TPU on this machine" in message
    assert "max_workers must be greater than 0" in message
    assert "Choose a TPU runtime" in message
    assert "unset PJRT_DEVICE" in message and "PJRT_DEVICE=CPU" in message


def test_strategy_xla_with_nothing_to_run_on() -> None:
    caught = error(Config(strategy="xla"), NO_TPU)
    assert caught.field == "strategy" and "PJRT_DEVICE=CPU" in str(caught)
    assert "TPU runtime" in str(caught)


def test_other_pjrt_devices_are_refused_with_the_gpu_alternative() -> None:
    message = str(error(Config(), TPUInfo(0, (), "CUDA"), env={"PJRT_DEVICE": "CUDA"}))
    assert "PJRT_DEVICE=CUDA" in message and "TPUs and on the CPU only" in message
    assert "strategy='ddp' or 'fsdp'" in message


def test_pjrt_device_is_upper_cased_and_overrides_chips() -> None:
    v5e_8 = TPUInfo(8, (), "cpu", ("v5e",))
    assert plan(Config(), v5e_8, env={"PJRT_DEVICE": "cpu"}) == XlaPlan("CPU", 1, 1)
    assert plan(Config(), V5E_1, env={"PJRT_DEVICE": "tpu"}).device == "TPU"


# e: topology ----------------------------------------------------------------------------


def test_v5e_1_runs_one_process() -> None:
    assert plan(Config(), V5E_1) == XlaPlan("TPU", 1, 1)
    assert plan(Config(num_processes=1), V5E_1) == XlaPlan("TPU", 1, 1)
    caught = error(Config(num_processes=2), V5E_1)
    assert caught.field == "num_processes"
    assert "this TPU v5e machine has 1 chip: num_processes can be only 1" in str(caught)


@pytest.mark.parametrize(
    ("asked", "expected"),
    [(None, XlaPlan("TPU", 8, 1)), (8, XlaPlan("TPU", 8, 1)), (1, XlaPlan("TPU", 1, 1))],
)
def test_v5e_8(tmp_path: Path, asked: int | None, expected: XlaPlan) -> None:
    result = plan(Config(num_processes=asked), tpu_machine(tmp_path, 8))
    assert result == expected
    assert result.world_size == (asked or 8)
    assert result.spawn_nprocs == (1 if asked == 1 else None)


def test_v5e_8_refuses_what_torch_xla_cannot_start(tmp_path: Path) -> None:
    caught = error(Config(num_processes=4), tpu_machine(tmp_path, 8))
    assert caught.field == "num_processes"
    message = str(caught)
    assert "num_processes=4, but this TPU v5e machine has 8 chips" in message
    assert "num_processes can be 8 (all) or 1 (one chip)" in message
    assert "nprocs=1 or None" in message


def test_v3_8_via_accel_runs_four_processes_of_two_devices(tmp_path: Path) -> None:
    dev_entries(tmp_path, "accel0", "accel1", "accel2", "accel3")
    v3 = detect_tpu(tmp_path, {})
    result = plan(Config(), v3)
    assert result == XlaPlan("TPU", 4, 2) and result.world_size == 8
    assert plan(Config(num_processes=8), v3) == result
    assert plan(Config(num_processes=1), v3) == XlaPlan("TPU", 1, 1)
    message = str(error(Config(num_processes=4), v3))
    assert "4 chips of 2 devices each" in message and "can be 8 (all) or 1" in message


def test_v3_8_via_pci(tmp_path: Path) -> None:
    assert plan(Config(), tpu_machine(tmp_path, 4, "0x0027")) == XlaPlan("TPU", 4, 2)


@pytest.mark.parametrize("device_id", ["0x005e", "0x0062", "0x006f", "0x0056"])
def test_v4_and_later_run_one_device_per_process(tmp_path: Path, device_id: str) -> None:
    assert plan(Config(), tpu_machine(tmp_path, 4, device_id)) == XlaPlan("TPU", 4, 1)


def test_cpu_device_runs_one_process_of_cpu_num_devices() -> None:
    env = {"PJRT_DEVICE": "CPU"}
    cpu = TPUInfo(0, (), "CPU")
    assert plan(Config(), cpu, env) == XlaPlan("CPU", 1, 1)
    env["CPU_NUM_DEVICES"] = "4"
    assert plan(Config(), cpu, env) == XlaPlan("CPU", 1, 4)
    assert plan(Config(num_processes=4), cpu, env).world_size == 4
    assert plan(Config(num_processes=1), cpu, env) == XlaPlan("CPU", 1, 1)
    message = str(error(Config(num_processes=2), cpu, env))
    assert "CPU device has 4 devices (CPU_NUM_DEVICES=4)" in message
    assert "can be 4 (all) or 1 (one device)" in message


@pytest.mark.parametrize("value", ["0", "-2", "four", "1.5"])
def test_cpu_num_devices_must_be_a_positive_int(value: str) -> None:
    env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": value}
    message = str(error(Config(), TPUInfo(0, (), "CPU"), env))
    assert f"CPU_NUM_DEVICES={value!r} is not a positive whole number" in message
    assert "Set it to 1 or more" in message


@pytest.mark.parametrize("asked", [None, 1])
def test_spmd_drives_every_device_from_one_process(tmp_path: Path, asked: int | None) -> None:
    config = Config(strategy="fsdp", num_processes=asked)
    result = plan(config, tpu_machine(tmp_path, 8))
    assert result == XlaPlan("TPU", 1, 8, spmd=True) and result.world_size == 1
    cpu = plan(config, TPUInfo(0, (), "CPU"), {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"})
    assert cpu == XlaPlan("CPU", 1, 4, spmd=True) and cpu.spawn_nprocs is None


def test_spmd_refuses_several_processes(tmp_path: Path) -> None:
    caught = error(Config(strategy="fsdp", num_processes=2), tpu_machine(tmp_path, 8))
    assert caught.field == "num_processes"
    assert "SPMD (FSDPv2) runs one process" in str(caught)
    assert "num_processes=1 or leave it unset" in str(caught)


# f/g: precision, machines, start method -------------------------------------------------


def test_fp16_on_tpu_asks_for_bf16() -> None:
    caught = error(Config(mixed_precision="fp16"), V5E_1)
    assert caught.field == "mixed_precision" and "mixed_precision='bf16'" in str(caught)
    assert plan(Config(mixed_precision="bf16"), V5E_1).device == "TPU"


def test_several_machines_are_not_supported_yet() -> None:
    caught = error(Config(num_machines=2), V5E_1)
    assert caught.field == "num_machines"
    assert "multi-host TPU pods" in str(caught) and "num_machines=1" in str(caught)


def test_start_method_comes_from_the_config() -> None:
    assert plan(Config(), V5E_1).start_method == "spawn"
    assert plan(Config(xla_start_method="fork"), V5E_1).start_method == "fork"
    with pytest.raises(ConfigError, match="'spawn', 'fork'"):
        Config(xla_start_method="forkserver")


def test_guard_rails_run_in_order() -> None:
    # Versions, then the kernel's runtime, then the device: the first fix to make is named.
    busy = {"torch_xla": fake_torch_xla(True)}
    tpu_env = {"PJRT_DEVICE": "TPU"}
    mismatch = {"torch": "2.13.0", "torch_xla": "2.9.0"}
    assert "differ" in str(error(Config(), NO_TPU, tpu_env, mismatch, busy))
    assert "already initialised" in str(error(Config(), NO_TPU, tpu_env, None, busy))
    assert "no TPU" in str(error(Config(num_processes=3), NO_TPU, tpu_env))
    fp16 = Config(num_processes=3, mixed_precision="fp16")
    assert error(fp16, V5E_1).field == "num_processes"


# Worker environment and failure text ----------------------------------------------------


def test_worker_env() -> None:
    assert xla_worker_env(XlaPlan("TPU", 8, 1)) == {"PJRT_DEVICE": "TPU"}
    assert xla_worker_env(XlaPlan("CPU", 1, 4)) == {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    assert xla_worker_env(XlaPlan("CPU", 1, 4, spmd=True))["CPU_NUM_DEVICES"] == "4"


@pytest.mark.parametrize(
    "text",
    [
        "RuntimeError: Bad StatusOr access: UNKNOWN: TPU initialization failed: "
        "open(/dev/vfio/0): Device or resource busy; Couldn't open iommu group /dev/vfio/0",
        "open(/dev/vfio/12): Device or resource busy",
        "RuntimeError: open(/dev/accel0): Operation not permitted: TPU ...",
        "open(/dev/accel3): operation not permitted",
    ],
)
def test_chip_busy_says_who_holds_it_and_how_to_free_it(text: str) -> None:
    explained = explain_xla_failure(text)
    assert explained is not None and "TPU is busy" in explained
    assert "Another process holds the TPU chip" in explained
    assert "lsof -w /dev/vfio/* /dev/accel*" in explained and "restart the runtime" in explained


def test_known_launch_failures_are_explained() -> None:
    no_chips = explain_xla_failure("ValueError: max_workers must be greater than 0")
    assert no_chips is not None and "PJRT_DEVICE=TPU but this machine has no TPU" in no_chips
    assert "PJRT_DEVICE=CPU" in no_chips
    text = "RuntimeError: Runtime is already initialized. Do not use the XLA device before..."
    initialised = explain_xla_failure(text)
    assert initialised is not None and "Restart the kernel" in initialised


@pytest.mark.parametrize(
    "text", ["", "ZeroDivisionError: division by zero", "open(/dev/vfio/0): No such file"]
)
def test_other_text_is_not_explained(text: str) -> None:
    assert explain_xla_failure(text) is None
