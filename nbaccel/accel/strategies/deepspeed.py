"""DeepSpeed: one engine built from the model, its optimizer and scheduler (ZeRO 1-3).

As in Accelerate, the model, optimizer, scheduler and training dataloader come in one
``prepare`` call (DeepSpeed needs the per-process batch size for its config). The engine
divides the loss over accumulation steps, scales it, clips by ``gradient_clipping`` and
steps; checkpoints are DeepSpeed's own folder layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nbaccel.accel.precision import Precision
from nbaccel.accel.strategies.data_parallel import DataParallel
from nbaccel.accel.strategies.deepspeed_engine import DeepSpeedRun
from nbaccel.accel.strategies.deepspeed_prepare import prepare_deepspeed
from nbaccel.config.deepspeed.settings import mixed_precision_of


class DeepSpeed(DataParallel):
    """``strategy='deepspeed'``: the engine of ``config.deepspeed`` (or its config file)."""

    name = "deepspeed"
    run: DeepSpeedRun | None = None
    # The DeepSpeed config the engine was built with (``auto`` values filled).
    ds_config: dict[str, Any] | None = None

    def make_precision(self, mode: str, **options: Any) -> Precision:
        if self.ds_config is not None:  # a DeepSpeed config file may choose the precision
            mode = mixed_precision_of(self.ds_config, mode)
        return Precision(mode, self.state.device, engine_scales=True, **options)

    def prepare_engine(
        self, objects: list[Any], kinds: list[str], **options: Any
    ) -> dict[int, Any]:
        replaced, self.run, self.ds_config = prepare_deepspeed(
            objects,
            kinds,
            config=self.config,
            given=self.options.deepspeed_config,  # DeepSpeedPlugin(hf_ds_config={...})
            world_size=self.state.world_size,
            **options,
        )
        return replaced

    @property
    def engine(self) -> Any:
        return None if self.run is None else self.run.engine

    @property
    def checkpoint_engine(self) -> Any:
        return self.run

    @property
    def accumulation_steps(self) -> int | None:
        """The engine's accumulation steps (a DeepSpeed config file may set them)."""
        if self.ds_config is None:
            return None
        return int(self.ds_config["gradient_accumulation_steps"])

    def prepare_model(
        self,
        model: torch.nn.Module,
        precision: Precision,
        *,
        device_placement: bool,
        ddp_kwargs: dict[str, Any],
    ) -> tuple[torch.nn.Module, dict[int, torch.nn.Parameter]]:
        return model, {}  # the engine (prepare_engine) is the prepared model

    def backward(
        self,
        loss: torch.Tensor,
        *,
        accumulation_steps: int,
        scaler: torch.amp.GradScaler | None,
        sync_gradients: bool,
        **kwargs: Any,
    ) -> None:
        self._run().backward(loss, sync_gradients=sync_gradients, **kwargs)

    @property
    def clips_in_engine(self) -> bool:
        return True

    def clip_grad_norm_(
        self, parameters: list[torch.nn.Parameter], max_norm: float, norm_type: float
    ) -> torch.Tensor | None:
        # Clipped by the engine (gradient_clipping); report the norm it saw.
        seen = self._run().global_grad_norm()
        return None if seen is None else torch.tensor(seen)

    def unwrap_model(
        self, model: torch.nn.Module, keep_autocast: bool, keep_compile: bool
    ) -> torch.nn.Module:
        if self.run is not None and model is self.run.engine:
            inner: Any = self.run.engine.module
            return inner  # type: ignore[no-any-return]
        return super().unwrap_model(model, keep_autocast, keep_compile)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        # get_state_dict: Accelerate's meaning (the module's training-dtype weights on every
        # rank at ZeRO 0-2; stage 3 gathers, and every rank must call). save_model writes the
        # fp32 master copy instead (DeepSpeedRun.save_model).
        return self._run().accelerate_state_dict()

    def save_model(
        self,
        model: torch.nn.Module,
        directory: Path,
        is_main: bool,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        if max_shard_size != "10GB" or not safe_serialization:
            raise NotImplementedError(
                "save_model under DeepSpeed writes one model.safetensors through the engine's "
                "own gathering; max_shard_size and safe_serialization=False are not supported "
                "there yet. Call accelerator.get_state_dict(model) and save it yourself."
            )
        self._run().save_model(directory)

    @property
    def checkpoint_layout(self) -> str:
        return "deepspeed"

    def _run(self) -> DeepSpeedRun:
        if self.run is None:
            raise RuntimeError(
                "strategy='deepspeed' builds its engine in prepare(): call "
                "accelerator.prepare(model, optimizer, ...) before backward, clipping or saving."
            )
        return self.run
