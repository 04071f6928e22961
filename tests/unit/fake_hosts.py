"""Fake machines for tests that detect accelerators: sysfs PCI entries and /dev nodes under a
temporary root, as ``nbaccel.hardware.devices.detect_tpu`` reads them."""

from __future__ import annotations

from pathlib import Path


def pci_device(root: Path, address: str, vendor: str, device: str) -> None:
    folder = root / "sys" / "bus" / "pci" / "devices" / address
    folder.mkdir(parents=True)
    (folder / "vendor").write_text(vendor + "\n")
    (folder / "device").write_text(device + "\n")


def dev_entries(root: Path, *names: str) -> None:
    for name in names:
        path = root / "dev" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


def tpu_host(root: Path, chips: int, device_id: str = "0x0063") -> Path:
    """A TPU VM (v5e by default): a Google TPU PCI entry per chip, and ``/dev/vfio/N`` (v4
    and later) or ``/dev/accelN`` (v2/v3, PCI id 0x0027)."""
    for index in range(chips):
        pci_device(root, f"0000:00:{index + 4:02x}.0", "0x1ae0", device_id)
        dev_entries(root, f"accel{index}" if device_id == "0x0027" else f"vfio/{index}")
    return root
