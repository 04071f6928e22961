"""Collated batches as prepared loaders handle them: moved to a device, measured, sliced.

A batch is what a DataLoader's collate function made: tensors, or lists, tuples,
namedtuples and dicts of them (other leaves ride along unchanged, as in Accelerate).
Slicing cuts every tensor along dim 0, which is how ``split_batches`` gives each rank its
part of a batch that was collated whole (an ``IterableDataset``'s, or one rank 0 sends).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nbaccel.accel.nested.collectives import tree_map


def send_to_device(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in nested lists, tuples, namedtuples and dicts to ``device``.

    ``non_blocking`` lets a copy from pinned memory overlap with computation (the
    DataLoaderConfiguration's ``non_blocking``); objects with their own ``.to`` (e.g.
    transformers' ``BatchEncoding``) get it too when they take it.

    >>> send_to_device({"x": [torch.ones(1)]}, torch.device("cpu"))["x"][0].device
    device(type='cpu')
    """

    def other(leaf: Any) -> Any:
        move = getattr(leaf, "to", None)
        if not callable(move):
            return leaf
        if not non_blocking:
            return move(device)
        try:
            return move(device, non_blocking=True)
        except TypeError:  # a .to(device) without the keyword
            return move(device)

    return tree_map(lambda t: t.to(device, non_blocking=non_blocking), data, other)


def batch_len(batch: Any) -> int:
    """Samples in a collated batch: dim 0 of its first tensor (1 without tensors).

    >>> batch_len({"ids": torch.zeros(3, 5)}), batch_len([torch.zeros(2)]), batch_len("text")
    (3, 2, 1)
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict) and batch:
        return batch_len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return batch_len(batch[0])
    return 1


def split_batch(batch: Any, world: int, *, last: bool) -> list[Any]:
    """``batch`` cut into ``world`` equal parts along dim 0, one per rank.

    The last batch of an epoch may be short: it is completed with its own first samples to
    a multiple of ``world`` (as the map-style loaders do); any other batch must divide.

    >>> [part.tolist() for part in split_batch(torch.arange(5), 2, last=True)]
    [[0, 1, 2], [3, 4, 0]]
    """
    size = batch_len(batch)
    if size % world:
        if not last:
            raise ValueError(
                f"split_batches=True splits each batch over the {world} processes, but a "
                f"batch has {size} samples, not a multiple of {world}. Use a batch size that "
                f"is a multiple of {world}, or split_batches=False."
            )
        wanted = math.ceil(size / world) * world

        def complete(t: torch.Tensor) -> torch.Tensor:
            repeats = math.ceil(wanted / max(size, 1))
            return torch.cat([t] * repeats)[:wanted] if t.dim() else t

        batch = tree_map(complete, batch, other=lambda leaf: leaf)
        size = wanted
    chunk = size // world

    def part(rank: int) -> Any:
        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[rank * chunk : (rank + 1) * chunk] if t.dim() else t

        return tree_map(cut, batch, other=lambda leaf: leaf)

    return [part(rank) for rank in range(world)]
