"""``Checkpoints``: the Accelerator's saving and loading part.

``save_state`` / ``load_state`` cover everything prepared (models, optimizers, schedulers,
dataloader positions, the loss scaler, RNG states) plus what was registered; the strategy
decides the layout (whole state dicts, FSDP's DCP shards, DeepSpeed's own folder) and, on
XLA, the device copies and barriers. The work is done by ``checkpoint`` (folders, atomically)
and ``sharded_checkpoint`` (DCP).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nbaccel.accel import checkpoint
from nbaccel.accel.optim import GradientState
from nbaccel.accel.preparation import Prepared
from nbaccel.config.accelerator_configs import ProjectConfiguration

# Accelerate's hook signatures: save(models, weights, output_dir), load(models, input_dir).
SaveHook = Callable[[list[torch.nn.Module], list[dict[str, Any]], str], None]
LoadHook = Callable[[list[torch.nn.Module], str], None]


class Checkpoints:
    """save_state, load_state and what they cover, for one Accelerator."""

    def __init__(
        self, prepared: Prepared, gradients: GradientState, project: ProjectConfiguration
    ) -> None:
        self.prepared = prepared
        self.gradients = gradients
        self.project = project  # automatic_checkpoint_naming, total_limit, iteration
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

    def save(self, output_dir: str | os.PathLike[str] | None) -> Path:
        state = self.prepared.strategy.state
        if output_dir is None:
            output_dir = self._next_automatic_folder()
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

    def load(self, input_dir: str | os.PathLike[str] | None) -> None:
        state = self.prepared.strategy.state
        if input_dir is None:
            input_dir = self._newest_automatic_folder()
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

    # -- Accelerate's automatic checkpoint naming (ProjectConfiguration) -------------------
    def _automatic_root(self) -> Path:
        if not self.project.automatic_checkpoint_naming or self.project.project_dir is None:
            raise ValueError(
                "save_state()/load_state() without a folder need "
                "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True) in "
                "Accelerator(project_config=...); or pass the folder."
            )
        return Path(self.project.project_dir) / "checkpoints"

    def _numbered(self) -> list[Path]:
        root = self._automatic_root()
        found = [p for p in root.glob("checkpoint_*") if p.name.split("_")[-1].isdigit()]
        return sorted(found, key=lambda p: int(p.name.split("_")[-1]))

    def _next_automatic_folder(self) -> Path:
        folder = self._automatic_root() / f"checkpoint_{self.project.iteration}"
        if folder.exists():
            raise ValueError(
                f"save_state: {folder} already exists; automatic naming never overwrites. "
                "Set accelerator.project_configuration.iteration past it, or remove it."
            )
        existing = self._numbered()
        limit = self.project.total_limit
        if limit is not None and self.prepared.strategy.state.is_main_process:
            for old in existing[: max(0, len(existing) + 1 - limit)]:  # as Accelerate prunes
                shutil.rmtree(old, ignore_errors=True)
        self.project.iteration += 1
        return folder

    def _newest_automatic_folder(self) -> Path:
        numbered = self._numbered()
        if not numbered:
            raise ValueError(
                f"load_state: no checkpoint_<n> folder under {self._automatic_root()} to load."
            )
        return numbered[-1]
