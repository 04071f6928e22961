"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer
state sharded over the ranks.

Sharding happens in place (the module keeps its class; its parameters become DTensors),
so optimizers built before ``prepare`` are re-pointed at the sharded parameters. Full state
dicts are gathered through ``torch.distributed.checkpoint`` into plain tensors, which load
into an unsharded one-process model.

The step-time breakdown: on CPU processes (gloo) each reduce-scatter of the gradients blocks
inside ``backward``, so it is timed as communication by ``TimedReduceScatter``, torch's
default reduce-scatter (the same collective, the same numbers) inside a timer mark. On GPUs
the reduce-scatters run on their own stream, and only the wait for them at the end of
``backward`` is communication (``StepTimer.watch_reduction``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from nbaccel.accel.checkpoints import sharded_checkpoint
from nbaccel.accel.precision import Precision
from nbaccel.accel.strategies import models, sharding
from nbaccel.accel.strategies.base import ParameterSwap
from nbaccel.accel.strategies.data_parallel import DataParallel, warn_ddp_options_unused
from nbaccel.accel.tracking.step_timing import COMMUNICATION, StepTimer


class FullySharded(DataParallel):
    """FSDP2 with the options of ``config.fsdp`` (strategy, wrapping, offload, ...)."""

    name = "fsdp2"

    def make_precision(self, mode: str, **options: Any) -> Precision:
        # FSDP's MixedPrecisionPolicy casts the parameters; Precision keeps autocast only.
        return Precision(mode, self.state.device, sharded=True, **options)

    def prepare_model(
        self,
        model: torch.nn.Module,
        precision: Precision,
        *,
        device_placement: bool,
        ddp_kwargs: dict[str, Any],
    ) -> tuple[torch.nn.Module, ParameterSwap]:
        if ddp_kwargs or self.options.ddp_comm_hook != "no":
            warn_ddp_options_unused(self.name)
        compilation = models.Compilation.of(self.options)
        swap = models.prepare_sharded_model(
            model, self.state, precision, self.config.fsdp, compilation
        )
        if self.step_timer.enabled and self.state.device.type == "cpu":
            for module in model.modules():
                if sharding.is_sharded(module):
                    sharded: Any = module  # an FSDPModule
                    sharded.set_custom_reduce_scatter(TimedReduceScatter(self.step_timer))
        return model, swap

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        inner = self.unwrap_model(model, keep_autocast=True, keep_compile=False)
        # Every rank takes part in the gathering. By default rank 0 gets the whole, as plain
        # CPU tensors (the others an empty dict), ready for one safetensors file; the
        # plugin's FullStateDictConfig may give it to every rank, or keep it on the device.
        placement = self.options.full_state_dict
        return sharded_checkpoint.full_model_state(
            inner, rank0_only=placement.rank0_only, offload_to_cpu=placement.offload_to_cpu
        )

    def weights_to_save(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        # save_model writes from rank 0's CPU memory whatever get_state_dict's placement is.
        inner = self.unwrap_model(model, keep_autocast=True, keep_compile=False)
        return sharded_checkpoint.full_model_state(inner)


class TimedReduceScatter(DefaultReduceScatter):
    """FSDP2's default reduce-scatter, timed as the communication phase of the step.

    >>> TimedReduceScatter(StepTimer(enabled=False, send=print)).timer.enabled
    False
    """

    def __init__(self, timer: StepTimer) -> None:
        self.timer = timer

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        previous = self.timer.enter(COMMUNICATION)
        try:
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        finally:
            self.timer.leave(previous)
