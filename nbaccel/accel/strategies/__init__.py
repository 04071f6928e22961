"""The strategies: one class per distributed backend, chosen once from the resolved config.

>>> from nbaccel.config.schema import Config
>>> start(Config()).name  # one plain process here
'single'
"""

from __future__ import annotations

from collections.abc import Mapping

from nbaccel.accel.state import DistributedType, ProcessState, torch_process_state, uses_xla_here
from nbaccel.accel.strategies.base import Strategy
from nbaccel.accel.strategies.data_parallel import DataParallel, ZeroOne
from nbaccel.accel.strategies.deepspeed import DeepSpeed
from nbaccel.accel.strategies.fully_sharded import FullySharded
from nbaccel.config.accelerator_options import AcceleratorOptions
from nbaccel.config.schema import Config


def detect_process_state(
    config: Config,
    env: Mapping[str, str] | None = None,
    options: AcceleratorOptions | None = None,
) -> ProcessState:
    """Who this process is (rank, world, device, distributed type), torch_xla's way when
    it trains through torch_xla, else torch.distributed's (initialising the group)."""
    if uses_xla_here(config, env):
        from nbaccel.accel.strategies.xla_setup import detect_xla_state  # imports torch_xla

        return detect_xla_state(config)
    init_kwargs = options.init_process_group_kwargs if options is not None else None
    return torch_process_state(config, env, init_kwargs=init_kwargs)


def start(
    config: Config, options: AcceleratorOptions | None = None, env: Mapping[str, str] | None = None
) -> Strategy:
    """The strategy for this process under ``config`` (``options``: the Accelerator's
    keywords that are no config field, see ``nbaccel.config.accelerator_options``)."""
    return strategy_for(detect_process_state(config, env, options), config, options)


def strategy_for(
    state: ProcessState, config: Config, options: AcceleratorOptions | None = None
) -> Strategy:
    """The strategy class the distributed type (and ``shard_optimizer_state``) asks for."""
    kind = state.distributed_type
    if kind is DistributedType.XLA:
        import torch_xla.runtime as xr

        from nbaccel.accel.strategies.xla import XlaDataParallel, XlaSpmd

        xla = XlaSpmd if xr.is_spmd() else XlaDataParallel
        return xla(state, config, options)
    if kind is DistributedType.DEEPSPEED:
        return DeepSpeed(state, config, options)
    if kind is DistributedType.FSDP:
        return FullySharded(state, config, options)
    if kind in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        sharded_optimizer = config.shard_optimizer_state
        data_parallel = ZeroOne if sharded_optimizer else DataParallel
        return data_parallel(state, config, options)
    return Strategy(state, config, options)


__all__ = [
    "DataParallel",
    "DeepSpeed",
    "FullySharded",
    "Strategy",
    "ZeroOne",
    "detect_process_state",
    "start",
    "strategy_for",
]
