"""Collectives over nested tensors: gather, reduce, pad_across_processes, gather_object.

Each accepts a tensor or lists, tuples and dicts of tensors, as Accelerate's do, and is a
no-op copy with one process. They work on gloo (CPU) and nccl (GPU): ``all_gather`` into a
list rather than ``all_gather_into_tensor``, which gloo lacks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def tree_map(
    function: Callable[[torch.Tensor], Any],
    data: Any,
    other: Callable[[Any], Any] | None = None,
) -> Any:
    """Apply ``function`` to every tensor in nested lists, tuples, namedtuples and dicts.

    Other leaves go to ``other``; without it they are an error (collectives need tensors).

    >>> tree_map(lambda t: t * 2, {"a": [torch.tensor(1)], "n": 3}, other=lambda x: x)
    {'a': [tensor(2)], 'n': 3}
    """
    if isinstance(data, torch.Tensor):
        return function(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(tree_map(function, d, other) for d in data))
    if isinstance(data, (list, tuple)):
        return type(data)(tree_map(function, d, other) for d in data)
    if isinstance(data, dict):
        return type(data)({k: tree_map(function, v, other) for k, v in data.items()})
    if other is not None:
        return other(data)
    raise TypeError(
        f"expected tensors or lists/tuples/dicts of tensors, got {type(data).__name__}. "
        "Convert it with torch.tensor(...), or use gather_for_metrics(..., "
        "use_gather_object=True) for arbitrary Python objects."
    )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather(data: Any) -> Any:
    """Concatenate each tensor from every rank along dim 0 (0-d tensors become 1-d).

    Shapes must match across ranks; when dim 0 may differ, ``pad_across_processes`` first.

    >>> gather(torch.tensor([1, 2]))
    tensor([1, 2])
    """

    def one(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
        if not _distributed():
            return tensor.clone()
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=0)

    return tree_map(one, data)


def gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; lists are concatenated.

    >>> gather_object([1, 2])
    [1, 2]
    """
    if not _distributed():
        return list(obj) if isinstance(obj, list) else [obj]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    if all(isinstance(p, list) for p in parts):
        return [item for part in parts for item in part]
    return parts


def reduce(data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """Sum (``"sum"``) or average (``"mean"``) each tensor over ranks; returns new tensors.

    >>> reduce(torch.tensor([2.0]), "mean")
    tensor([2.])
    """
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction={reduction!r} is not one of 'sum', 'mean', 'none'.")

    def one(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        if _distributed() and reduction != "none":
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
            if reduction == "mean":
                out = out / dist.get_world_size()
        return out * scale if scale != 1.0 else out

    return tree_map(one, data)


def pad_across_processes(
    data: Any,
    dim: int = 0,
    pad_index: int = 0,
    pad_first: bool = False,
    gather_sizes: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Any:
    """Pad each tensor along ``dim`` to the largest size any rank has, so it can be gathered.

    Sizes are exchanged with ``gather_sizes`` (default: ``gather`` over torch.distributed,
    when it has several ranks); without one there is nothing to pad to.

    >>> pad_across_processes(torch.ones(2)).shape
    torch.Size([2])
    """
    if gather_sizes is None and _distributed():
        gather_sizes = gather

    def one(tensor: torch.Tensor) -> torch.Tensor:
        if gather_sizes is None or tensor.dim() == 0 or dim >= tensor.dim():
            return tensor
        size = torch.tensor([tensor.shape[dim]], device=tensor.device)
        longest = int(gather_sizes(size).max())
        if longest == tensor.shape[dim]:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = longest
        out = tensor.new_full(shape, pad_index)
        start = longest - tensor.shape[dim] if pad_first else 0
        index = [slice(None)] * tensor.dim()
        index[dim] = slice(start, start + tensor.shape[dim])
        out[tuple(index)] = tensor
        return out

    return tree_map(one, data)


def truncate(data: Any, length: int) -> Any:
    """Keep the first ``length`` rows of every tensor (drops padded duplicates)."""
    return tree_map(lambda tensor: tensor[:length], data)


def holds_tensors(data: Any) -> bool:
    """Whether ``data`` is tensors in (nested) lists, tuples and dicts, as ``gather`` takes."""
    try:
        tree_map(lambda t: t, data)
    except TypeError:
        return False
    return True
