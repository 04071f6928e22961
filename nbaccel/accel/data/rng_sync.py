"""Accelerate's ``rng_types``: random generators made equal across ranks at every pass.

At the start of each pass over a prepared dataloader Accelerate copies rank 0's state of
each named generator to the other ranks, so that what the loop draws from them (dropout
masks from ``torch``, ...) is the same everywhere. nbaccel does the same for ``torch`` (the
global CPU generator), ``cuda`` (this process's GPU) and ``xla``. ``generator`` (the
default) names the sampler's shuffling generator: nbaccel's prepared loaders draw each
epoch's order from a seed shared by every rank (``seed + epoch``), so the shuffle is the
same on every rank by construction and there is nothing to copy. The other devices
Accelerate names (``mlu``, ``npu``, ``xpu``, ...) are refused: nbaccel does not train on
them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from nbaccel.accel.state import DistributedType
from nbaccel.accel.strategies.base import Strategy

__all__ = ["rngs_to_synchronize", "synchronize_rngs"]

_DEVICE_OF = {"cuda": "cuda", "xla": "xla"}  # generators that live on one kind of device


def rngs_to_synchronize(rng_types: Sequence[str], device: torch.device) -> tuple[str, ...]:
    """The generators of ``rng_types`` a pass must copy from rank 0 on ``device``.

    >>> rngs_to_synchronize(("generator", "torch"), torch.device("cpu"))
    ('torch',)
    >>> rngs_to_synchronize(("cuda",), torch.device("cpu"))
    Traceback (most recent call last):
    ...
    ValueError: rng_types has 'cuda', but this process computes on cpu, ...
    """
    chosen: list[str] = []
    for name in rng_types:
        if name == "generator":
            continue  # the shared seed already gives every rank the same order
        if name not in ("torch", *_DEVICE_OF):
            raise NotImplementedError(
                f"rng_types has {name!r}: nbaccel trains on CPUs, CUDA GPUs and TPUs only, so "
                "it has no such generator to synchronise. Use 'torch', 'cuda', 'xla' or "
                "'generator'."
            )
        wanted = _DEVICE_OF.get(name)
        if wanted is not None and device.type != wanted:
            raise ValueError(
                f"rng_types has {name!r}, but this process computes on {device.type}, which "
                f"has no {name} generator. Leave {name!r} out of rng_types for this run."
            )
        chosen.append(name)
    return tuple(chosen)


def synchronize_rngs(rng_types: Sequence[str], strategy: Strategy) -> None:
    """Give every rank rank 0's state of each generator in ``rng_types`` (a collective)."""
    state = strategy.state
    if not state.use_distributed:
        return
    for name in rng_types:
        if name == "xla":
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(strategy.share(int(xm.get_rng_state())))
        elif name == "torch":
            torch.set_rng_state(_from_main(torch.get_rng_state(), strategy))
        elif name == "cuda":
            torch.cuda.set_rng_state(_from_main(torch.cuda.get_rng_state(), strategy))


def _from_main(current: torch.Tensor, strategy: Strategy) -> torch.Tensor:
    if strategy.state.distributed_type is DistributedType.XLA:
        # torch_xla's groups carry objects, not CPU byte tensors.
        shared: torch.Tensor = strategy.gather_object([current])[0]
        return shared.cpu()
    # On the device: NCCL carries device tensors only (gloo takes either).
    on_device = current.to(strategy.state.device)
    dist.broadcast(on_device, src=0)
    return on_device.cpu()
