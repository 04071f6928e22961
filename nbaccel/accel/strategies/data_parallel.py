"""Data parallel over torch.distributed: DDP, and DDP with a ZeRO-1 sharded optimizer.

Every rank holds the whole model; DDP all-reduces gradients during backward (in buckets,
overlapping the computation) and ``no_sync`` suspends that while gradients accumulate.
``ZeroOne`` shards only the optimizer state (``ZeroRedundancyOptimizer``): 12 bytes a
parameter per rank with Adam instead of DDP's 16 (FACTS.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nbaccel.accel import sharding
from nbaccel.accel.precision import Precision
from nbaccel.accel.strategies.base import ParameterSwap, Strategy


class DataParallel(Strategy):
    """DDP over the default process group (gloo on CPU, NCCL on GPUs)."""

    name = "ddp"

    def prepare_model(
        self,
        model: torch.nn.Module,
        precision: Precision,
        *,
        device_placement: bool,
        ddp_kwargs: dict[str, Any],
    ) -> tuple[torch.nn.Module, ParameterSwap]:
        prepared, swap = super().prepare_model(
            model, precision, device_placement=device_placement, ddp_kwargs=ddp_kwargs
        )
        device = self.state.device
        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(prepared, device_ids=device_ids, **ddp_kwargs), swap

    def barrier(self) -> None:
        if self.state.use_distributed:  # DeepSpeed on one process has no group to wait on
            dist.barrier()

    def share(self, value: int) -> int:
        if not self.state.use_distributed:
            return value
        # On the device: a group the user created with nccl alone cannot carry CPU tensors.
        tensor = torch.tensor([value], device=self.state.device)
        dist.broadcast(tensor, src=0)
        return int(tensor.item())


class ZeroOne(DataParallel):
    """DDP with the optimizer state sharded over the ranks (``shard_optimizer_state``)."""

    name = "zero1"

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return sharding.zero1_optimizer(optimizer)
