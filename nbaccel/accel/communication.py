"""``Communication``: the Accelerator's members that talk across ranks — gathers, reductions,
padding, and the trigger one rank raises for all — each through the backend's strategy.
"""

from __future__ import annotations

from typing import Any

from nbaccel.accel.nested import collectives
from nbaccel.accel.optim import GradientState
from nbaccel.accel.strategies import Strategy
from nbaccel.accel.trigger import TriggerFlag


class Communication:
    """The collective members of one Accelerator (the facade forwards them by name)."""

    def __init__(self, strategy: Strategy, gradient_state: GradientState) -> None:
        self.strategy = strategy
        self.gradient_state = gradient_state
        self.trigger = TriggerFlag(strategy.state.device, self.reduce)

    def gather(self, tensor: Any) -> Any:
        """Every rank's tensors concatenated along dim 0."""
        return self.strategy.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Like ``gather``, minus the samples repeated to even out the last batch."""
        as_objects = use_gather_object or not collectives.holds_tensors(input_data)
        data = self.strategy.gather_object(input_data) if as_objects else self.gather(input_data)
        grads = self.gradient_state
        if grads.end_of_dataloader and grads.remainder >= 0:
            # Gathered objects are one list (cut the list); tensors are cut row-wise.
            keep = grads.remainder
            data = data[:keep] if as_objects else collectives.truncate(data, keep)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sum or average tensors over ranks."""
        return self.strategy.reduce(tensor, reduction, scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Pad tensors along ``dim`` to the largest size on any rank."""
        return self.strategy.pad_across_processes(tensor, dim, pad_index, pad_first)

    def set_trigger(self) -> None:
        """Raise this rank's flag; ``check_trigger`` on every rank then returns True."""
        self.trigger.set()

    def check_trigger(self) -> bool:
        """True on every rank if any rank called ``set_trigger`` since the last check (a
        collective: call it on every rank); resets the flag."""
        return self.trigger.check()
