"""The Accelerator's GPU path: nccl DDP, bf16/fp16 on CUDA, CUDA RNG in checkpoints.

Runs only where CUDA is present (the ``cuda`` marker); the same code runs on CPU elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import nbaccel
from nbaccel.hardware.devices import visible_gpu_count
from tests.multiprocess.test_accel_checkpoint import train_resumable
from tests.multiprocess.test_accelerator import train_regression

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]


def gpu_ranks() -> int:
    return min(2, visible_gpu_count(os.environ))


def test_ddp_on_gpus_matches_one_gpu_on_the_full_batch(runs_dir: str) -> None:
    ranks = gpu_ranks()
    one = nbaccel.notebook_launcher(
        train_regression, args=(16, 5), num_processes=1, runs_dir=runs_dir
    )
    many = nbaccel.notebook_launcher(
        train_regression, args=(16 // ranks, 5), num_processes=ranks, runs_dir=runs_dir
    )
    assert one["params"][0].device.type == "cuda"
    expected_type = "MULTI_GPU" if ranks > 1 else "NO"
    assert many["type"] == expected_type
    for a, b in zip(one["params"], many["params"], strict=True):
        assert float((a.cpu() - b.cpu()).abs().max()) < 1e-5


def precision_on_cuda(mode: str) -> dict[str, Any]:
    import torch

    acc = nbaccel.Accelerator(mixed_precision=mode)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = acc.prepare(model, optimizer)
    out = model(torch.randn(8, 16, device=acc.device))
    acc.backward(out.pow(2).mean())
    optimizer.step()
    inner = acc.unwrap_model(model)
    return {
        "device": str(acc.device),
        "inner": str(seen[0]),
        "out": str(out.dtype),
        "param": str(next(inner.parameters()).dtype),
        "scaler": acc.scaler is not None and acc.scaler.is_enabled(),
        "allocated": torch.cuda.memory_allocated(acc.device),
    }


@pytest.mark.parametrize(("mode", "dtype"), [("bf16", "torch.bfloat16"), ("fp16", "torch.float16")])
def test_mixed_precision_on_cuda(runs_dir: str, mode: str, dtype: str) -> None:
    import torch

    if mode == "bf16" and not torch.cuda.is_bf16_supported():
        with pytest.raises(nbaccel.ConfigError, match="bfloat16"):
            nbaccel.notebook_launcher(
                precision_on_cuda, args=(mode,), num_processes=1, runs_dir=runs_dir
            )
        return
    result = nbaccel.notebook_launcher(
        precision_on_cuda, args=(mode,), num_processes=1, runs_dir=runs_dir
    )
    assert result["device"] == "cuda:0"
    assert result["inner"] == dtype
    assert result["out"] == result["param"] == "torch.float32"
    assert result["scaler"] is (mode == "fp16")
    assert result["allocated"] > 0


def test_resume_on_gpus_equals_the_uninterrupted_run(tmp_path: Path, runs_dir: str) -> None:
    ranks = gpu_ranks()
    checkpoint = str(tmp_path / "ckpt")
    straight = nbaccel.launch(
        train_resumable, args=(checkpoint, 12, "fresh"), num_processes=ranks, runs_dir=runs_dir
    )
    expected = straight.result(timeout=240)
    nbaccel.notebook_launcher(
        train_resumable, args=(checkpoint, 6, "save"), num_processes=ranks, runs_dir=runs_dir
    )
    resumed = nbaccel.launch(
        train_resumable, args=(checkpoint, 6, "resume"), num_processes=ranks, runs_dir=runs_dir
    )
    params = resumed.result(timeout=240)
    for a, b in zip(expected, params, strict=True):
        assert bool((a.cpu() == b.cpu()).all())
    assert resumed.metrics == straight.metrics[6:]
