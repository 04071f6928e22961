"""FSDP2 and ZeRO-1 on GPUs (nccl): the same code paths as on CPU, where CUDA is present."""

from __future__ import annotations

import os
from typing import Any

import pytest

import nbaccel
from nbaccel.hardware.devices import visible_gpu_count
from tests.multiprocess.test_sharding import BY_CLASS, blocks_model, full_weights

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]


def train_on_gpu(per_rank: int) -> dict[str, Any]:
    import torch

    acc = nbaccel.Accelerator()
    model = blocks_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    data = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(1)).to(acc.device)
    for batch in data:
        acc.backward(model(batch[acc.process_index * per_rank :][:per_rank]).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    shard = next(model.parameters())
    local = getattr(shard, "to_local", lambda: shard)()
    return {
        "type": acc.distributed_type.value,
        "shard_device": local.device.type,
        "weights": {k: v.cpu() for k, v in full_weights(acc.unwrap_model(model)).items()},
    }


@pytest.mark.parametrize("offload", [False, True])
def test_fsdp_on_gpus_matches_one_gpu(runs_dir: str, offload: bool) -> None:
    ranks = min(2, visible_gpu_count(os.environ))
    one = nbaccel.notebook_launcher(train_on_gpu, args=(8,), num_processes=1, runs_dir=runs_dir)
    many = nbaccel.notebook_launcher(
        train_on_gpu,
        args=(8 // ranks,),
        num_processes=ranks,
        runs_dir=runs_dir,
        fsdp_cpu_offload=offload,
        **BY_CLASS,
    )
    if ranks > 1:
        assert many["type"] == "FSDP"
        # Offloaded shards live in host memory between uses; otherwise on the GPU.
        assert many["shard_device"] == ("cpu" if offload else "cuda")
    for name, tensor in one["weights"].items():
        assert float((tensor - many["weights"][name]).abs().max()) < 1e-5, name
