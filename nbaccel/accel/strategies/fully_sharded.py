"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer
state sharded over the ranks.

Sharding happens in place (the module keeps its class; its parameters become DTensors),
so optimizers built before ``prepare`` are re-pointed at the sharded parameters. Full state
dicts are gathered through ``torch.distributed.checkpoint`` into plain tensors, which load
into an unsharded one-process model.
"""

from __future__ import annotations

from typing import Any

import torch

from nbaccel.accel import models, sharded_checkpoint
from nbaccel.accel.precision import Precision
from nbaccel.accel.strategies.base import ParameterSwap
from nbaccel.accel.strategies.data_parallel import DataParallel, warn_ddp_options_unused


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
        return model, swap

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        inner = self.unwrap_model(model, keep_autocast=True, keep_compile=False)
        # Every rank takes part in the gathering; rank 0 gets the whole, as plain CPU
        # tensors (the others an empty dict), ready for one safetensors file.
        return sharded_checkpoint.full_model_state(inner)
