"""``TrainingStep``: the Accelerator's backward pass, gradient-sync control, autocast and
clipping — what happens inside one (micro-)step, for every backend through its strategy.

Clipping a partial accumulation sum is meaningless (and would unscale fp16 gradients twice),
so the clipping members do nothing while gradients accumulate. DeepSpeed's engine clips by its
own config; XLA replicas all-reduce their gradients before clipping, so every replica clips
the same sum.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from nbaccel.accel import lomo
from nbaccel.accel.optim import AcceleratedOptimizer, GradientState
from nbaccel.accel.preparation import Prepared
from nbaccel.accel.strategies import ddp_controls
from nbaccel.accel.tracking.step_timing import BACKWARD, OPTIMIZER


class TrainingStep:
    """The step members of one Accelerator (the facade forwards them by name)."""

    def __init__(
        self, prepared: Prepared, gradient_state: GradientState, max_grad_norm: float | None
    ) -> None:
        self.prepared = prepared
        self.strategy = prepared.strategy
        self.gradient_state = gradient_state
        self.max_grad_norm = max_grad_norm
        self.lomo_set: bool | None = None

    @property
    def has_lomo_optimizer(self) -> bool:
        """Whether a LOMO / AdaLomo optimizer was prepared (its backward also steps)."""
        if self.lomo_set is not None:  # assigned, as Accelerate's attribute can be
            return self.lomo_set
        return any(lomo.is_lomo_optimizer(o) for o in self.prepared.optimizers)

    @has_lomo_optimizer.setter
    def has_lomo_optimizer(self, value: bool) -> None:
        self.lomo_set = value

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled for fp16 (with a
        LOMO optimizer and ``learning_rate=``: its fused backward, which also steps)."""
        learning_rate = kwargs.pop("learning_rate", None)
        if learning_rate is not None and self.has_lomo_optimizer:
            steps = self.gradient_state.accumulation_steps
            self.lomo_backward(loss / steps if steps > 1 else loss, learning_rate)
            return
        timer = self.strategy.step_timer
        previous = timer.enter(BACKWARD)
        if previous is not None and timer.distributed and self.gradient_state.sync_gradients:
            timer.watch_reduction(loss)  # the end of backward waits for DDP's / FSDP's reduction
        try:
            self.strategy.backward(
                loss,
                accumulation_steps=self.gradient_state.accumulation_steps,
                scaler=self.prepared.precision.scaler,
                sync_gradients=self.gradient_state.sync_gradients,
                **kwargs,
            )
        finally:
            timer.leave(previous)

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """The fused backward-and-update of a prepared LOMO / AdaLomo optimizer."""
        lomo.lomo_backward(loss, learning_rate, self.prepared.optimizers)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Suspend the gradient reduction of a DDP or FSDP model (a no-op on one process)."""
        return self.strategy.no_sync(model)

    trigger_sync_in_backward = staticmethod(ddp_controls.trigger_sync_in_backward)

    def join_uneven_inputs(
        self, joinables: Sequence[Any], even_batches: bool | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Train on uneven inputs: ranks that run out of batches shadow the others' all-reduces
        (torch's ``Join``); ``even_batches`` overrides the prepared loaders' inside the block."""
        return ddp_controls.join_uneven_inputs(
            joinables,
            even_batches,
            distributed_type=self.strategy.distributed_type,
            num_processes=self.strategy.state.world_size,
            default_even_batches=self.prepared.even_batches,
            dataloaders=self.prepared.dataloaders,
        )

    def autocast(
        self, enabled: bool = True, autocast_handler: Any = None
    ) -> contextlib.AbstractContextManager[None]:
        """Autocast for the configured precision, for code outside the model's forward;
        ``autocast_handler`` (an ``AutocastKwargs``) overrides the Accelerator's."""
        handler = autocast_handler.to_kwargs() if autocast_handler is not None else {}
        return self.prepared.precision.autocast(enabled, **handler)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale the fp16 gradients of ``optimizer`` (default: every prepared one); once
        per step."""
        chosen = optimizer if isinstance(optimizer, list | tuple) else [optimizer]
        for prepared in self.prepared.optimizers:
            if optimizer is None or prepared in chosen:
                prepared.unscale_gradients()

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor | None:
        """Unscale, then clip the gradients' total norm; None while accumulating."""
        if not self.gradient_state.sync_gradients:
            return None  # clipping a partial sum is meaningless (and would unscale twice)
        previous = self.strategy.step_timer.enter(OPTIMIZER)  # clipping: the optimizer's part
        try:
            if not self.strategy.clips_in_engine:
                self._reduce_and_unscale()
            return self.strategy.clip_grad_norm_(list(parameters), max_norm, norm_type)
        finally:
            self.strategy.step_timer.leave(previous)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Unscale, then clamp each gradient to ``[-clip_value, clip_value]``."""
        if not self.gradient_state.sync_gradients:
            return
        self._reduce_and_unscale()
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

    def _reduce_and_unscale(self) -> None:
        # XLA replicas all-reduce before clipping, so every replica clips the same sum.
        for optimizer in self.prepared.optimizers:
            optimizer.reduce_gradients()
        self.unscale_gradients()
        for optimizer in self.prepared.optimizers:
            optimizer.clipped = True

    def config_clip(self, optimizer: AcceleratedOptimizer) -> None:
        # max_grad_norm from the config: clipped inside each optimizer step.
        optimizer.reduce_gradients()
        optimizer.unscale_gradients()
        assert self.max_grad_norm is not None
        torch.nn.utils.clip_grad_norm_(list(optimizer.parameters()), self.max_grad_norm)
