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
from typing import IO, Any

import torch

from nbaccel.accel.checkpoints import checkpoint, saving
from nbaccel.accel.optim import GradientState
from nbaccel.accel.preparation import Prepared
from nbaccel.config.accelerate.configs import ProjectConfiguration

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

    # -- Accelerate's members (the Accelerator forwards them by name) ---------------------
    def save_state(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> Path:
        """Save the whole training state atomically; every process must call it.

        Models, optimizers, schedulers, dataloader positions, the loss scaler, every rank's
        RNG states and registered objects, in the strategy's layout. Without ``output_dir``:
        ``project_dir/checkpoints/checkpoint_<n>`` when the ``ProjectConfiguration`` has
        ``automatic_checkpoint_naming`` (keeping its ``total_limit`` newest). nbaccel's files
        are its own layout (``safe_serialization`` does not change them).
        """
        _no_extra_arguments("save_state", save_model_func_kwargs)
        return self.save_folder(output_dir)

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        **load_model_func_kwargs: Any,
    ) -> None:
        """Restore what ``save_state`` wrote, so training continues exactly (without
        ``input_dir``: the newest automatically named checkpoint)."""
        _no_extra_arguments("load_state", {**(load_kwargs or {}), **load_model_func_kwargs})
        self.load_folder(input_dir)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include objects with ``state_dict``/``load_state_dict`` in save/load_state."""
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"register_for_checkpointing: {type(obj).__name__} has no state_dict() "
                    "and load_state_dict(); only such objects can be checkpointed."
                )
        self.prepared.custom.extend(objects)

    def register_save_state_pre_hook(self, hook: SaveHook) -> RemovableHook:
        """Call ``hook(models, weights, output_dir)`` before each ``save_state``; popping an
        entry of ``weights`` leaves that model out. Returns a handle with ``remove()``."""
        self.save_hooks.append(hook)
        return RemovableHook(self.save_hooks, hook)

    def register_load_state_pre_hook(self, hook: LoadHook) -> RemovableHook:
        """Call ``hook(models, input_dir)`` before each ``load_state``; popping a model from
        ``models`` leaves it unloaded. Returns a handle with ``remove()``."""
        self.load_hooks.append(hook)
        return RemovableHook(self.load_hooks, hook)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The model's whole state dict as plain tensors, gathered from the shards of FSDP
        or ZeRO-3 (every rank must call it then; rank 0 gets the weights, the others ``{}``).
        ``unwrap=False`` keeps the wrapper's keys (``module.`` under DDP) when unsharded."""
        strategy = self.prepared.strategy
        strategy.before_save()
        if not unwrap and strategy.checkpoint_layout == "plain":
            return dict(model.state_dict())
        return strategy.full_state_dict(model)

    def save(
        self, obj: Any, f: str | os.PathLike[str] | IO[bytes], safe_serialization: bool = False
    ) -> None:
        """``torch.save`` (or safetensors) from the process that writes: the main one, or each
        machine's with ``save_on_each_node``. Fits ``save_pretrained(save_function=...)``."""
        state = self.prepared.strategy.state
        saving.save(
            obj,
            f,
            is_main_process=state.is_main_process,
            is_local_main_process=state.is_local_main_process,
            save_on_each_node=self.project.save_on_each_node,
            safe_serialization=safe_serialization,
        )

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the consolidated weights under ``save_directory`` from rank 0:
        ``model.safetensors`` (``pytorch_model.bin`` with ``safe_serialization=False``), or
        numbered shards of at most ``max_shard_size`` with an index, as Accelerate does."""
        strategy = self.prepared.strategy
        strategy.before_save()
        strategy.save_model(
            model,
            Path(save_directory),
            strategy.state.is_main_process,
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
        )
        strategy.barrier()

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

    def save_folder(self, output_dir: str | os.PathLike[str] | None) -> Path:
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
            progress=self.progress(),
        )

    def progress(self) -> dict[str, int]:
        """The counters a checkpoint keeps beside the objects."""
        return {
            "step": self.step,
            "cycle": self.gradients.micro_steps_in_cycle,
            "completed_steps": self.gradients.completed_steps,
            "completed_epochs": self.gradients.completed_epochs,
        }

    def load_folder(self, input_dir: str | os.PathLike[str] | None) -> None:
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
        self.gradients.completed_steps = progress.get("completed_steps", 0)
        self.gradients.completed_epochs = progress.get("completed_epochs", 0)

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
        """``checkpoint_<iteration>``, decided by rank 0 alone and shared with the others.

        Decided once: rank 0 creates the folder as soon as it starts saving, so a slower rank
        that looked on its own would find it there and refuse (a race seen in one of two
        runs). Rank 0 also prunes past ``total_limit``, as Accelerate's main process does.
        """
        root = self._automatic_root()
        strategy = self.prepared.strategy
        taken = -1  # what rank 0 shares when the folder exists: every rank refuses alike
        decided = self.project.iteration
        if strategy.state.is_main_process:
            if (root / f"checkpoint_{decided}").exists():
                decided = taken
            else:
                existing = self._numbered()
                limit = self.project.total_limit
                keep_from = len(existing) + 1 - limit if limit is not None else 0
                for old in existing[: max(0, keep_from)]:
                    shutil.rmtree(old, ignore_errors=True)
        decided = strategy.share(decided)
        if decided == taken:
            raise ValueError(
                f"save_state: {root / f'checkpoint_{self.project.iteration}'} already exists; "
                "automatic naming never overwrites. Set "
                "accelerator.project_configuration.iteration past it, or remove it."
            )
        self.project.iteration = decided + 1
        return root / f"checkpoint_{decided}"

    def _newest_automatic_folder(self) -> Path:
        numbered = self._numbered()
        if not numbered:
            raise ValueError(
                f"load_state: no checkpoint_<n> folder under {self._automatic_root()} to load."
            )
        return numbered[-1]


class RemovableHook:
    """What ``register_*_pre_hook`` returns: ``.remove()`` takes the hook out again."""

    def __init__(self, hooks: list[Any], hook: Callable[..., Any]) -> None:
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


def _no_extra_arguments(member: str, given: dict[str, Any]) -> None:
    if given:
        raise NotImplementedError(
            f"{member}({', '.join(given)}=...): Accelerate passes those keywords to its "
            "model-file writer and reader (safetensors/torch.save of each model); nbaccel "
            "checkpoints are its own atomic layout (docs/accelerator.md) and take none. Drop "
            "the keywords."
        )
