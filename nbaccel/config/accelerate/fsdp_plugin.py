"""Accelerate's ``FullyShardedDataParallelPlugin`` mapped onto nbaccel's ``config.fsdp``.

Same constructor keywords, order and defaults as Accelerate 1.15; torch-free: a field may hold
a torch object (``ShardingStrategy``, ``MixedPrecisionPolicy``, ``CPUOffload``, a wrap policy),
read by its name and attributes, never imported. How unset fields are filled is in
``nbaccel.config.accelerate.plugins``.

nbaccel runs FSDP2 (``fully_shard``). ``fsdp_version=1`` (also what an unset version means
outside an FSDP launch, as in Accelerate) is accepted and its options are mapped onto FSDP2's
equivalents; what FSDP2 has no equivalent for is refused, naming the value:
``backward_prefetch`` other than ``BACKWARD_PRE`` (what FSDP2 does), ``forward_prefetch``,
``limit_all_gathers=False``, ``ignored_modules``, ``param_init_fn``, a ``LOCAL_STATE_DICT``,
``sync_module_states`` under FSDP1, buffer or output dtypes that differ from the parameters'.
Accepted as no-ops because they change no numbers under FSDP2 (Accelerate's FSDP2 ignores them
too): ``use_orig_params``, ``sync_module_states`` (FSDP2 never broadcasts: seed every process
alike), ``cpu_ram_efficient_loading`` (each process loads the checkpoint itself). A policy
given as a string (``"bf16"``) sets the parameter and reduce dtypes, as FSDP2 reads it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FullStateDictPlacement",
    "FullyShardedDataParallelPlugin",
    "fsdp_defaults",
    "fsdp_values",
    "full_state_dict_placement",
]

SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
STATE_DICTS = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")  # torch's 1, 2, 3
PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST")  # torch's BackwardPrefetch 1, 2
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
_FSDP = "FullyShardedDataParallelPlugin"


@dataclass
class FullyShardedDataParallelPlugin:
    """FSDP settings in Accelerate's form; passing one selects ``strategy='fsdp'``.

    >>> plugin = FullyShardedDataParallelPlugin(reshard_after_forward=False, cpu_offload=True)
    >>> fsdp_values(plugin, base_sharding="FULL_SHARD")
    {'fsdp_sharding_strategy': 'SHARD_GRAD_OP', 'fsdp_cpu_offload': True}
    >>> FullyShardedDataParallelPlugin(forward_prefetch=True)
    Traceback (most recent call last):
    ...
    NotImplementedError: FullyShardedDataParallelPlugin(forward_prefetch=True): ...
    """

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Callable[..., Any] | None = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: list[str] | None = None
    min_num_params: int | None = None

    def __post_init__(self) -> None:
        fsdp_values(self, "FULL_SHARD")  # refuse what no launch config could make work


def fsdp_defaults(plugin: FullyShardedDataParallelPlugin, launch_version: int) -> dict[str, Any]:
    """Accelerate's values for what is unset on the plugin and absent from the launch."""
    version = plugin.fsdp_version or launch_version
    return {
        "fsdp_sharding_strategy": "FULL_SHARD",
        "fsdp_cpu_offload": False,
        "fsdp_auto_wrap_policy": "NO_WRAP",
        "fsdp_transformer_layer_cls": "",
        "fsdp_min_num_params": 0,
        "fsdp_activation_checkpointing": False,
        "fsdp_state_dict_type": "FULL_STATE_DICT" if version == 1 else "SHARDED_STATE_DICT",
    }


def fsdp_values(
    plugin: FullyShardedDataParallelPlugin, base_sharding: str, launch_version: int = 2
) -> dict[str, Any]:
    """Config values for the fields set on the plugin; refuses what FSDP2 cannot honour.

    ``base_sharding``: the launch's sharding strategy (kept by ``reshard_after_forward=True``
    when hybrid); ``launch_version``: the FSDP version an unset ``fsdp_version`` means (as
    Accelerate reads ``FSDP_VERSION``: nbaccel's launcher exports 2 for an FSDP launch;
    without one Accelerate defaults to 1).
    """
    p = plugin
    if p.fsdp_version not in (None, 1, 2):
        raise ValueError(f"{_FSDP}(fsdp_version={p.fsdp_version!r}): FSDP versions are 1 and 2.")
    version = p.fsdp_version or launch_version
    refusals = {
        "backward_prefetch": _prefetch(p.backward_prefetch) not in (None, "BACKWARD_PRE"),
        "forward_prefetch": bool(p.forward_prefetch),
        "limit_all_gathers": p.limit_all_gathers is False,
        "ignored_modules": p.ignored_modules is not None,
        "param_init_fn": p.param_init_fn is not None,
        "sync_module_states": bool(p.sync_module_states) and version == 1,
        "activation_checkpointing_offload": bool(p.activation_checkpointing_offload),
    }
    for name, refused in refusals.items():
        if refused:
            raise NotImplementedError(f"{_FSDP}({name}={getattr(p, name)!r}): {_WHY_NOT[name]}")
    values: dict[str, Any] = {}
    sharding = _sharding(p, base_sharding)
    if sharding is not None:
        values["fsdp_sharding_strategy"] = sharding
    if p.cpu_offload is not None:
        values["fsdp_cpu_offload"] = _offload(p.cpu_offload)
    if p.auto_wrap_policy is not None:
        values.update(_wrap_policy(p.auto_wrap_policy))
    if p.transformer_cls_names_to_wrap is not None:
        names = p.transformer_cls_names_to_wrap
        values["fsdp_transformer_layer_cls"] = names if isinstance(names, str) else ",".join(names)
    if p.min_num_params is not None:
        if type(p.min_num_params) is not int:
            raise ValueError(f"{_FSDP}(min_num_params={p.min_num_params!r}) must be an int.")
        values["fsdp_min_num_params"] = p.min_num_params
    if p.activation_checkpointing is not None:
        values["fsdp_activation_checkpointing"] = bool(p.activation_checkpointing)
    if p.state_dict_type is not None:
        values["fsdp_state_dict_type"] = _state_dict_type(p.state_dict_type)
    for name in ("state_dict_config", "optim_state_dict_config"):
        _check_state_dict_config(name, getattr(p, name))
    if p.mixed_precision_policy is not None:
        values.update(_mixed_precision(p.mixed_precision_policy))
    return values


_WHY_NOT = {
    "backward_prefetch": "nbaccel runs FSDP2, which always prefetches the next block's "
    "parameters in backward (BACKWARD_PRE) and has no other mode. Remove it or use "
    "'BACKWARD_PRE'.",
    "forward_prefetch": "nbaccel runs FSDP2, which has no forward prefetch option (Accelerate "
    "refuses it for FSDP2 too). Remove it.",
    "limit_all_gathers": "nbaccel runs FSDP2, which always limits in-flight all-gathers. "
    "Remove it.",
    "ignored_modules": "nbaccel's FSDP shards every parameter of the model; keeping some "
    "modules out of sharding is not supported. Remove it.",
    "param_init_fn": "nbaccel's FSDP does not initialise meta-device modules; build the model "
    "on a real device (seeded alike on every process) or load its weights. Remove it.",
    "sync_module_states": "under FSDP1 (fsdp_version=1, Accelerate's default outside an FSDP "
    "launch) it broadcasts rank 0's weights at wrapping; nbaccel runs FSDP2, which never does. "
    "Seed every process alike before building the model (or load the same weights everywhere) "
    "and pass fsdp_version=2, where Accelerate ignores sync_module_states too.",
    "activation_checkpointing_offload": "nbaccel recomputes checkpointed activations but does "
    "not offload them to CPU memory. Remove it (activation_checkpointing alone works).",
}


def _prefetch(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value.upper() == "NO_PREFETCH"):
        return None if value is None else "NO_PREFETCH"
    return _name(value, PREFETCH, f"{_FSDP}.backward_prefetch")


def _name(value: Any, names: tuple[str, ...], what: str) -> str:
    """An option given as torch enum, its int value, or its name in any case -> the name."""
    if isinstance(value, enum.Enum):
        value = value.name
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= len(names):
        return names[value - 1]
    if isinstance(value, str):
        text = value.strip().upper().lstrip("_")
        if text.isdigit() and 1 <= int(text) <= len(names):
            return names[int(text) - 1]
        if text in names:
            return text
    raise ValueError(f"{what}={value!r} is not one of {', '.join(names)} (or their numbers).")


def sharding_name(value: Any, what: str = "sharding_strategy") -> str:
    """``ShardingStrategy.SHARD_GRAD_OP``, ``2``, ``"shard_grad_op"`` -> ``"SHARD_GRAD_OP"``;
    refuses what nbaccel's FSDP2 cannot do.

    >>> sharding_name(2), sharding_name("hybrid_shard")
    ('SHARD_GRAD_OP', 'HYBRID_SHARD')
    """
    name = _name(value, SHARDING, what)
    if name == "HYBRID_SHARD_ZERO2":
        raise NotImplementedError(
            f"{what}={value!r}: nbaccel's HYBRID_SHARD reshards after forward "
            "(ZeRO-3 within a machine); a ZeRO-2 hybrid has no equivalent. Use HYBRID_SHARD or "
            "SHARD_GRAD_OP."
        )
    return name


def reshard_sharding(reshard: bool, base: str) -> str:
    """FSDP2's ``reshard_after_forward`` as a sharding strategy, keeping a hybrid ``base``.

    >>> reshard_sharding(True, "HYBRID_SHARD"), reshard_sharding(False, "FULL_SHARD")
    ('HYBRID_SHARD', 'SHARD_GRAD_OP')
    """
    if reshard:
        return base if base in ("FULL_SHARD", "HYBRID_SHARD") else "FULL_SHARD"
    if base == "HYBRID_SHARD":
        raise NotImplementedError(
            "reshard_after_forward=False with HYBRID_SHARD: nbaccel's hybrid sharding reshards "
            "after forward; a ZeRO-2 hybrid has no equivalent. Use reshard_after_forward=True "
            "or fsdp_sharding_strategy SHARD_GRAD_OP."
        )
    return "SHARD_GRAD_OP"


def as_reshard(value: Any) -> bool | None:
    """``reshard_after_forward`` as FSDP2's bool (True, "true", ...); None for a strategy name."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text)


def _sharding(plugin: FullyShardedDataParallelPlugin, base: str) -> str | None:
    strategy = plugin.sharding_strategy
    by_name = None if strategy is None else sharding_name(strategy, f"{_FSDP}.sharding_strategy")
    reshard = plugin.reshard_after_forward
    if reshard is None:
        return by_name
    as_bool = as_reshard(reshard) if not isinstance(reshard, enum.Enum) else None
    by_reshard = (
        sharding_name(reshard, f"{_FSDP}.reshard_after_forward")
        if as_bool is None
        else reshard_sharding(as_bool, by_name or base)
    )
    if by_name is not None and by_name != by_reshard and by_name != "NO_SHARD":
        raise ValueError(
            f"{_FSDP}(sharding_strategy={plugin.sharding_strategy!r}, reshard_after_forward="
            f"{reshard!r}) contradict each other. Give one: reshard_after_forward (FSDP2's "
            "name) or sharding_strategy."
        )
    return by_name or by_reshard


def _offload(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    kind = type(value).__name__
    if hasattr(value, "offload_params"):  # FSDP1's CPUOffload
        return bool(value.offload_params)
    if kind in ("CPUOffloadPolicy", "OffloadPolicy"):  # FSDP2's
        return kind == "CPUOffloadPolicy"
    raise TypeError(f"{_FSDP}(cpu_offload={value!r}): give a bool, CPUOffload or CPUOffloadPolicy.")


def _wrap_policy(policy: Any) -> dict[str, Any]:
    if isinstance(policy, str):
        name = policy.upper()
        if name not in WRAP_POLICIES:
            raise ValueError(
                f"{_FSDP}(auto_wrap_policy={policy!r}): must be one of "
                f"{', '.join(p.lower() for p in WRAP_POLICIES)}."
            )
        return {"fsdp_auto_wrap_policy": name}
    function = getattr(policy, "func", policy)  # functools.partial(policy, ...) too
    keywords = dict(getattr(policy, "keywords", None) or {})
    kind = getattr(function, "__name__", "")
    if kind == "transformer_auto_wrap_policy":
        values: dict[str, Any] = {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
        if "transformer_layer_cls" in keywords:
            classes = keywords["transformer_layer_cls"]
            values["fsdp_transformer_layer_cls"] = ",".join(sorted(c.__name__ for c in classes))
        return values
    if kind == "size_based_auto_wrap_policy":
        values = {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}
        if "min_num_params" in keywords:
            values["fsdp_min_num_params"] = int(keywords["min_num_params"])
        return values
    raise NotImplementedError(
        f"{_FSDP}(auto_wrap_policy={policy!r}): nbaccel wraps by layer class, by size or not "
        "at all, as data it can show and check. Use 'transformer_based_wrap' with "
        "transformer_cls_names_to_wrap, or 'size_based_wrap' with min_num_params."
    )


def _state_dict_type(value: Any) -> str:
    name = _name(value, STATE_DICTS, f"{_FSDP}.state_dict_type")
    if name == "LOCAL_STATE_DICT":
        raise NotImplementedError(
            f"{_FSDP}(state_dict_type={value!r}): FSDP2 has no local state dict (Accelerate "
            "refuses it for FSDP2 too). Use SHARDED_STATE_DICT or FULL_STATE_DICT."
        )
    return name


def _check_state_dict_config(name: str, config: Any) -> None:
    # save_state writes FSDP state offloaded to CPU, a full one from rank 0 (as Accelerate,
    # which sets rank0_only=True itself when several processes save). Only get_state_dict
    # reads a FullStateDictConfig's two settings (full_state_dict_placement).
    if config is None or type(config).__name__ == "FullStateDictConfig":
        return
    # A FullOptimStateDictConfig's rank0_only changes nothing here: save_state writes one
    # optimizer file from rank 0 either way, and every rank loads the same state from it.
    if getattr(config, "offload_to_cpu", None) is True:
        return
    raise NotImplementedError(
        f"{_FSDP}({name}={config!r}): nbaccel saves FSDP state offloaded to CPU "
        "(offload_to_cpu=True). Remove it, or use that value."
    )


@dataclass(frozen=True)
class FullStateDictPlacement:
    """Where ``get_state_dict`` puts an FSDP model's gathered weights: torch's
    ``FullStateDictConfig`` settings (Accelerate's default: both True).

    >>> full_state_dict_placement(FullyShardedDataParallelPlugin())
    FullStateDictPlacement(offload_to_cpu=True, rank0_only=True)
    """

    offload_to_cpu: bool = True  # False: on the device the process trains on
    rank0_only: bool = True  # False: every rank gets the whole state dict


def full_state_dict_placement(plugin: FullyShardedDataParallelPlugin) -> FullStateDictPlacement:
    """The plugin's ``FullStateDictConfig`` (``state_dict_config``), if it gave one."""
    config = plugin.state_dict_config
    if config is None or type(config).__name__ != "FullStateDictConfig":
        return FullStateDictPlacement()
    return FullStateDictPlacement(
        offload_to_cpu=bool(getattr(config, "offload_to_cpu", False)),
        rank0_only=bool(getattr(config, "rank0_only", False)),
    )


def _mixed_precision(policy: Any) -> dict[str, str]:
    if isinstance(policy, str):
        if policy not in ("fp32", "bf16", "fp16"):
            raise NotImplementedError(
                f"{_FSDP}(mixed_precision_policy={policy!r}): nbaccel's FSDP computes in "
                "fp32, bf16 or fp16. Use one of those."
            )
        return {"fsdp_param_dtype": policy, "fsdp_reduce_dtype": policy}

    def get(key: str) -> Any:  # a dict (Accelerate's form) or torch's policy object
        return policy.get(key) if isinstance(policy, Mapping) else getattr(policy, key, None)

    param = _dtype(get("param_dtype"), "param_dtype") or "fp32"  # None: parameters kept as built
    reduce = _dtype(get("reduce_dtype"), "reduce_dtype") or param  # None: reduced as computed
    for key, allowed in (("output_dtype", (None, param)), ("buffer_dtype", (None, "fp32"))):
        if _dtype(get(key), key) not in allowed:
            raise NotImplementedError(
                f"{_FSDP}(mixed_precision_policy with {key}={get(key)!r}): nbaccel's FSDP2 "
                + (
                    "returns outputs in the parameters' dtype."
                    if key == "output_dtype"
                    else "keeps buffers in their own dtype."
                )
                + f" Remove {key}."
            )
    return {"fsdp_param_dtype": param, "fsdp_reduce_dtype": reduce}


def _dtype(value: Any, key: str) -> str | None:
    if value is None:
        return None
    text = str(value)
    if text in _DTYPES.values():
        return text
    if text not in _DTYPES:
        raise NotImplementedError(
            f"{_FSDP}(mixed_precision_policy with {key}={value!r}): nbaccel's FSDP uses "
            "torch.float32, torch.bfloat16 or torch.float16."
        )
    return _DTYPES[text]
