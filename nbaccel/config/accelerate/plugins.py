"""Accelerate's ``FullyShardedDataParallelPlugin`` and ``DeepSpeedPlugin``, as ways to fill
nbaccel's one config schema (``config.fsdp``, ``config.deepspeed`` and a few run fields).

Same names, constructor keywords, order and defaults as Accelerate 1.15; torch-free: a field
may hold a torch object (``ShardingStrategy``, ``MixedPrecisionPolicy``, ``CPUOffload``, a
wrap policy), read by its name and attributes, never imported. Nothing reads the environment:
a field left at None is "not set", and ``plugin_settings`` fills it the way Accelerate's
``__post_init__`` does from the launcher's variables:

- a field set on the plugin wins over the launch config;
- a field left at None takes the launch config's value when the launch chose it (its
  strategy is this plugin's, so nbaccel's launcher exported the ``FSDP_*`` /
  ``ACCELERATE_DEEPSPEED_*`` variables Accelerate reads, or the field was set explicitly);
- otherwise the plugin's own default in Accelerate applies (FSDP: ``NO_WRAP``,
  ``min_num_params`` 0, ``FULL_STATE_DICT`` for ``fsdp_version=1``, ...).

What a plugin field holds, and what nbaccel refuses, is in
``nbaccel.config.accelerate.fsdp_plugin`` for
FSDP; for DeepSpeed, below. ``zero3_init_flag`` is accepted and changes nothing: nbaccel does not
set up Transformers' ``HfDeepSpeedConfig``, so a model is built whole on each process and
partitioned by ``prepare()`` (the same numbers, more memory while building).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nbaccel.config.accelerate.fsdp_plugin import (
    FullStateDictPlacement,
    FullyShardedDataParallelPlugin,
    fsdp_defaults,
    fsdp_values,
    full_state_dict_placement,
)
from nbaccel.config.schema import Config
from nbaccel.config.sections import DeepSpeedOptions

__all__ = ["DeepSpeedPlugin", "FullyShardedDataParallelPlugin", "PluginSettings", "plugin_settings"]

_FSDP = "FullyShardedDataParallelPlugin"


@dataclass
class DeepSpeedPlugin:
    """DeepSpeed settings in Accelerate's form; passing one selects ``strategy='deepspeed'``.

    ``hf_ds_config`` is a DeepSpeed config: the path of a JSON file, or a dict (or an
    object holding one in ``.config``, like Accelerate's ``HfDeepSpeedConfig``).

    >>> settings = plugin_settings(DeepSpeedPlugin(zero_stage=3, gradient_clipping=1.0), Config())
    >>> settings.values["deepspeed_zero_stage"], settings.values["max_grad_norm"]
    (3, 1.0)
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | str | None = None
    gradient_clipping: float | str | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool | None = None
    msamp_opt_level: str | None = None

    def __post_init__(self) -> None:
        _deepspeed_set(self)


@dataclass(frozen=True)
class PluginSettings:
    """What a plugin decides: config values by flat name, and which of them are the plugin's
    defaults in Accelerate (not set on it, and not chosen by the launch)."""

    name: str  # the plugin's class name, for sources and messages
    values: dict[str, Any]
    defaulted: frozenset[str] = frozenset()
    deepspeed_config: dict[str, Any] | None = None  # hf_ds_config given as a dict
    # FSDP: where get_state_dict puts the gathered weights (the plugin's FullStateDictConfig)
    full_state_dict: FullStateDictPlacement = field(default_factory=FullStateDictPlacement)


def plugin_settings(
    plugin: FullyShardedDataParallelPlugin | DeepSpeedPlugin,
    launch: Config,
    launch_chose: Callable[[str], bool] = lambda name: False,
) -> PluginSettings:
    """The config values ``plugin`` gives over ``launch`` (see the module's precedence rule).

    ``launch_chose(flat_name)``: whether the launch set that field explicitly (not a default).
    """
    given, placement = None, FullStateDictPlacement()
    if isinstance(plugin, FullyShardedDataParallelPlugin):
        placement = full_state_dict_placement(plugin)
        own = launch.strategy == "fsdp"
        chosen = own or launch_chose("fsdp_sharding_strategy")
        base = launch.fsdp.sharding_strategy if chosen else "FULL_SHARD"
        version = 2 if own else 1  # the FSDP_VERSION Accelerate would find, or its default
        values = {"strategy": "fsdp", **fsdp_values(plugin, base, version)}
        defaults, name = fsdp_defaults(plugin, version), _FSDP
    else:
        own = launch.strategy == "deepspeed"
        set_values, given = _deepspeed_set(plugin)
        values = {"strategy": "deepspeed", **set_values}
        defaults, name = _deepspeed_defaults(), "DeepSpeedPlugin"
    defaulted = frozenset(k for k in defaults if k not in values and not (own or launch_chose(k)))
    values.update({k: defaults[k] for k in defaulted})
    if isinstance(plugin, DeepSpeedPlugin) and _clips_by_default(
        values, given, launch, launch_chose
    ):
        values[_CLIPPING] = _ACCELERATE_CLIPPING
        defaulted |= {_CLIPPING}
    return PluginSettings(name, values, defaulted, given, placement)


# -- DeepSpeed --------------------------------------------------------------------------------
_CLIPPING = "max_grad_norm"
_ACCELERATE_CLIPPING = 1.0


def _clips_by_default(
    values: Mapping[str, Any],
    given: Mapping[str, Any] | None,
    launch: Config,
    launch_chose: Callable[[str], bool],
) -> bool:
    """Whether Accelerate's engine would clip at 1.0 where nothing asked for clipping: its
    plugin, without a DeepSpeed config, builds one with ``gradient_clipping: "auto"``, which
    its ``_prepare_deepspeed`` fills with 1.0 (nbaccel's "auto" takes ``max_grad_norm``, whose
    own default is no clipping). A config file or dict rules its own clipping, as there."""
    if _CLIPPING in values or launch_chose(_CLIPPING) or given is not None:
        return False
    return not values.get("deepspeed_config_file", launch.deepspeed.config_file)


def _deepspeed_defaults() -> dict[str, Any]:
    default = DeepSpeedOptions()  # Accelerate's plugin defaults are the same values
    return {f"deepspeed_{k}": getattr(default, k) for k in _DS_FIELDS}


_DS_FIELDS = (
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "config_file",
    "zero3_save_16bit_model",
)


def _deepspeed_set(plugin: DeepSpeedPlugin) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Config values for the fields set on the plugin, and a config given as a dict."""
    p, values, given = plugin, {}, None
    ds = "DeepSpeedPlugin"
    refused = {
        "is_train_batch_min": p.is_train_batch_min is False,
        "transformer_moe_cls_names": p.transformer_moe_cls_names is not None,
        "enable_msamp": bool(p.enable_msamp),
        "msamp_opt_level": p.msamp_opt_level is not None,
        "offload_optimizer_nvme_path": p.offload_optimizer_nvme_path not in (None, "none"),
        "offload_param_nvme_path": p.offload_param_nvme_path not in (None, "none"),
    }
    for name, is_refused in refused.items():
        if is_refused:
            raise NotImplementedError(f"{ds}({name}={getattr(p, name)!r}): {_DS_WHY_NOT[name]}")
    hf = p.hf_ds_config
    if isinstance(hf, (str, os.PathLike)) and os.fspath(hf) != "none":
        values["deepspeed_config_file"] = os.fspath(hf)
    elif isinstance(hf, Mapping) or isinstance(getattr(hf, "config", None), Mapping):
        given = dict(hf if isinstance(hf, Mapping) else hf.config)
        values["deepspeed_config_file"] = ""  # the dict takes the place of any launch file
    elif hf not in (None, "none"):
        raise TypeError(
            f"{ds}(hf_ds_config={hf!r}): give the path of a DeepSpeed JSON config or a dict."
        )
    if p.gradient_accumulation_steps not in (None, "auto"):
        values["gradient_accumulation_steps"] = p.gradient_accumulation_steps
    if p.gradient_clipping not in (None, "auto"):
        values["max_grad_norm"] = float(p.gradient_clipping)
    if p.zero_stage is not None:
        values["deepspeed_zero_stage"] = p.zero_stage
    for part in ("optimizer", "param"):
        device = getattr(p, f"offload_{part}_device")
        if device is not None:
            values[f"deepspeed_offload_{part}_device"] = str(device).lower()
    if p.zero3_save_16bit_model is not None:
        values["deepspeed_zero3_save_16bit_model"] = bool(p.zero3_save_16bit_model)
    return values, given


_DS_WHY_NOT = {
    "is_train_batch_min": "nbaccel takes DeepSpeed's batch size from the training "
    "dataloader passed to prepare(); choosing the larger of several is not supported. Remove it.",
    "transformer_moe_cls_names": "nbaccel does not mark MoE layers as ZeRO-3 leaf modules. "
    "Remove it.",
    "enable_msamp": "MS-AMP (FP8) is not supported by nbaccel. Remove it.",
    "msamp_opt_level": "MS-AMP (FP8) is not supported by nbaccel. Remove it.",
    "offload_optimizer_nvme_path": "give NVMe offload in a DeepSpeed config (hf_ds_config) as "
    'zero_optimization.offload_optimizer = {"device": "nvme", "nvme_path": ...}.',
    "offload_param_nvme_path": "give NVMe offload in a DeepSpeed config (hf_ds_config) as "
    'zero_optimization.offload_param = {"device": "nvme", "nvme_path": ...}.',
}
