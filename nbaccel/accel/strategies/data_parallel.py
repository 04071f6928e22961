"""Data parallel over torch.distributed: DDP, and DDP with a ZeRO-1 sharded optimizer.

Every rank holds the whole model; DDP all-reduces gradients during backward (in buckets,
overlapping the computation) and ``no_sync`` suspends that while gradients accumulate.
``ZeroOne`` shards only the optimizer state (``ZeroRedundancyOptimizer``): 12 bytes a
parameter per rank with Adam instead of DDP's 16 (FACTS.md).

``DistributedDataParallelKwargs`` reach ``DistributedDataParallel(...)``, and its
``comm_hook`` / ``comm_wrapper`` / ``comm_state_option`` register one of torch's
communication hooks as Accelerate does (``register_comm_hook``). What torch cannot run here
is refused when the model is prepared, not at some later step: bf16 compression needs NCCL
on CUDA GPUs, and torch's ``batched_powerSGD_hook`` fails an internal assertion in the first
step it compresses (its low-rank matrix is not batched).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from nbaccel.accel.precision import Precision
from nbaccel.accel.state import ProcessState, apply_init_process_group_kwargs
from nbaccel.accel.strategies import models, sharding
from nbaccel.accel.strategies.base import ParameterSwap, Strategy
from nbaccel.config.accelerator_options import AcceleratorOptions
from nbaccel.config.schema import Config

_HOOKS: dict[str, Callable[..., Any]] = {
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
    "power_sgd": powerSGD_hook.powerSGD_hook,
    "batched_power_sgd": powerSGD_hook.batched_powerSGD_hook,
}
_WRAPPERS = {
    "fp16": default_hooks.fp16_compress_wrapper,
    "bf16": default_hooks.bf16_compress_wrapper,
}
_POWER_SGD = ("power_sgd", "batched_power_sgd")


class DataParallel(Strategy):
    """DDP over the default process group (gloo on CPU, NCCL on GPUs)."""

    name = "ddp"

    def __init__(
        self, state: ProcessState, config: Config, options: AcceleratorOptions | None = None
    ) -> None:
        super().__init__(state, config, options)
        if state.use_distributed:  # the launch's group: InitProcessGroupKwargs' timeout
            apply_init_process_group_kwargs(self.options.init_process_group_kwargs, state.device)

    def prepare_model(
        self,
        model: torch.nn.Module,
        precision: Precision,
        *,
        device_placement: bool,
        ddp_kwargs: dict[str, Any],
    ) -> tuple[torch.nn.Module, ParameterSwap]:
        prepared = models.prepare_model(
            model,
            self.state,
            precision,
            device_placement=device_placement,
            compilation=models.Compilation.of(self.options),
        )
        device = self.state.device
        device_ids = [device.index] if device.type == "cuda" else None
        wrapped = DistributedDataParallel(prepared, device_ids=device_ids, **ddp_kwargs)
        register_comm_hook(wrapped, self.options, device)
        return wrapped, {}

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


def register_comm_hook(
    model: DistributedDataParallel, options: AcceleratorOptions, device: torch.device
) -> None:
    """Register the communication hook ``options`` names on ``model`` (Accelerate's rules:
    PowerSGD gets a ``PowerSGDState`` over the default group built from
    ``comm_state_option``; ``comm_wrapper`` compresses the hook's traffic)."""
    hook_name, wrapper_name = options.ddp_comm_hook, options.ddp_comm_wrapper
    state_option = options.ddp_comm_state_option
    if hook_name == "no":
        if wrapper_name != "no" or state_option:
            given = "comm_wrapper" if wrapper_name != "no" else "comm_state_option"
            raise ValueError(
                f"DistributedDataParallelKwargs({given}=...) applies to a communication hook, "
                "but comm_hook is 'no' (Accelerate ignores it then). Choose comm_hook "
                "('fp16', 'bf16', 'power_sgd', 'batched_power_sgd'), or drop the argument."
            )
        return
    if state_option and hook_name not in _POWER_SGD:
        raise ValueError(
            f"DistributedDataParallelKwargs(comm_state_option={state_option!r}) configures "
            f"PowerSGD's state, but comm_hook={hook_name!r} has none (Accelerate ignores it "
            "then). Use comm_hook='power_sgd', or drop comm_state_option."
        )
    if "bf16" in (hook_name, wrapper_name) and device.type != "cuda":
        raise NotImplementedError(
            f"DDP communication hook {hook_name!r} with wrapper {wrapper_name!r}: bf16 "
            f"compression needs NCCL on CUDA GPUs (torch refuses it elsewhere), and this run "
            f"reduces gradients on {device.type} over gloo. Use 'fp16' on CPU processes, or "
            "run on GPUs."
        )
    if hook_name == "batched_power_sgd" and not _batched_power_sgd_works():
        raise NotImplementedError(
            f"comm_hook='batched_power_sgd': torch {torch.__version__}'s batched_powerSGD_hook "
            "fails an assertion in the first step it compresses (its low-rank matrix is not "
            "batched), so training would stop at start_powerSGD_iter. Use "
            "comm_hook='power_sgd'."
        )
    hook = _HOOKS[hook_name]
    if wrapper_name != "no":
        hook = _WRAPPERS[wrapper_name](hook)
    state = powerSGD_hook.PowerSGDState(None, **state_option) if hook_name in _POWER_SGD else None
    model.register_comm_hook(state, hook)


def _batched_power_sgd_works() -> bool:
    # The hook orthogonalizes one (side x rank) matrix with a function that insists on a
    # batch of them: probe that function, so a torch that fixes either passes again.
    orthogonalize = getattr(powerSGD_hook, "_orthogonalize", None)
    if orthogonalize is None:
        return True  # renamed: nothing known against the hook any more
    try:
        orthogonalize(torch.ones(2, 1))
    except AssertionError:
        return False
    return True


def warn_ddp_options_unused(strategy: str) -> None:
    """DDP's keywords and hooks given under a strategy without DDP: said, not dropped silently."""
    warnings.warn(
        f"DistributedDataParallelKwargs (or ddp_kwargs) are not used under strategy "
        f"{strategy!r}, which does not wrap the model in DDP (Accelerate ignores them there too). "
        "Remove them, or use strategy='ddp'.",
        stacklevel=4,
    )
