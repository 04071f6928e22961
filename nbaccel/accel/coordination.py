"""Collectives and process coordination: the Accelerator members that talk across ranks.

A base class of ``Accelerator``, split out to keep modules small; it needs only the
process state, the gradient state (which says whether a dataloader is at its last, padded
batch) and, on XLA devices, the ``XlaRuntime`` whose collectives replace torch.distributed's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from nbaccel.accel import collectives
from nbaccel.accel.optim import GradientState
from nbaccel.accel.state import ProcessState

if TYPE_CHECKING:
    from nbaccel.accel.xla import XlaRuntime

F = TypeVar("F", bound=Callable[..., Any])


class ProcessCoordination:
    """gather, reduce, padding, barriers and main-process helpers for one process."""

    state: ProcessState
    gradients: GradientState
    _xla: XlaRuntime | None

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    def gather(self, tensor: Any) -> Any:
        """Every rank's tensors concatenated along dim 0."""
        if self._xla is not None:
            return self._xla.gather(tensor)
        return collectives.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Like ``gather``, minus the samples repeated to even out the last batch."""
        as_objects = use_gather_object or not _holds_tensors(input_data)
        if as_objects:
            xla = self._xla
            gather_object = xla.gather_object if xla is not None else collectives.gather_object
            data: Any = gather_object(input_data)
        else:
            data = self.gather(input_data)
        if self.gradients.end_of_dataloader and self.gradients.remainder >= 0:
            # Gathered objects are one list (cut the list); tensors are cut row-wise.
            keep = self.gradients.remainder
            data = data[:keep] if as_objects else collectives.truncate(data, keep)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sum or average tensors over ranks."""
        if self._xla is not None:
            return self._xla.reduce(tensor, reduction, scale)
        return collectives.reduce(tensor, reduction, scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Pad tensors along ``dim`` to the largest size on any rank."""
        if self._xla is not None:
            return self._xla.pad_across_processes(tensor, dim, pad_index, pad_first)
        return collectives.pad_across_processes(tensor, dim, pad_index, pad_first)

    def wait_for_everyone(self) -> None:
        """A barrier across all processes."""
        if self._xla is not None:
            self._xla.barrier()
        elif self.use_distributed:
            dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. downloads), then the others."""
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    def on_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on rank 0 only (None elsewhere)."""

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_main_process else None

        return wrapper  # type: ignore[return-value]

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)


def _holds_tensors(data: Any) -> bool:
    try:
        collectives.tree_map(lambda t: t, data)
    except TypeError:
        return False
    return True
