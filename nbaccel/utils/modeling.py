"""Creating models without allocating their weights (``init_empty_weights``,
``init_on_device``), and getting a model back out of its wrappers
(``extract_model_from_parallel``).

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
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from nbaccel.accel.strategies.models import unwrap_model

__all__ = ["extract_model_from_parallel", "init_empty_weights", "init_on_device"]

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


def extract_model_from_parallel(
    model: nn.Module,
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = True,
    recursive: bool = False,
) -> nn.Module:
    """The model inside its distributed wrappers, as ``Accelerator.unwrap_model`` gives it.

    Peels DDP, ``DataParallel``, FSDP1, torch_xla's FSDPv2 and DeepSpeed's engine. With
    ``keep_fp32_wrapper=False`` the forward ``prepare`` ran in autocast is restored (and the
    module is changed in place, as in Accelerate); with ``keep_torch_compile=False`` the
    ``torch.compile`` wrapper goes too. ``recursive=True`` also replaces every submodule that
    wraps another as ``.module`` by the wrapped one.

    >>> inner = nn.Linear(2, 2)
    >>> extract_model_from_parallel(nn.DataParallel(inner)) is inner
    True
    >>> compiled = torch.compile(inner)
    >>> extract_model_from_parallel(compiled) is compiled
    True
    >>> extract_model_from_parallel(compiled, keep_torch_compile=False) is inner
    True
    """
    # torch.compile around the wrappers (compile(DDP(m)), as Accelerate builds it; nbaccel's
    # prepare compiles inside them, which unwrap_model handles).
    # torch._dynamo is loaded by torch.compile: without it nothing is compiled, and
    # importing it here would cost seconds.
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    compiled = dynamo is not None and isinstance(model, dynamo.OptimizedModule)
    inner: nn.Module = getattr(model, "_orig_mod") if compiled else model  # noqa: B009
    while _wraps_a_module(inner):
        inner = inner.module  # type: ignore[assignment]  # every wrapper keeps it there
    if recursive:
        inner = _unwrapped_tree(inner)
    inner = unwrap_model(inner, keep_autocast=keep_fp32_wrapper, keep_compile=keep_torch_compile)
    if not compiled or not keep_torch_compile:
        return inner
    # As Accelerate: the compiled wrapper is kept and now holds the extracted model. Its
    # compiled forward was bound when it was built, so training through it is unchanged.
    model._orig_mod = inner
    return model


def _wraps_a_module(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrappers: tuple[type, ...] = (
        nn.parallel.DistributedDataParallel,
        nn.DataParallel,
        FullyShardedDataParallel,
    )
    deepspeed = sys.modules.get("deepspeed")  # a DeepSpeed engine exists only if it is loaded
    if deepspeed is not None:
        wrappers += (deepspeed.DeepSpeedEngine,)
    if isinstance(model, wrappers):
        return True
    # By name: torch_xla is not importable everywhere, and importing it costs seconds.
    return type(model).__name__ == "SpmdFullyShardedDataParallel" and hasattr(model, "module")


def _unwrapped_tree(module: nn.Module) -> nn.Module:
    """``module`` and its submodules with every ``.module`` wrapper replaced by its content."""
    wrapped = getattr(module, "module", None)
    if isinstance(wrapped, nn.Module):
        return _unwrapped_tree(wrapped)
    for name, child in list(module.named_children()):
        setattr(module, name, _unwrapped_tree(child))
    return module
