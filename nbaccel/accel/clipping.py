"""The Accelerator's gradient clipping: unscale first, clip only on syncing steps.

Clipping a partial accumulation sum is meaningless (and would unscale fp16 gradients twice),
so every member does nothing while gradients accumulate. FSDP's gradients are DTensors
(their norm is gathered to a plain tensor); DeepSpeed's engine clips by its own config. XLA
replicas all-reduce their gradients before clipping, so every replica clips the same sum.
"""

from __future__ import annotations

from typing import Any

import torch

from nbaccel.accel.deepspeed_engine import DeepSpeedRun
from nbaccel.accel.optim import AcceleratedOptimizer, GradientState
from nbaccel.config.schema import Config


class GradientClipping:
    """Base of ``Accelerator`` holding ``unscale_gradients`` and the ``clip_grad_*`` members."""

    config: Config
    gradients: GradientState
    _optimizers: list[AcceleratedOptimizer]
    _deepspeed: DeepSpeedRun | None

    def unscale_gradients(self) -> None:
        """Unscale the fp16 gradients of every prepared optimizer (once per step)."""
        for optimizer in self._optimizers:
            optimizer.unscale_gradients()

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor | None:
        """Unscale, then clip the gradients' total norm; None while accumulating."""
        if not self.gradients.sync_gradients:
            return None
        if self._deepspeed is not None:  # clipped by the engine (gradient_clipping)
            norm_seen = self._deepspeed.global_grad_norm()
            return None if norm_seen is None else torch.tensor(norm_seen)
        self._mark_clipped()
        norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type)
        # FSDP's gradients are DTensors and so is their norm; callers log a plain tensor.
        full = getattr(norm, "full_tensor", None)
        return full() if full is not None else norm

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Unscale, then clamp each gradient to ``[-clip_value, clip_value]``."""
        if not self.gradients.sync_gradients:
            return
        self._mark_clipped()
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

    def _mark_clipped(self) -> None:
        for optimizer in self._optimizers:
            optimizer.reduce_gradients()
        self.unscale_gradients()
        for optimizer in self._optimizers:
            optimizer.clipped = True

    def _config_clip(self, optimizer: AcceleratedOptimizer) -> None:
        optimizer.reduce_gradients()
        optimizer.unscale_gradients()
        assert self.config.max_grad_norm is not None
        torch.nn.utils.clip_grad_norm_(list(optimizer.parameters()), self.config.max_grad_norm)
