"""The optimizer and scheduler as ``prepare`` returns them: accumulation- and scaler-aware.

While gradients are being accumulated (``sync_gradients`` False) ``step`` and ``zero_grad``
do nothing, so the plain loop ``backward; step; zero_grad`` accumulates. With fp16 the step
goes through the GradScaler; a step it skips for inf/NaN gradients is recorded so that the
scheduler skips too. The scheduler steps only after a real optimizer step. On XLA devices
the step first all-reduces the gradients (``reduce``, once per step, before any clipping)
and is followed by ``after_step`` (a graph cut).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from nbaccel.accel.tracking.step_timing import OPTIMIZER, StepTimer, disabled_timer


@dataclass
class GradientState:
    """Accumulation state shared by one Accelerator's optimizers, schedulers and loaders.

    ``sync_with_dataloader`` (``GradientAccumulationPlugin``'s): the last batch of a prepared
    dataloader syncs and starts a new cycle, so an epoch never ends with gradients left over;
    False lets cycles run on across epochs, as in Accelerate.

    >>> grads = GradientState(accumulation_steps=3, sync_with_dataloader=False)
    >>> grads.end_of_dataloader = True
    >>> [grads.next_micro_step() for _ in range(4)]
    [False, False, True, False]
    """

    accumulation_steps: int = 1
    micro_steps_in_cycle: int = 0  # micro-steps since the last sync
    sync_gradients: bool = True
    end_of_dataloader: bool = False
    remainder: int = -1  # real samples in the last global batch, -1: not at the last batch
    sync_with_dataloader: bool = True
    # Optimizer steps taken (the first prepared optimizer's, counting those before a resume)
    # and passes over the first prepared dataloader finished: saved and restored, so a loop
    # written against them resumes unchanged.
    completed_steps: int = 0
    completed_epochs: int = 0

    def next_micro_step(self) -> bool:
        """Count one micro-step (``accumulate``) and decide whether it syncs: every
        ``accumulation_steps``-th, and the dataloader's last batch unless
        ``sync_with_dataloader`` is off. Sets and returns ``sync_gradients``."""
        self.micro_steps_in_cycle += 1
        at_end = self.sync_with_dataloader and self.end_of_dataloader
        self.sync_gradients = self.micro_steps_in_cycle >= self.accumulation_steps or at_end
        if self.sync_gradients:  # the next epoch (or cycle) starts a fresh count
            self.micro_steps_in_cycle = 0
        return self.sync_gradients


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer; a subclass so that LR schedulers accept it.

    It never calls ``Optimizer.__init__``: the wrapped optimizer owns ``param_groups``,
    ``state`` and ``defaults``, and these properties forward to it.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        gradients: GradientState,
        scaler: torch.amp.GradScaler | None,
        clip: Callable[[AcceleratedOptimizer], None] | None = None,
        reduce: Callable[[torch.optim.Optimizer], None] | None = None,
        after_step: Callable[[], None] | None = None,
        timer: StepTimer | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.timer = timer if timer is not None else disabled_timer()  # the step breakdown
        self.gradients = gradients
        self.scaler = scaler
        self._clip = clip
        self._reduce = reduce
        self._after_step = after_step
        self.reduced = False  # gradients all-reduced this step (XLA data parallel)
        self.step_was_skipped = False
        self.unscaled = False  # set when gradients were unscaled for clipping this step
        self.clipped = False
        self.counts_steps = False  # the first prepared optimizer counts completed_steps

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradients.sync_gradients:
            previous = self.timer.enter(OPTIMIZER)
            try:
                self.optimizer.zero_grad(set_to_none=set_to_none)
            finally:
                self.timer.leave(previous)

    def step(self, closure: Any = None) -> Any:
        if not self.gradients.sync_gradients:
            return None
        previous = self.timer.enter(OPTIMIZER)
        try:
            return self._take_step(closure)
        finally:
            self.timer.leave(previous)

    def _take_step(self, closure: Any) -> Any:
        self.reduce_gradients()
        if self._clip is not None and not self.clipped:
            self._clip(self)  # the config's max_grad_norm, unless the user clipped already
        result = None
        if self.scaler is None:
            result = self.optimizer.step(closure) if closure else self.optimizer.step()
            self.step_was_skipped = False
        else:
            scale = self.scaler.get_scale()
            result = (
                self.scaler.step(self.optimizer, closure)
                if closure
                else (self.scaler.step(self.optimizer))
            )
            self.scaler.update()
            # GradScaler lowers its scale exactly when it skipped the step for inf/NaN.
            self.step_was_skipped = self.scaler.get_scale() < scale
        self.unscaled = self.clipped = self.reduced = False
        if self.counts_steps:
            self.gradients.completed_steps += 1
        if self._after_step is not None:
            self._after_step()
        return result

    def reduce_gradients(self) -> None:
        """All-reduce this step's gradients once, where no wrapper does it (XLA replicas)."""
        if self._reduce is not None and not self.reduced:
            self._reduce(self.optimizer)
        self.reduced = True

    def unscale_gradients(self) -> None:
        """Unscale this optimizer's gradients once per step (before clipping)."""
        if self.scaler is not None and not self.unscaled:
            self.scaler.unscale_(self.optimizer)
        self.unscaled = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class AcceleratedScheduler:
    """Wraps an LR scheduler so it steps only when its optimizers really stepped.

    As in Hugging Face Accelerate, one optimizer step over N processes counts as N steps of
    the schedule: schedules are written in single-process steps (``len(dataloader)`` before
    ``prepare``), and each step now consumes N batches. ``split_batches=True`` steps once;
    ``step_scheduler_with_optimizer=False`` leaves every call to the scheduler alone.

    ``GradientAccumulationPlugin(adjust_scheduler=...)`` changes nothing here, with either
    value, and that is Accelerate 1.15's behaviour too: its scheduler only bumps the private
    ``_step_count`` on accumulating micro-steps when the flag is on, and the flag never is,
    since Accelerate reads it back from ``plugin.to_kwargs()``, which drops the default
    (True), while False means "do nothing". So the learning rate moves on optimizer steps
    only, and every schedule (``_step_count`` included) matches Accelerate's.
    """

    def __init__(
        self,
        scheduler: Any,
        optimizers: list[AcceleratedOptimizer],
        gradients: GradientState,
        steps_per_optimizer_step: int,
        follow_optimizer: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradients = gradients
        self.steps_per_optimizer_step = steps_per_optimizer_step
        self.follow_optimizer = follow_optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.follow_optimizer:  # step_scheduler_with_optimizer=False: every call
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradients.sync_gradients:
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return  # fp16 overflow: the optimizer did not move, neither does the schedule
        for _ in range(self.steps_per_optimizer_step):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past it
            if total is not None and self.scheduler.last_epoch >= total:
                return
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self) -> list[float]:
        return list(self.scheduler.get_last_lr())

    def __getattr__(self, name: str) -> Any:
        # Anything else (last_epoch, base_lrs, ...) is the wrapped scheduler's.
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
