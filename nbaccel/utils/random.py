"""Seeding (``set_seed``) and keeping random generators equal across processes.

``set_seed`` seeds every generator a training loop draws from: Python's ``random``, numpy's
global generator, torch (CPU and every CUDA device), and torch_xla's when this process uses
it. ``synchronize_rng_states`` copies rank 0's generator states to the other ranks.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterable

import torch
import torch.distributed as dist

from nbaccel.accel.partial_state import PartialState
from nbaccel.accel.state import DistributedType

__all__ = ["set_seed", "synchronize_rng_state", "synchronize_rng_states"]

RNG_TYPES = ("torch", "cuda", "xla", "generator")


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed ``random``, numpy, torch, CUDA and (when in use) torch_xla with ``seed``.

    ``device_specific`` adds the process index, so each rank draws differently (e.g. for
    data augmentation); ``deterministic`` also makes torch use deterministic algorithms.

    >>> set_seed(3); first = torch.rand(1)
    >>> set_seed(3); bool(torch.equal(first, torch.rand(1)))
    True
    """
    if device_specific:
        seed += PartialState().process_index
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # numpy is optional for torch; nothing to seed then
        pass
    else:
        numpy.random.seed(seed)
    torch.manual_seed(seed)
    # Lazy: recorded now, applied when CUDA first initialises (never initialises it here).
    torch.cuda.manual_seed_all(seed)
    # Only when this process already uses torch_xla: importing it here would start its
    # runtime and write its environment variables in processes that never touch XLA.
    if "torch_xla" in sys.modules:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def synchronize_rng_state(rng_type: str, generator: torch.Generator | None = None) -> None:
    """Give every process rank 0's state of one generator: ``"torch"``, ``"cuda"``,
    ``"xla"`` or ``"generator"`` (the ``generator`` passed).

    >>> synchronize_rng_state("torch")  # one process: nothing to copy
    """
    kind = str(getattr(rng_type, "value", rng_type)).lower()
    if kind not in RNG_TYPES:
        raise ValueError(f"rng_type={rng_type!r} is not one of {', '.join(RNG_TYPES)}.")
    if kind == "generator" and generator is None:
        raise ValueError("synchronize_rng_state('generator') needs the generator: generator=.")
    state = PartialState()
    if not state.use_distributed:
        return
    if kind == "xla":
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state.strategy.share(int(xm.get_rng_state()))))
        return
    current = _get_state(kind, generator)
    if state.distributed_type is DistributedType.XLA:
        shared = state.strategy.gather_object([current])[0]
    else:
        # On the device: NCCL carries only device tensors (gloo is happy either way).
        shared = current.to(state.device)
        dist.broadcast(shared, src=0)
    _set_state(kind, generator, shared.cpu())


def synchronize_rng_states(
    rng_types: Iterable[str], generator: torch.Generator | None = None
) -> None:
    """``synchronize_rng_state`` for each of ``rng_types``."""
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator)


def _get_state(kind: str, generator: torch.Generator | None) -> torch.Tensor:
    if kind == "torch":
        return torch.get_rng_state()
    if kind == "cuda":
        return torch.cuda.get_rng_state()
    assert generator is not None  # checked by the caller
    return generator.get_state()


def _set_state(kind: str, generator: torch.Generator | None, value: torch.Tensor) -> None:
    if kind == "torch":
        torch.set_rng_state(value)
    elif kind == "cuda":
        torch.cuda.set_rng_state(value)
    elif generator is not None:
        generator.set_state(value)
