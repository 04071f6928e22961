"""GPU path of the launcher: nccl group, one device per local rank. Runs only with CUDA."""

from __future__ import annotations

import os

import pytest

import nbaccel
from nbaccel.hardware.devices import visible_gpu_count

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]


def on_gpu() -> dict:
    import torch
    import torch.distributed as dist

    t = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return {
        "device": torch.cuda.current_device(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "sum": t.item(),
        "backend": str(dist.get_backend()),
        "use_cpu": os.environ.get("ACCELERATE_USE_CPU"),
    }


def test_every_visible_gpu_gets_one_rank_with_nccl(runs_dir: str) -> None:
    gpus = visible_gpu_count(os.environ)
    results = nbaccel.launch(on_gpu, runs_dir=runs_dir).results(240)  # default: one per GPU
    assert sorted(results) == list(range(gpus))
    for info in results.values():
        assert info["device"] == info["local_rank"]
        assert info["sum"] == gpus * (gpus + 1) / 2
        assert "nccl" in info["backend"]
        assert info["use_cpu"] is None


def test_more_processes_than_gpus_is_refused_before_start(runs_dir: str) -> None:
    with pytest.raises(nbaccel.ConfigError, match="GPU"):
        nbaccel.launch(on_gpu, num_processes=visible_gpu_count(os.environ) + 1, runs_dir=runs_dir)


def test_use_cpu_runs_gloo_even_with_gpus(runs_dir: str) -> None:
    def backend() -> str:
        import torch.distributed as dist

        return str(dist.get_backend())

    assert (
        nbaccel.notebook_launcher(backend, num_processes=2, use_cpu=True, runs_dir=runs_dir)
        == "gloo"
    )


def test_accelerate_sees_the_fsdp_strategy_on_gpus(runs_dir: str) -> None:
    pytest.importorskip("accelerate")

    def distributed_type() -> str:
        from accelerate import Accelerator

        return str(Accelerator().distributed_type.value)

    assert nbaccel.notebook_launcher(distributed_type, strategy="fsdp", runs_dir=runs_dir) == "FSDP"
