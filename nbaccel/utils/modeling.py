"""Creating models without allocating their weights: ``init_empty_weights``, ``init_on_device``.

Under ``init_empty_weights()`` every parameter a module registers lands on the ``meta``
device (shapes and dtypes, no memory), so a model of any size is built in no time; load real
weights afterwards (``load_state_dict(..., assign=True)``, ``model.to_empty(device=...)``
then a checkpoint). Buffers stay real by default, because many are computed at construction
(position tables, norms' running statistics) and would be lost on ``meta``;
``include_buffers=True`` puts every tensor created in the block on the device instead.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["init_empty_weights", "init_on_device"]

_TRUE = ("1", "true", "yes", "y", "on", "t")


def _include_buffers(include_buffers: bool | None) -> bool:
    # As Accelerate: unset means its ACCELERATE_INIT_INCLUDE_BUFFERS variable (read only).
    if include_buffers is not None:
        return include_buffers
    return os.environ.get("ACCELERATE_INIT_INCLUDE_BUFFERS", "").strip().lower() in _TRUE


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Build models inside the block with their parameters on the ``meta`` device.

    >>> with init_empty_weights():
    ...     layer = nn.BatchNorm1d(4)
    >>> layer.weight.device.type, layer.running_mean.device.type
    ('meta', 'cpu')
    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


@contextlib.contextmanager
def init_on_device(
    device: torch.device | str, include_buffers: bool | None = None
) -> Iterator[None]:
    """Build models inside the block with their parameters on ``device`` (and, with
    ``include_buffers``, every tensor created in the block).

    >>> with init_on_device("meta"):
    ...     layer = nn.Linear(3, 2)
    >>> layer.weight.is_meta, layer.weight.requires_grad
    (True, True)
    """
    device = torch.device(device)
    if _include_buffers(include_buffers):
        with device:  # torch's default-device context: every factory call lands there
            yield
        return
    # Parameters are created where torch puts them by default, then moved as they are
    # registered: the one place every module's parameters pass through.
    registered = nn.Module.register_parameter

    def register_on_device(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        registered(module, name, param)
        if param is not None:
            module._parameters[name] = _moved(module._parameters[name], device)

    setattr(nn.Module, "register_parameter", register_on_device)  # noqa: B010
    try:
        yield
    finally:
        setattr(nn.Module, "register_parameter", registered)  # noqa: B010


def _moved(param: Any, device: torch.device) -> nn.Parameter:
    """``param`` on ``device``, of the same Parameter class with the same attributes."""
    attributes = dict(param.__dict__)
    # transformers marks initialised weights with this; it is no constructor argument.
    initialised = attributes.pop("_is_hf_initialized", None)
    moved: nn.Parameter = type(param)(
        param.to(device), requires_grad=param.requires_grad, **attributes
    )
    if initialised is not None:
        moved._is_hf_initialized = initialised  # type: ignore[attr-defined]
    return moved
