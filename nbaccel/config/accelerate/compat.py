"""Hugging Face Accelerate compatibility: its YAML config in, its environment variables out.

``from_accelerate_yaml`` maps Accelerate's ``default_config.yaml`` schema onto nbaccel's
options; a value nbaccel cannot honour is an error naming the key, never silently dropped.
``accelerate_env`` gives workers the variables Accelerate's own launcher would set, so code
written for Accelerate runs unchanged under nbaccel. Plain data, stdlib only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nbaccel.config.accelerate.fsdp_plugin import FullyShardedDataParallelPlugin, fsdp_values
from nbaccel.config.schema import Config, option
from nbaccel.errors import ConfigError

ACCELERATE_TOP_KEYS = frozenset(
    {
        "compute_environment",
        "distributed_type",
        "fsdp_config",
        "deepspeed_config",
        "dynamo_config",
        "megatron_lm_config",
        "downcast_bf16",
        "same_network",
        "rdzv_backend",
        "tpu_env",
        "tpu_use_cluster",
        "tpu_use_sudo",
        "main_training_function",
        "gpu_ids",
        "enable_cpu_affinity",
        "debug",
        "ipex_config",
        "mpirun_config",
        "use_cpu",
        "num_machines",
        "num_processes",
        "machine_rank",
        "main_process_ip",
        "main_process_port",
        "mixed_precision",
        "tpu_name",
        "tpu_zone",
        "commands",
        "command_file",
    }
)
_STRATEGY = {
    "NO": None,
    "MULTI_CPU": "ddp",
    "MULTI_GPU": "ddp",
    "FSDP": "fsdp",
    "DEEPSPEED": "deepspeed",
    "XLA": "xla",
    "TPU": "xla",
}
# Keys whose default value is harmless and whose other values nbaccel cannot honour.
_ONLY_DEFAULT = {
    "downcast_bf16": ("no", False, None),
    "enable_cpu_affinity": (False, None),
    "debug": (False, None),
    "tpu_use_cluster": (False, None),
    "tpu_use_sudo": (False, None),
    "compute_environment": ("LOCAL_MACHINE", None),
}
_IGNORED = {
    "same_network",
    "rdzv_backend",
    "main_training_function",
    "tpu_env",
    "tpu_name",
    "tpu_zone",
    "commands",
    "command_file",
    "ipex_config",
    "mpirun_config",
    "megatron_lm_config",
}
# Accelerate's fsdp_config keys -> FullyShardedDataParallelPlugin's keywords: the file is read
# as that plugin would read the variables Accelerate's launcher writes from it, by the same rules.
_FSDP_KEYWORDS = {
    "fsdp_version": "fsdp_version",
    "fsdp_sharding_strategy": "sharding_strategy",
    "fsdp_reshard_after_forward": "reshard_after_forward",
    "fsdp_offload_params": "cpu_offload",
    "fsdp_auto_wrap_policy": "auto_wrap_policy",
    "fsdp_transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap",
    "fsdp_min_num_params": "min_num_params",
    "fsdp_activation_checkpointing": "activation_checkpointing",
    "fsdp_activation_checkpointing_offload": "activation_checkpointing_offload",
    "fsdp_state_dict_type": "state_dict_type",
    "fsdp_backward_prefetch": "backward_prefetch",
    "fsdp_forward_prefetch": "forward_prefetch",
    "fsdp_use_orig_params": "use_orig_params",
    "fsdp_cpu_ram_efficient_loading": "cpu_ram_efficient_loading",
    "fsdp_sync_module_states": "sync_module_states",
    "fsdp_ignored_modules": "ignored_modules",
}
_DEEPSPEED = {
    "zero_stage": "deepspeed.zero_stage",
    "offload_optimizer_device": "deepspeed.offload_optimizer_device",
    "offload_param_device": "deepspeed.offload_param_device",
    "deepspeed_config_file": "deepspeed.config_file",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "zero3_save_16bit_model": "deepspeed.zero3_save_16bit_model",
}
# zero3_init_flag changes no numbers: see nbaccel.config.accelerate.plugins.
_DEEPSPEED_TOLERATED = {"zero3_init_flag", "deepspeed_multinode_launcher"}


# dynamo_config keys besides dynamo_backend: nbaccel's dynamo section, same names.
_DYNAMO_KEYS = (
    "dynamo_mode",
    "dynamo_use_fullgraph",
    "dynamo_use_dynamic",
    "dynamo_use_regional_compilation",
)


def looks_like_accelerate(data: Mapping[str, Any]) -> bool:
    """Accelerate files always hold distributed_type or compute_environment."""
    return "distributed_type" in data or "compute_environment" in data


def from_accelerate_yaml(data: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """Map an Accelerate config (already parsed) to ``{nbaccel dotted path: value}``.

    >>> from_accelerate_yaml({"distributed_type": "MULTI_CPU", "num_processes": 4,
    ...                       "mixed_precision": "bf16", "use_cpu": True}, "x.yaml")
    {'strategy': 'ddp', 'num_processes': 4, 'mixed_precision': 'bf16', 'use_cpu': True}
    """
    values: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{origin}: {key}"
        if key not in ACCELERATE_TOP_KEYS:
            raise ConfigError(f"Unknown Accelerate config key {key!r} in {origin}.", field=key)
        if key == "distributed_type":
            if value not in _STRATEGY:
                raise ConfigError(
                    f"{where}={value!r}: nbaccel supports distributed_type NO, MULTI_CPU, "
                    f"MULTI_GPU, FSDP, DEEPSPEED and XLA.",
                    field="strategy",
                )
            if _STRATEGY[value]:
                values["strategy"] = _STRATEGY[value]
        elif key in _ONLY_DEFAULT:
            if value not in _ONLY_DEFAULT[key]:
                raise ConfigError(
                    f"{where}={value!r} is not supported by nbaccel (only "
                    f"{_ONLY_DEFAULT[key][0]!r}). Remove the key.",
                    field=key,
                )
        elif key in _IGNORED:
            continue
        elif key == "fsdp_config":
            values.update(_fsdp(value or {}, where))
        elif key == "deepspeed_config":
            values.update(_nested(value or {}, _DEEPSPEED, _DEEPSPEED_TOLERATED, where))
        elif key == "dynamo_config":
            values.update(_dynamo(value or {}, where))
        elif key in ("main_process_ip", "gpu_ids") and value is None:
            continue  # Accelerate's "not set" (gpu_ids: every GPU)
        else:
            values[key] = value
    if values.get("strategy") == "ddp" and data.get("distributed_type") == "MULTI_CPU":
        values["use_cpu"] = True
    # num_processes passes through unchanged: Accelerate's counts all machines, as nbaccel's
    # does; the schema refuses a total that does not split evenly over num_machines.
    return values


def _fsdp(section: Mapping[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(section) - set(_FSDP_KEYWORDS))
    if unknown:
        raise ConfigError(
            f"{where}.{unknown[0]} is not an option nbaccel can honour. Known: "
            f"{', '.join(sorted(_FSDP_KEYWORDS))}.",
            field=unknown[0],
        )
    keywords = {_FSDP_KEYWORDS[key]: value for key, value in section.items()}
    if isinstance(keywords.get("transformer_cls_names_to_wrap"), str):
        keywords["transformer_cls_names_to_wrap"] = [keywords["transformer_cls_names_to_wrap"]]
    try:
        plugin = FullyShardedDataParallelPlugin(**keywords)
        chosen = fsdp_values(plugin, base_sharding="FULL_SHARD")
    except (ValueError, TypeError, NotImplementedError) as error:
        raise ConfigError(f"{where}: {error}", field="fsdp_config") from None
    return {option(name).path: value for name, value in chosen.items()}


def _dynamo(section: Mapping[str, Any], where: str) -> dict[str, Any]:
    values = {"dynamo_backend": str(section.get("dynamo_backend", "NO")).lower()}
    for key, value in section.items():
        if key == "dynamo_backend":
            continue
        if key not in _DYNAMO_KEYS:
            raise ConfigError(
                f"{where}.{key} is not an option nbaccel can honour. Known: dynamo_backend, "
                f"{', '.join(_DYNAMO_KEYS)}.",
                field=key,
            )
        values[f"dynamo.{key.removeprefix('dynamo_')}"] = value
    return values


def _nested(
    section: Mapping[str, Any], mapping: Mapping[str, str], tolerated: set[str], where: str
) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, value in section.items():
        if key in mapping:
            if key in ("offload_optimizer_device", "offload_param_device") and value is None:
                value = "none"
            if value == "auto" or (key == "gradient_clipping" and value is None):
                continue  # filled from the run
            values[mapping[key]] = value
        elif key not in tolerated:
            raise ConfigError(
                f"{where}.{key} is not an option nbaccel can honour. Known: "
                f"{', '.join(sorted(mapping))}.",
                field=key,
            )
    return values


def accelerate_env(config: Config, *, on_cpu: bool) -> dict[str, str]:
    """Variables that Accelerate reads in a worker, as its own launcher would set them."""
    env = {
        "ACCELERATE_MIXED_PRECISION": config.mixed_precision,
        "ACCELERATE_DYNAMO_BACKEND": config.dynamo_backend.upper(),
        "ACCELERATE_DYNAMO_MODE": config.dynamo.mode,
        "ACCELERATE_DYNAMO_USE_FULLGRAPH": str(config.dynamo.use_fullgraph),
        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": str(config.dynamo.use_regional_compilation),
    }
    if config.dynamo.use_dynamic is not None:  # unset: torch.compile(dynamic=None) decides
        env["ACCELERATE_DYNAMO_USE_DYNAMIC"] = str(config.dynamo.use_dynamic)
    # Accelerate reads this variable *over* its own gradient_accumulation_steps argument, so
    # exporting the default 1 would silently turn accumulation off in code that asks for it.
    if config.gradient_accumulation_steps != 1:
        env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(config.gradient_accumulation_steps)
    if on_cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    if config.max_grad_norm is not None:
        env["ACCELERATE_GRADIENT_CLIPPING"] = str(config.max_grad_norm)
    if config.strategy == "fsdp":
        fsdp = config.fsdp
        env |= {
            "ACCELERATE_USE_FSDP": "true",
            "FSDP_VERSION": "2",
            "FSDP_SHARDING_STRATEGY": fsdp.sharding_strategy,
            "FSDP_RESHARD_AFTER_FORWARD": str(fsdp.sharding_strategy != "SHARD_GRAD_OP").lower(),
            "FSDP_OFFLOAD_PARAMS": str(fsdp.cpu_offload).lower(),
            "FSDP_AUTO_WRAP_POLICY": fsdp.auto_wrap_policy,
            "FSDP_MIN_NUM_PARAMS": str(fsdp.min_num_params),
            "FSDP_STATE_DICT_TYPE": fsdp.state_dict_type,
            "FSDP_ACTIVATION_CHECKPOINTING": str(fsdp.activation_checkpointing).lower(),
        }
        if fsdp.transformer_layer_cls:
            env["FSDP_TRANSFORMER_CLS_TO_WRAP"] = fsdp.transformer_layer_cls
    elif config.strategy == "deepspeed":
        ds = config.deepspeed
        env |= {
            "ACCELERATE_USE_DEEPSPEED": "true",
            "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(ds.zero_stage),
            "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": ds.offload_optimizer_device,
            "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": ds.offload_param_device,
        }
        if ds.config_file:
            env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = ds.config_file
        if ds.zero3_save_16bit_model:
            env["ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"] = "true"
    return env
