"""Splitting inputs between processes: the arithmetic behind ``split_between_processes``.

Accelerate's split exactly: ``divmod(length, processes)`` items each, the first ranks one
more; with padding every share has the longest share's length, filled with the last input.
A pure function of (inputs, rank, number of processes), so every rank's share is testable in
one process.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["split_for_process"]


def split_for_process(
    inputs: Any, index: int, count: int, apply_padding: bool, device: torch.device
) -> Any:
    """Process ``index``'s share of ``inputs`` split ``count`` ways (see
    ``PartialState.split_between_processes``).

    >>> split_for_process(list(range(5)), 1, 2, False, torch.device("cpu"))
    [3, 4]
    """
    if isinstance(inputs, dict):
        lengths = {len(value) for value in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(
                "split_between_processes got a dict whose values differ in length "
                f"({sorted(lengths)}); every value must have one length, the number of items."
            )
        length = lengths.pop() if lengths else 0
    else:
        length = len(inputs)
    per_process, extras = divmod(length, count)
    start = index * per_process + min(index, extras)
    stop = start + per_process + (1 if index < extras else 0)
    padded_length = per_process + (1 if extras else 0)
    cut = _Cut(start, stop, padded_length if apply_padding else None, device)
    return cut(inputs)


class _Cut:
    """One rank's slice ``[start, stop)`` of a value, padded to ``length`` when given."""

    def __init__(self, start: int, stop: int, length: int | None, device: torch.device):
        self.start, self.stop, self.length, self.device = start, stop, length, device

    def __call__(self, value: Any) -> Any:
        if isinstance(value, dict):
            return type(value)({key: self(item) for key, item in value.items()})
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, (list, tuple)):
            part = list(value[self.start : self.stop])
            if self.length is not None and len(part) < self.length:
                part += [value[-1]] * (self.length - len(part))
            return part if isinstance(value, list) else tuple(part)
        datasets = sys.modules.get("datasets")  # only when the user works with it
        if datasets is not None and isinstance(value, datasets.Dataset):
            last = len(value)
            rows = list(range(min(self.start, last), min(self.stop, last)))
            if self.length is not None:
                rows += [last - 1] * (self.length - len(rows))
            return value.select(rows)
        return value  # Accelerate hands other values (strings, numbers) over whole

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        part = tensor[self.start : self.stop]
        if self.length is None:
            return part
        part = part.to(self.device)
        missing = self.length - part.shape[0]
        if missing <= 0:
            return part
        last = tensor[-1:].to(self.device).expand(missing, *tensor.shape[1:])
        return torch.cat([part, last])
