"""Accelerate's module-level collectives (``accelerate.utils.gather``, ``broadcast``, ...).

Each takes a tensor or (nested) lists, tuples and dicts of tensors and returns the same
structure. With one process they hand the data back as Accelerate does (``gather`` returns
its input); over torch.distributed they use the default process group, and in a process that
trains through torch_xla they go through the XLA strategy's collectives. They need no
``Accelerator``: the process group, or the torch_xla runtime, is all they use.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from nbaccel.accel.nested import collectives
from nbaccel.accel.nested.collectives import tree_map
from nbaccel.accel.partial_state import PartialState
from nbaccel.accel.state import DistributedType
from nbaccel.accel.strategies import Strategy

__all__ = [
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
    "send_to_device",
    "wait_for_everyone",
]


def _xla() -> Strategy | None:
    """The XLA strategy when this process trains through torch_xla, else None."""
    # An XLA run has imported torch_xla before any collective; importing it here would
    # initialise its runtime in processes that never use it.
    if "torch_xla" not in sys.modules:
        return None
    state = PartialState()
    return state.strategy if state.distributed_type is DistributedType.XLA else None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather(tensor: Any) -> Any:
    """Every process's tensors concatenated along dim 0 (0-d tensors become 1-d).

    >>> gather(torch.tensor([1, 2]))
    tensor([1, 2])
    """
    xla = _xla()
    if xla is not None:
        return xla.gather(tensor)
    return collectives.gather(tensor) if _distributed() else tensor


def gather_object(object: Any) -> Any:
    """Every process's picklable ``object``; lists (and tuples) are concatenated in rank
    order, other objects come back as a list with one entry per rank. One process: ``object``.

    >>> gather_object(["a"])
    ['a']
    """
    xla = _xla()
    if xla is not None:
        return xla.gather_object(object)
    if not _distributed():
        return object
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, object)
    if all(isinstance(part, (list, tuple)) for part in parts):
        return [item for part in parts for item in part]
    return parts


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Process ``from_process``'s tensors on every process (in place over torch.distributed;
    every process passes tensors of the same shapes).

    >>> broadcast(torch.tensor([3.0]))
    tensor([3.])
    """
    xla = _xla()
    if xla is not None:
        return tree_map(lambda t: _xla_broadcast_one(xla, t, from_process), tensor)
    if not _distributed():
        return tensor

    def one(piece: torch.Tensor) -> torch.Tensor:
        dist.broadcast(piece, src=from_process)
        return piece

    return tree_map(one, tensor)


def _xla_broadcast_one(xla: Strategy, tensor: torch.Tensor, source: int) -> torch.Tensor:
    rows = 1 if tensor.dim() == 0 else tensor.shape[0]
    gathered: torch.Tensor = xla.gather(tensor)  # every rank's rows, rank after rank
    return gathered[source * rows : (source + 1) * rows].reshape(tensor.shape)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace ``object_list``'s items, on every process, by those of ``from_process``;
    returns the same list.

    >>> broadcast_object_list([1, "two"])
    [1, 'two']
    """
    xla = _xla()
    if xla is not None:
        state = xla.state
        mine = list(object_list) if state.rank == from_process else None
        object_list[:] = xla.gather_object([mine])[from_process]
    elif _distributed():
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Each tensor reduced over processes: ``"mean"`` (the default here, as in Accelerate's
    ``accelerate.utils.reduce``), ``"sum"``, ``"max"`` or ``"none"``; then times ``scale``.

    Unlike Accelerate, ``scale`` applies on every device (Accelerate applies it on XLA only),
    as ``Accelerator.reduce`` does in nbaccel.

    >>> reduce(torch.tensor([2.0, 4.0]), "max")
    tensor([2., 4.])
    """
    if reduction not in ("mean", "sum", "max", "none"):
        raise ValueError(
            f"reduction={reduction!r} is not one of 'mean', 'sum', 'max', 'none'. "
            "Pick one of those."
        )
    xla = _xla()
    if xla is not None and reduction != "max":
        return xla.reduce(tensor, reduction, scale)
    distributed = _distributed()

    def one(piece: torch.Tensor) -> torch.Tensor:
        out = piece.clone()
        if reduction == "none" or not (distributed or xla is not None):
            return out * scale if scale != 1.0 else out
        if xla is not None:  # the largest value: every rank's copy, then the maximum
            gathered = xla.gather(out.unsqueeze(0))
            out = gathered.amax(dim=0)
        else:
            op = dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM
            dist.all_reduce(out, op=op)
            if reduction == "mean":
                out = out / dist.get_world_size()
        return out * scale if scale != 1.0 else out

    return tree_map(one, tensor)


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    """Pad each tensor along ``dim`` to the largest size any process has, so it can be
    gathered; ``pad_index`` fills, at the end (or the start with ``pad_first``).

    >>> pad_across_processes(torch.ones(2)).shape
    torch.Size([2])
    """
    xla = _xla()
    if xla is not None:
        return xla.pad_across_processes(tensor, dim, pad_index, pad_first)
    return collectives.pad_across_processes(tensor, dim, pad_index, pad_first)


def send_to_device(
    tensor: Any,
    device: torch.device | str | int,
    non_blocking: bool = False,
    skip_keys: str | list[str] | None = None,
) -> Any:
    """Move every tensor (and every object with a ``.to``) in nested lists, tuples,
    namedtuples and mappings to ``device``; values under ``skip_keys`` stay where they are.

    >>> batch = {"x": torch.ones(1), "meta": torch.zeros(1)}
    >>> send_to_device(batch, "cpu", skip_keys="meta")["x"].device
    device(type='cpu')
    """
    if isinstance(tensor, torch.Tensor) or callable(getattr(tensor, "to", None)):
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:  # a .to() without non_blocking (e.g. some tokenizer outputs)
            return tensor.to(device)
    if isinstance(tensor, (list, tuple)):
        moved = [send_to_device(item, device, non_blocking, skip_keys) for item in tensor]
        if isinstance(tensor, tuple) and hasattr(tensor, "_fields"):  # a namedtuple
            return type(tensor)(*moved)
        return type(tensor)(moved)
    if isinstance(tensor, Mapping):
        skipped = [skip_keys] if isinstance(skip_keys, str) else (skip_keys or [])
        return type(tensor)(  # type: ignore[call-arg]  # the mapping's own class, as given
            {
                key: value
                if key in skipped
                else send_to_device(value, device, non_blocking, skip_keys)
                for key, value in tensor.items()
            }
        )
    return tensor


def wait_for_everyone() -> None:
    """A barrier over every process (returns at once with one process)."""
    xla = _xla()
    if xla is not None:
        xla.barrier()
    elif _distributed():
        dist.barrier()
