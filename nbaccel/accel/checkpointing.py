"""``Checkpoints``: the Accelerator's saving and loading part.

``save_state`` / ``load_state`` cover everything prepared (models, optimizers, schedulers,
dataloader positions, the loss scaler, RNG states) plus what was registered; the strategy
decides the layout (whole state dicts, FSDP's DCP shards, DeepSpeed's own folder) and, on
XLA, the device copies and barriers. The work is done by ``checkpoint`` (folders, atomically)
and ``sharded_checkpoint`` (DCP).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nbaccel.accel import checkpoint
from nbaccel.accel.optim import GradientState
from nbaccel.accel.preparation import Prepared

# Accelerate's hook signatures: save(models, weights, output_dir), load(models, input_dir).
SaveHook = Callable[[list[torch.nn.Module], list[dict[str, Any]], str], None]
LoadHook = Callable[[list[torch.nn.Module], str], None]


class Checkpoints:
    """save_state, load_state and what they cover, for one Accelerator."""

    def __init__(self, prepared: Prepared, gradients: GradientState) -> None:
        self.prepared = prepared
        self.gradients = gradients
        self.step = 0  # accumulate() calls so far: micro-steps (saved and restored)
        self.save_hooks: list[SaveHook] = []
        self.load_hooks: list[LoadHook] = []

    def register(self, objects: tuple[Any, ...]) -> None:
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"register_for_checkpointing: {type(obj).__name__} has no state_dict() "
                    "and load_state_dict(); only such objects can be checkpointed."
                )
        self.prepared.custom.extend(objects)

    def stateful(self, models: list[torch.nn.Module] | None = None) -> checkpoint.Stateful:
        prepared, strategy = self.prepared, self.prepared.strategy
        return checkpoint.Stateful(
            models=self.unwrapped() if models is None else models,
            optimizers=prepared.optimizers,
            schedulers=prepared.schedulers,
            dataloaders=prepared.dataloaders,
            scaler=prepared.precision.scaler,
            custom=prepared.custom,
            layout=strategy.checkpoint_layout,
            engine=strategy.checkpoint_engine,
            device=strategy.checkpoint_hooks(),
        )

    def unwrapped(self) -> list[torch.nn.Module]:
        unwrap = self.prepared.strategy.unwrap_model
        return [unwrap(m, keep_autocast=True, keep_compile=False) for m in self.prepared.models]

    def save(self, output_dir: str | os.PathLike[str]) -> Path:
        state = self.prepared.strategy.state
        models = self.unwrapped()
        if self.save_hooks:
            # Accelerate's contract: a hook may save some models its own way (say with
            # save_pretrained) and pop their entries from ``weights``; those are left out.
            weights = [dict(m.state_dict()) for m in models]
            kept = list(weights)
            for hook in self.save_hooks:
                hook(list(self.prepared.models), kept, os.fspath(output_dir))
            remaining = {id(w) for w in kept}
            models = [m for m, w in zip(models, weights, strict=True) if id(w) in remaining]
        return checkpoint.save_state(
            output_dir,
            self.stateful(models),
            rank=state.rank,
            world_size=state.world_size,
            progress={"step": self.step, "cycle": self.gradients.micro_steps_in_cycle},
        )

    def load(self, input_dir: str | os.PathLike[str]) -> None:
        state = self.prepared.strategy.state
        models = self.unwrapped()
        if self.load_hooks:
            # A hook that loaded some models itself pops them from ``models`` (Accelerate's
            # contract): only the models still listed are loaded here.
            listed = list(self.prepared.models)
            for hook in self.load_hooks:
                hook(listed, os.fspath(input_dir))
            remaining = {id(m) for m in listed}
            models = [
                u for m, u in zip(self.prepared.models, models, strict=True) if id(m) in remaining
            ]
        progress = checkpoint.load_state(
            input_dir, self.stateful(models), rank=state.rank, world_size=state.world_size
        )
        self.step = progress["step"]
        self.gradients.micro_steps_in_cycle = progress["cycle"]
