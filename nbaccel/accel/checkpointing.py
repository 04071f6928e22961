"""The Accelerator's model and checkpoint members: ``unwrap_model``, ``save_model``,
``register_for_checkpointing``, ``save_state`` and ``load_state``.

A base class of ``Accelerator``, split out to keep modules small. The work is done by
``models`` (unwrapping, safetensors), ``checkpoint`` (whole-state folders, atomically) and
``sharded_checkpoint`` (FSDP's shards); on XLA devices ``XlaRuntime`` supplies the hooks that
copy tensors to the CPU and replace torch.distributed's barriers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from nbaccel.accel import checkpoint, models, sharded_checkpoint, sharding
from nbaccel.accel.coordination import ProcessCoordination
from nbaccel.accel.data import PreparedDataLoader, PreparedIterableLoader
from nbaccel.accel.deepspeed_engine import DeepSpeedRun
from nbaccel.accel.optim import AcceleratedOptimizer, AcceleratedScheduler
from nbaccel.accel.precision import Precision
from nbaccel.config.schema import Config


class Checkpointing(ProcessCoordination):
    """Base of ``Accelerator`` holding its saving and loading members."""

    config: Config
    precision: Precision
    step: int
    _models: list[torch.nn.Module]
    _optimizers: list[AcceleratedOptimizer]
    _schedulers: list[AcceleratedScheduler]
    _dataloaders: list[PreparedDataLoader | PreparedIterableLoader]
    _custom: list[Any]
    _deepspeed: DeepSpeedRun | None

    def unwrap_model(
        self,
        model: torch.nn.Module,
        keep_fp32_wrapper: bool = True,
        keep_torch_compile: bool = True,
    ) -> Any:
        """The user's module without DDP; without torch.compile and the autocast forward too
        when asked (Accelerate's defaults keep both, so training goes on unchanged)."""
        if self._deepspeed is not None and model is self._deepspeed.engine:
            return self._deepspeed.engine.module
        return models.unwrap_model(
            model, keep_autocast=keep_fp32_wrapper, keep_compile=keep_torch_compile
        )

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike[str]) -> None:
        """Write the consolidated weights to ``save_directory/model.safetensors`` (rank 0)."""
        if self._deepspeed is not None:  # gathered from every rank's ZeRO partitions
            self._deepspeed.save_model(save_directory)
            self.wait_for_everyone()
            return
        if self._xla is not None:  # one graph computes every pending weight before the copies
            self._xla.sync()
        inner = models.unwrap_model(model, keep_autocast=True)
        if sharding.is_sharded(inner):  # gathered from every rank's shards, onto rank 0's CPU
            weights = sharded_checkpoint.full_model_state(inner)
            if self.is_main_process:
                models.save_state_file(weights, Path(save_directory))
        elif self.is_main_process:
            models.save_model_file(inner, Path(save_directory))
        self.wait_for_everyone()

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include objects with ``state_dict``/``load_state_dict`` in save/load_state."""
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"register_for_checkpointing: {type(obj).__name__} has no state_dict() "
                    "and load_state_dict(); only such objects can be checkpointed."
                )
        self._custom.extend(objects)

    def _stateful(self) -> checkpoint.Stateful:
        return checkpoint.Stateful(
            models=[models.unwrap_model(m, keep_autocast=True) for m in self._models],
            optimizers=self._optimizers,
            schedulers=self._schedulers,
            dataloaders=self._dataloaders,
            scaler=self.precision.scaler,
            custom=self._custom,
            layout=self._checkpoint_layout(),
            engine=self._deepspeed,
            device=self._xla.checkpoint_hooks() if self._xla is not None else None,
        )

    def _checkpoint_layout(self) -> str:
        if self._deepspeed is not None:
            return "deepspeed"
        if self.config.strategy != "fsdp" or self._xla is not None:  # FSDPv2: whole tensors
            return "plain"
        return "sharded" if self.config.fsdp.state_dict_type == "SHARDED_STATE_DICT" else "full"

    def save_state(self, output_dir: str | os.PathLike[str]) -> Path:
        """Save the whole training state atomically; every process must call it."""
        return checkpoint.save_state(
            output_dir,
            self._stateful(),
            rank=self.state.rank,
            world_size=self.state.world_size,
            progress={"step": self.step, "cycle": self.gradients.micro_steps_in_cycle},
        )

    def load_state(self, input_dir: str | os.PathLike[str]) -> None:
        """Restore what ``save_state`` wrote, so training continues exactly."""
        progress = checkpoint.load_state(
            input_dir, self._stateful(), rank=self.state.rank, world_size=self.state.world_size
        )
        self.step = progress["step"]
        self.gradients.micro_steps_in_cycle = progress["cycle"]
