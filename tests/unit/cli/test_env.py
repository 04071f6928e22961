"""`nbaccel env`: TPU detection from a fake sysfs/dev tree, the report (with the XLA launch
plan), and no torch import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from importlib import metadata
from pathlib import Path

import pytest

from nbaccel.cli import env as cli_env
from nbaccel.cli.env import collect_report, format_report
from nbaccel.hardware.devices import detect_tpu
from tests.unit.fake_hosts import dev_entries, pci_device

SECTIONS = ["Packages", "Devices", "Backends", "Config files", "Environment", "Warnings"]


def torch_modules() -> set[str]:
    return {name for name in sys.modules if name.split(".")[0] in ("torch", "torch_xla")}


def test_google_tpu_pci_devices_are_chips(tmp_path: Path) -> None:
    for index in range(4):
        pci_device(tmp_path, f"0000:00:0{index + 4}.0", "0x1ae0", "0x0063")
    pci_device(tmp_path, "0000:00:01.0", "0x1af4", "0x1000")  # virtio: not a TPU
    info = detect_tpu(tmp_path, {})
    assert info.chips == 4 and info.xla_device == "TPU" and info.pjrt_device is None
    assert info.evidence[0] == "PCI 0000:00:04.0 (TPU v5e, id 0x0063)"


def test_other_vendors_and_other_google_devices_are_no_tpu(tmp_path: Path) -> None:
    pci_device(tmp_path, "0000:00:03.0", "0x10de", "0x2330")  # an NVIDIA H100
    pci_device(tmp_path, "0000:00:04.0", "0x1ae0", "0x0042")  # Google gVNIC (every GCE VM)
    pci_device(tmp_path, "0000:00:05.0", "0x8086", "0x1237")
    (tmp_path / "dev" / "accel").mkdir(parents=True)  # the kernel's accel/ folder (NPUs)
    dev_entries(tmp_path, "vfio/vfio", "nvidia0")
    info = detect_tpu(tmp_path, {})
    assert (info.chips, info.evidence, info.xla_device) == (0, (), None)


def test_accel_and_numeric_vfio_entries_are_chips(tmp_path: Path) -> None:
    dev_entries(tmp_path, "accel0", "accel1", "accel2", "accel3")
    assert detect_tpu(tmp_path, {}).chips == 4
    other = tmp_path / "v5e"
    dev_entries(other, "vfio/0", "vfio/1", "vfio/10", "vfio/vfio")
    info = detect_tpu(other, {})
    assert info.chips == 3 and info.xla_device == "TPU"
    assert info.evidence == ("/dev/vfio/0", "/dev/vfio/1", "/dev/vfio/10")


def test_pjrt_device_overrides_what_xla_would_use(tmp_path: Path) -> None:
    assert detect_tpu(tmp_path, {"PJRT_DEVICE": "TPU"}).xla_device == "TPU"
    pci_device(tmp_path, "0000:00:04.0", "0x1ae0", "0x006f")
    info = detect_tpu(tmp_path, {"PJRT_DEVICE": "cpu"})
    assert info.chips == 1 and info.xla_device == "CPU" and info.pjrt_device == "cpu"


def test_text_report_has_every_section_and_keeps_torch_out(tmp_path: Path) -> None:
    before = torch_modules()
    pci_device(tmp_path, "0000:00:04.0", "0x1ae0", "0x005e")
    home = tmp_path / "home"
    env = {"HOME": str(home), "NBACCEL_MIXED_PRECISION": "bf16", "PATH": "/bin"}
    report = collect_report(env, root=tmp_path)
    text = format_report(report)
    assert torch_modules() == before  # neither torch nor torch_xla was imported
    headings = [line for line in text.splitlines() if line and not line.startswith(" ")]
    assert headings[0].startswith("nbaccel ") and f"Python {sys.version.split()[0]}" in headings[0]
    assert headings[1:] == SECTIONS
    assert "TPU chips: 1 (PCI 0000:00:04.0 (TPU v4, id 0x005e))" in text
    assert "NBACCEL_MIXED_PRECISION=bf16" in text and "PATH=" not in text
    assert f"{home}/.config/nbaccel/default_config.yaml (missing)" in text
    assert "NBACCEL_CONFIG:" in text and "not set" in text
    for name in cli_env.PACKAGES:
        assert f"  {name} " in text
    json.dumps(report)  # JSON-ready as it is


def test_versions_backends_and_warnings_follow_the_installed_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    versions = {"torch": "2.13.0", "torch_xla": "2.9.0"}
    monkeypatch.setattr(cli_env, "_version", versions.get)
    monkeypatch.setattr(cli_env, "visible_gpu_count", lambda env, proc_root: 2)
    report = collect_report({}, root=tmp_path)
    assert report["backends"] == ["gloo", "nccl", "xla"]
    assert any("major.minor" in w and "torch==2.9" in w for w in report["warnings"])

    versions.update(torch="2.13.0+cpu", torch_xla="2.13.1")
    report = collect_report({}, root=tmp_path)
    assert report["backends"] == ["gloo", "xla"]  # a CPU build of torch has no NCCL
    assert [w for w in report["warnings"] if "CPU build" in w]
    assert not [w for w in report["warnings"] if "major.minor" in w]

    versions.clear()
    report = collect_report({}, root=tmp_path)
    assert report["backends"] == []
    text = format_report(report)
    assert "torch         not installed" in text and "pip install torch" in text


def test_xla_entry_shows_the_plan_for_a_tpu_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli_env, "_version", {"torch": "2.9.0+cpu", "torch_xla": "2.9.0"}.get)
    for index in range(8):
        pci_device(tmp_path, f"0000:00:{index + 4:02x}.0", "0x1ae0", "0x0063")
    report = collect_report({}, root=tmp_path)
    xla = report["xla"]
    assert xla["used"] and xla["error"] is None and xla["version_check"] == "ok"
    assert xla["plan"]["device"] == "TPU" and xla["plan"]["world_size"] == 8
    assert xla["plan"]["num_processes"] == 8 and xla["plan"]["start_method"] == "spawn"
    assert report["warnings"] == []
    assert "  XLA launch: 8 processes × 1 device on TPU (spawn)" in format_report(report)
    json.dumps(report)


def test_xla_entry_on_cpu_with_pjrt_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_env, "_version", {"torch": "2.9.0", "torch_xla": "2.9.0"}.get)
    report = collect_report({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}, root=tmp_path)
    assert report["xla"]["plan"]["devices_per_process"] == 4
    assert "  XLA launch: 1 process × 4 devices on CPU (spawn)" in format_report(report)


def test_xla_entry_not_used_without_tpu_or_pjrt_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli_env, "_version", {"torch": "2.13.0"}.get)
    report = collect_report({}, root=tmp_path)
    assert report["xla"] == {
        "used": False,
        "plan": None,
        "error": None,
        "version_check": "not installed",
    }
    assert report["warnings"] == []
    assert "  XLA launch: not used (no TPU found, PJRT_DEVICE not set)" in format_report(report)


def test_xla_problems_become_warnings_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    versions = {"torch": "2.9.0"}
    monkeypatch.setattr(cli_env, "_version", versions.get)
    report = collect_report({"PJRT_DEVICE": "TPU"}, root=tmp_path)
    assert report["xla"]["used"] and report["xla"]["plan"] is None
    assert report["warnings"] == [report["xla"]["error"]]
    assert "needs torch_xla" in report["warnings"][0]
    assert "pip install 'nbaccel[xla]'" in report["warnings"][0]
    assert "  XLA launch: not possible (see Warnings)" in format_report(report)

    versions["torch_xla"] = "2.9.0"
    report = collect_report({"PJRT_DEVICE": "TPU"}, root=tmp_path)
    assert "there is no TPU on this machine" in report["xla"]["error"]
    assert report["warnings"] == [report["xla"]["error"]]

    versions["torch"] = "2.13.0"  # the mismatch is warned about once, not twice
    report = collect_report({"PJRT_DEVICE": "TPU"}, root=tmp_path)
    assert report["xla"]["version_check"] == report["xla"]["error"]
    assert report["warnings"] == [report["xla"]["error"]]
    assert "undefined symbol" in report["warnings"][0]


def test_gpu_names_come_from_nvml_when_it_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    fake = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: calls.append("init")  # type: ignore[attr-defined]
    fake.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    fake.nvmlDeviceGetCount = lambda: 2  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByIndex = lambda index: index  # type: ignore[attr-defined]
    names = [b"NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"]  # old and new nvidia-ml-py
    fake.nvmlDeviceGetName = lambda handle: names[handle]  # type: ignore[attr-defined]
    memory = types.SimpleNamespace(total=80 * 2**30)
    fake.nvmlDeviceGetMemoryInfo = lambda handle: memory  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(cli_env, "_version", {"torch": "2.13.0"}.get)
    report = collect_report({}, root=tmp_path)
    assert report["devices"]["cuda_gpus_visible"] == 2
    assert report["devices"]["gpu_names"] == [
        "0: NVIDIA H100 80GB HBM3, 80.0 GiB",
        "1: NVIDIA H100 80GB HBM3, 80.0 GiB",
    ]
    assert report["backends"] == ["gloo", "nccl"]
    assert calls.count("init") == calls.count("shutdown")  # NVML is always shut down
    assert "    1: NVIDIA H100 80GB HBM3, 80.0 GiB" in format_report(report)


def test_config_file_entries_say_exists_or_missing(tmp_path: Path) -> None:
    default = tmp_path / ".config" / "nbaccel" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text("num_processes: 2\n")
    env = {"HOME": str(tmp_path), "NBACCEL_CONFIG": str(tmp_path / "nope.yaml")}
    files = collect_report(env, root=tmp_path)["config_files"]
    assert files["nbaccel default"] == {"path": str(default), "status": "exists"}
    assert files["Accelerate default"]["status"] == "missing"
    assert files["NBACCEL_CONFIG"] == {"path": str(tmp_path / "nope.yaml"), "status": "missing"}
    assert files["read by default"] == str(default)


def clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBACCEL_", "ACCELERATE_"))}
    return {**env, "HOME": str(home), "NBACCEL_USE_CPU": "true"}


def test_cli_prints_the_report_as_json(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nbaccel.cli", "env", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(tmp_path),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) >= {"nbaccel", "python", "packages", "devices", "backends", "warnings"}
    assert set(report["xla"]) == {"used", "plan", "error", "version_check"}
    assert report["python"]["executable"] == sys.executable
    try:
        torch_version: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    assert report["packages"]["torch"] == torch_version
    assert report["environment"]["NBACCEL_USE_CPU"] == "true"
    assert set(report["devices"]) == {"cuda_gpus_visible", "gpu_names", "tpu", "cpu"}
    assert report["devices"]["cpu"]["logical"] == os.cpu_count()
    nbaccel_file = report["config_files"]["nbaccel default"]
    assert nbaccel_file["path"].startswith(str(tmp_path)) and nbaccel_file["status"] == "missing"


def test_a_fresh_process_making_the_report_never_imports_torch(tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "from nbaccel.cli.env import collect_report, format_report\n"
        "format_report(collect_report(os.environ))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_xla')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(tmp_path),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
