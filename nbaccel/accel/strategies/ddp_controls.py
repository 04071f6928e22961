"""Accelerate's members that reach into DDP itself: ``join_uneven_inputs`` and
``trigger_sync_in_backward``.

``join_uneven_inputs(joinables, even_batches=None)`` wraps torch's ``Join`` so that ranks
with different numbers of batches finish a DDP epoch without hanging: a rank that ran out
shadows the others' all-reduces. As in Accelerate:

- ``even_batches`` (if given) overrides the Accelerator's for the prepared map-style loaders
  while the block runs and is restored after; iterable loaders cannot change (a warning says
  so). ``Join`` is enabled only when batches are uneven (``even_batches`` false): with even
  batches there is nothing to shadow.
- The joinables must be torch ``Joinable`` s: DDP models (and ``ZeroRedundancyOptimizer``).
- It does nothing on one process, and under FSDP, DeepSpeed or XLA it warns and does nothing
  (torch's Join covers DDP only).

Where nbaccel differs: Accelerate joins only on GPUs (its ``multi_device`` leaves out
``MULTI_CPU``) and ignores the call on CPU processes, with a warning; nbaccel joins for
``MULTI_CPU`` too, since gloo's DDP supports ``Join``, so a loop debugged on CPU behaves as it
will on GPUs.

``trigger_sync_in_backward(model)`` makes the next backward of a DDP model all-reduce even
though its forward ran under ``no_sync`` (Accelerate's recipe: two forwards under ``no_sync``,
the first backward without sync, the second inside this block with it). On anything but a DDP
model it does nothing, as in Accelerate: FSDP2 decides to reduce at backward time, so a
backward outside ``no_sync`` syncs already.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.algorithms.join import Join, Joinable
from torch.nn.parallel import DistributedDataParallel

from nbaccel.accel.state import DistributedType

_JOINING_TYPES = (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)


@contextlib.contextmanager
def join_uneven_inputs(
    joinables: Sequence[Any],
    even_batches: bool | None = None,
    *,
    distributed_type: DistributedType,
    num_processes: int,
    default_even_batches: bool,
    dataloaders: Sequence[Any] = (),
) -> Iterator[None]:
    """Run the block under torch's ``Join`` (see the module docstring).

    ``default_even_batches`` is the Accelerator's ``even_batches``; ``dataloaders`` are the
    loaders it prepared (those with a ``plan``, i.e. map-style, get the override).

    >>> with join_uneven_inputs([], distributed_type=DistributedType.NO, num_processes=1,
    ...                         default_even_batches=True):
    ...     print("one process: nothing to join")
    one process: nothing to join
    """
    if num_processes <= 1 or distributed_type not in _JOINING_TYPES:
        if distributed_type is not DistributedType.NO:
            warnings.warn(
                f"join_uneven_inputs has no effect under {distributed_type.value}: torch's Join "
                "shadows the collectives of DDP only (MULTI_GPU, MULTI_CPU). Keep "
                "even_batches=True (the default) so that every rank gets as many batches.",
                stacklevel=3,
            )
        yield
        return
    _check_joinable(joinables)
    restore: list[tuple[Any, bool]] = []
    if even_batches is None:
        even_batches = default_even_batches
    else:
        iterable_seen = False
        for loader in dataloaders:
            plan = getattr(loader, "plan", None)
            if plan is None or not hasattr(loader, "batch_sampler"):
                iterable_seen = True  # an iterable dataset's batches cannot be evened out
                continue
            restore.append((plan, plan.even_batches))
            plan.even_batches = even_batches
        if iterable_seen:
            warnings.warn(
                "join_uneven_inputs(even_batches=...) changes map-style dataloaders only; the "
                "prepared loaders over an IterableDataset keep their setting.",
                stacklevel=3,
            )
    try:
        with Join(list(joinables), enable=not even_batches, throw_on_early_termination=False):
            yield
    finally:
        for plan, value in restore:
            plan.even_batches = value


def _check_joinable(joinables: Sequence[Any]) -> None:
    if not joinables:
        raise ValueError(
            "join_uneven_inputs got no joinables. Pass the prepared DDP model(s): "
            "accelerator.join_uneven_inputs([model], even_batches=False)."
        )
    for index, item in enumerate(joinables):
        if not isinstance(item, Joinable):
            raise TypeError(
                f"join_uneven_inputs: joinables[{index}] is a {type(item).__name__}, which torch's "
                "Join cannot shadow: it joins DDP models (and ZeroRedundancyOptimizer). Pass the "
                "model that accelerator.prepare returned, not the optimizer or the unwrapped "
                "model."
            )


@contextlib.contextmanager
def trigger_sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
    """Make the next backward of a DDP ``model`` all-reduce, even after a ``no_sync`` forward.

    Not a DDP model (one process, FSDP, a plain module): does nothing, as in Accelerate.

    >>> with trigger_sync_in_backward(torch.nn.Linear(2, 2)):
    ...     print("not DDP: nothing to trigger")
    not DDP: nothing to trigger
    """
    if not isinstance(model, DistributedDataParallel):
        yield
        return
    backward_sync, forward_sync = model.require_backward_grad_sync, model.require_forward_param_sync
    # DDP decides at forward time whether the coming backward reduces; the forward that ran
    # under no_sync did not prepare the reducer, so prepare it here for every bucket (an
    # empty list of outputs: no unused-parameter search).
    model.require_backward_grad_sync = True
    model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync = backward_sync
        model.require_forward_param_sync = forward_sync
