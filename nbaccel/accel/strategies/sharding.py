"""Sharding a model across processes: FSDP2 (``fully_shard``) and ZeRO-1.

``shard_model`` turns the ``fsdp`` config section into PyTorch's own FSDP2: which blocks
become shard units (by layer class, by size, or none), the device mesh (1-D for FULL_SHARD
and SHARD_GRAD_OP, 2-D for NO_SHARD and HYBRID_SHARD), ``reshard_after_forward`` (ZeRO-3
vs ZeRO-2), CPU offload, activation checkpointing and the mixed-precision policy. FSDP2
replaces every parameter with a sharded ``DTensor``, so an optimizer built before
``prepare`` is pointed at the new parameters (``retarget_optimizer``). ``zero1_optimizer``
shards only the optimizer state, with ``ZeroRedundancyOptimizer``, for a DDP model.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.utils.checkpoint import checkpoint

from nbaccel.accel.state import ProcessState
from nbaccel.config.sections import FSDPOptions
from nbaccel.errors import ConfigError


def shard_model(
    model: torch.nn.Module,
    options: FSDPOptions,
    state: ProcessState,
    mixed_dtype: torch.dtype | None,
) -> dict[int, torch.nn.Parameter]:
    """Apply FSDP2 to ``model`` in place; returns {id(old parameter): new parameter}.

    ``mixed_dtype``: the run's mixed-precision dtype (None without), which the parameters are
    gathered in unless ``options.param_dtype`` names another (``mixed_precision_policy``).

    Needs the default process group (the launcher's, or torchrun's); see ``wrap_units`` for
    which submodules become shard units.
    """
    units = wrap_units(model, options)
    if not units and options.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" and state.world_size > 1:
        warnings.warn(
            "FSDP: no layer class to wrap (fsdp_transformer_layer_cls is empty and the model "
            "has no _no_split_modules), so the whole model is one shard unit and every "
            "parameter is gathered at once. Name the block class, or use SIZE_BASED_WRAP.",
            stacklevel=4,
        )
    if options.activation_checkpointing:
        if not units:
            raise ConfigError(
                "fsdp_activation_checkpointing recomputes each wrapped block in backward, "
                "but fsdp_auto_wrap_policy found no blocks to wrap. Name the block class "
                "(fsdp_transformer_layer_cls) or use SIZE_BASED_WRAP.",
                field="fsdp_activation_checkpointing",
            )
        for unit in units:
            _checkpoint_forward(unit)
    if options.cpu_offload:
        params = sum(p.numel() for p in model.parameters())
        check_host_memory(params, state, psutil.virtual_memory().available)
    names = {id(p): name for name, p in model.named_parameters()}
    if state.device.type == "cuda" and not options.cpu_offload:
        model.to(state.device)
    settings: dict[str, Any] = {
        "mesh": _mesh(options.sharding_strategy, state),
        # SHARD_GRAD_OP keeps the gathered parameters from forward to backward (ZeRO-2);
        # the others free them after each block's forward (ZeRO-3).
        "reshard_after_forward": options.sharding_strategy != "SHARD_GRAD_OP",
        "mp_policy": mixed_precision_policy(options, mixed_dtype),
        # Pinned memory needs an accelerator: without CUDA pinning fails at fully_shard.
        "offload_policy": (
            CPUOffloadPolicy(pin_memory=state.device.type == "cuda")
            if options.cpu_offload
            else OffloadPolicy()
        ),
    }
    for unit in units:
        fully_shard(unit, **settings)
    fully_shard(model, **settings)
    new = dict(model.named_parameters())
    return {old_id: new[name] for old_id, name in names.items() if name in new}


_FSDP_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision_policy(
    options: FSDPOptions, mixed_dtype: torch.dtype | None
) -> MixedPrecisionPolicy:
    """FSDP2's policy from ``fsdp_param_dtype`` / ``fsdp_reduce_dtype``.

    ``auto``: parameters are gathered in the run's mixed-precision dtype (``mixed_dtype``;
    None keeps them as they are) and gradients reduced in fp32, for exact sums. A named dtype
    fixes either (Accelerate's ``mixed_precision_policy``). Master weights stay as they are.

    >>> from nbaccel.config.sections import FSDPOptions
    >>> policy = mixed_precision_policy(FSDPOptions(reduce_dtype="bf16"), torch.float16)
    >>> policy.param_dtype, policy.reduce_dtype
    (torch.float16, torch.bfloat16)
    """
    param = mixed_dtype if options.param_dtype == "auto" else _FSDP_DTYPES[options.param_dtype]
    reduce = torch.float32 if options.reduce_dtype == "auto" else _FSDP_DTYPES[options.reduce_dtype]
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def check_host_memory(num_params: int, state: ProcessState, available: int) -> None:
    """Refuse CPU offload that cannot fit in host memory, before anything is moved.

    Counts what offload certainly puts there: every local rank's fp32 parameter and
    gradient shards (8 bytes per parameter in all); optimizer state comes on top.

    >>> from nbaccel.accel.state import DistributedType
    >>> two = ProcessState(0, 0, 2, 2, torch.device("cpu"), DistributedType.FSDP, "")
    >>> check_host_memory(1_000_000_000, two, available=4 * 2**30)
    Traceback (most recent call last):
    ...
    nbaccel.errors.ConfigError: fsdp_cpu_offload keeps parameter and gradient shards in host ...
    """
    share = num_params * 8 / state.world_size * state.local_world_size
    if share > available:
        raise ConfigError(
            f"fsdp_cpu_offload keeps parameter and gradient shards in host memory: at least "
            f"{share / 2**30:.1f} GiB for this machine's {state.local_world_size} process(es) "
            f"({num_params:,} parameters, before optimizer state), but {available / 2**30:.1f} "
            "GiB is available. Turn offload off, use more machines, or free host memory.",
            field="fsdp_cpu_offload",
        )


def wrap_units(model: torch.nn.Module, options: FSDPOptions) -> list[torch.nn.Module]:
    """The submodules that become their own shard unit, innermost first (root excluded).

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    >>> wrap_units(model, FSDPOptions(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=10))
    [Linear(in_features=4, out_features=4, bias=True)]
    >>> by_class = FSDPOptions(transformer_layer_cls="Linear")
    >>> [unit.out_features for unit in wrap_units(model, by_class)]
    [4, 1]
    """
    policy = options.auto_wrap_policy
    if policy == "NO_WRAP":
        return []
    if policy == "SIZE_BASED_WRAP":
        return _units_by_size(model, options.min_num_params)
    wanted = [n.strip() for n in options.transformer_layer_cls.split(",") if n.strip()]
    if not wanted:
        wanted = list(getattr(model, "_no_split_modules", None) or [])
    if not wanted:
        return []  # the caller warns: one unit, the whole model
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in wanted if n not in present]
    if missing:
        hints = {n: difflib.get_close_matches(n, sorted(present), n=3) for n in missing}
        said = "; ".join(
            f"{n!r}" + (f" (did you mean {', '.join(map(repr, h))}?)" if h else "")
            for n, h in hints.items()
        )
        raise ConfigError(
            f"fsdp_transformer_layer_cls names {said}, which is not a module class in this "
            f"model, so FSDP would wrap nothing there. Classes in the model: "
            f"{', '.join(sorted(present))}.",
            field="fsdp_transformer_layer_cls",
        )
    return [m for m in _post_order(model) if m is not model and type(m).__name__ in wanted]


def _units_by_size(model: torch.nn.Module, min_num_params: int) -> list[torch.nn.Module]:
    # A module becomes a unit when the parameters under it that no inner unit took reach
    # the threshold, as torch's size-based policy counts; the root is always wrapped last.
    units: list[torch.nn.Module] = []

    def unclaimed(module: torch.nn.Module) -> int:
        total = sum(unclaimed(child) for child in module.children())
        total += sum(p.numel() for p in module.parameters(recurse=False))
        if module is not model and total >= min_num_params and total > 0:
            units.append(module)
            return 0
        return total

    unclaimed(model)
    return units


def _post_order(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _checkpoint_forward(unit: torch.nn.Module) -> None:
    # Replacing the instance's forward keeps the module tree and state-dict keys unchanged
    # (checkpoint_wrapper adds a prefix); FSDP's hooks run around it as before.
    forward: Callable[..., Any] = unit.forward

    @functools.wraps(forward)
    def recomputed_in_backward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    unit.forward = recomputed_in_backward


def _mesh(strategy: str, state: ProcessState) -> DeviceMesh:
    device = state.device.type
    world = state.world_size
    if strategy == "NO_SHARD":  # replicate everywhere: shard groups of one process
        return init_device_mesh(device, (world, 1), mesh_dim_names=("replicate", "shard"))
    if strategy == "HYBRID_SHARD":  # shard within a machine, replicate across machines
        per_machine = state.local_world_size
        if world % per_machine:
            raise ConfigError(
                f"fsdp_sharding_strategy='HYBRID_SHARD' needs the same number of processes "
                f"on every machine; {world} processes do not split into groups of "
                f"{per_machine}. Use FULL_SHARD or equal num_processes per machine.",
                field="fsdp_sharding_strategy",
            )
        shape = (world // per_machine, per_machine)
        return init_device_mesh(device, shape, mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device, (world,), mesh_dim_names=("shard",))


def retarget_optimizer(
    optimizer: torch.optim.Optimizer, swap: dict[int, torch.nn.Parameter]
) -> None:
    """Point an optimizer built before ``prepare`` at the sharded (or XLA) parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(_replacement(p, swap) is not None for p in params):
        return
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError(
            "prepare(): this optimizer has already stepped, so its state belongs to the "
            "parameters prepare() just replaced (FSDP shards them; on XLA devices they move "
            "to the device as new parameters). Create the optimizer without stepping "
            "it before prepare(), or create it after prepare(model)."
        )
    for group in optimizer.param_groups:
        replaced = [(p, _replacement(p, swap)) for p in group["params"]]
        group["params"] = [p if new is None else new for p, new in replaced]
    optimizer.state.clear()


def _replacement(
    param: torch.nn.Parameter, swap: dict[int, torch.nn.Parameter]
) -> torch.nn.Parameter | None:
    # Keyed by id: once an old parameter is freed, a new one may reuse its id. A parameter of
    # the replacing kind (a DTensor, or on the XLA device) is never an old one.
    new = swap.get(id(param))
    if new is None or new is param:
        return None
    return None if type(new) is type(param) and new.device == param.device else new


def is_sharded(model: torch.nn.Module) -> bool:
    """True for a model that ``fully_shard`` wrapped."""
    return isinstance(model, FSDPModule)


def zero1_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same optimizer with its state sharded across the default group (ZeRO-1).

    ``ZeroRedundancyOptimizer`` partitions the parameters by rank; each rank keeps the
    state of its part, steps it, and broadcasts the updated parameters.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if any(len(s) for s in optimizer.state.values()):
        raise ValueError(
            "prepare(): shard_optimizer_state needs an optimizer that has not stepped yet "
            "(its state would be lost when it is sharded). Call prepare() before training."
        )
    groups = [dict(group) for group in optimizer.param_groups]
    # defaults may hold entries the constructor does not take (AdamW's
    # decoupled_weight_decay); the groups carry every hyperparameter anyway.
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)
