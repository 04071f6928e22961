"""Counting GPUs without torch: CUDA_VISIBLE_DEVICES narrows what the driver offers."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbaccel.hardware.devices import visible_gpu_count


@pytest.fixture
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_nvml(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "pynvml":
            raise ImportError("no NVML in this test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nvml)


@pytest.fixture
def proc_with_gpus(tmp_path: Path, no_nvml: None) -> Path:
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"):
        (tmp_path / "driver" / "nvidia" / "gpus" / bus).mkdir(parents=True)
    return tmp_path


@pytest.mark.parametrize(
    ("env", "count"),
    [
        ({}, 4),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, 2),
        ({"CUDA_VISIBLE_DEVICES": ""}, 0),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, 0),
        ({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, 1),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}, 4),
    ],
)
def test_counts(proc_with_gpus: Path, env: dict, count: int) -> None:
    assert visible_gpu_count(env, proc_root=proc_with_gpus) == count


def test_no_driver_means_no_gpu(tmp_path: Path, no_nvml: None) -> None:
    assert visible_gpu_count({}, proc_root=tmp_path) == 0
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0"}, proc_root=tmp_path) == 0
