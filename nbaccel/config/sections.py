"""The nested sections of the config schema (``fsdp``, ``deepspeed``, ``dynamo``) and the field
helper.

Split from ``nbaccel.config`` to keep modules small; ``nbaccel.config`` re-exports them.
Plain data, stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The dtypes an FSDP mixed-precision policy can name; "auto" lets the run decide.
FSDP_DTYPES = ("auto", "fp32", "bf16", "fp16")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def schema_field(
    default: Any,
    help: str,
    *,
    choices: tuple[Any, ...] | None = None,
    accelerate_env: str | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    int_list: bool = False,
    number_as_text: bool = False,
) -> Any:
    """A leaf field of the schema. ``int_list``: a text field holding a comma list of
    integers (``"0,2"``), which code and YAML may also give as a list or one int;
    ``number_as_text``: a text field that code and YAML may also give as a number."""
    meta = {
        "help": help,
        "choices": choices,
        "accelerate_env": accelerate_env,
        "minimum": minimum,
        "maximum": maximum,
        "int_list": int_list,
        "number_as_text": number_as_text,
    }
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class FSDPOptions:
    """Fully Sharded Data Parallel (PyTorch's ``fully_shard``), used when strategy is fsdp."""

    sharding_strategy: str = schema_field(
        "FULL_SHARD",
        "What is sharded: FULL_SHARD (params, grads, optimizer state: ZeRO-3), SHARD_GRAD_OP "
        "(grads and optimizer state: ZeRO-2), NO_SHARD (plain DDP), HYBRID_SHARD (full "
        "shard within a machine, replicate across machines).",
        choices=("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"),
    )
    cpu_offload: bool = schema_field(False, "Keep sharded parameters in CPU memory between uses.")
    auto_wrap_policy: str = schema_field(
        "TRANSFORMER_BASED_WRAP",
        "Which submodules become their own shard unit: by transformer layer class, by size, "
        "or none (the whole model is one unit).",
        choices=("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"),
    )
    transformer_layer_cls: str = schema_field(
        "",
        "Comma list of layer class names to wrap (e.g. 'LlamaDecoderLayer'); empty: the "
        "model's _no_split_modules.",
    )
    min_num_params: int = schema_field(
        100_000_000, "Smallest submodule (in parameters) wrapped by SIZE_BASED_WRAP.", minimum=0
    )
    activation_checkpointing: bool = schema_field(
        False, "Recompute each wrapped block's activations in backward to save memory."
    )
    state_dict_type: str = schema_field(
        "SHARDED_STATE_DICT",
        "How save_state writes the model: each rank its shards, or one full state dict.",
        choices=("SHARDED_STATE_DICT", "FULL_STATE_DICT"),
    )
    param_dtype: str = schema_field(
        "auto",
        "Dtype FSDP gathers parameters in for forward and backward (outputs come back in it "
        "too): auto follows mixed_precision (bf16 or fp16, else fp32); fp32, bf16 or fp16 fix "
        "it (Accelerate's mixed_precision_policy).",
        choices=FSDP_DTYPES,
    )
    reduce_dtype: str = schema_field(
        "auto",
        "Dtype gradients are reduced across processes in: auto is fp32 (exact sums); bf16 "
        "or fp16 halve the traffic, as Accelerate's FSDP does under mixed precision.",
        choices=FSDP_DTYPES,
    )


@dataclass(frozen=True)
class DeepSpeedOptions:
    """DeepSpeed ZeRO (an optional extra, CUDA only), used when strategy is deepspeed."""

    zero_stage: int = schema_field(
        2,
        "ZeRO stage: 0 off, 1 optimizer state, 2 + gradients, 3 + parameters.",
        choices=(0, 1, 2, 3),
        accelerate_env="ACCELERATE_DEEPSPEED_ZERO_STAGE",
    )
    offload_optimizer_device: str = schema_field(
        "none",
        "Where ZeRO keeps optimizer state: none (GPU), cpu or nvme.",
        choices=("none", "cpu", "nvme"),
        accelerate_env="ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    )
    offload_param_device: str = schema_field(
        "none",
        "Where ZeRO-3 keeps parameters: none (GPU), cpu or nvme.",
        choices=("none", "cpu", "nvme"),
        accelerate_env="ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    )
    config_file: str = schema_field(
        "",
        "A DeepSpeed JSON config; 'auto' values in it are filled from this run.",
        accelerate_env="ACCELERATE_DEEPSPEED_CONFIG_FILE",
    )
    zero3_save_16bit_model: bool = schema_field(
        False,
        "ZeRO stage 3: gather the full weights in 16 bit when the model is saved (DeepSpeed's "
        "stage3_gather_16bit_weights_on_model_save); off, they stay partitioned.",
        accelerate_env="ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    )


@dataclass(frozen=True)
class DynamoOptions:
    """torch.compile settings beside dynamo_backend, used when it is not 'no'."""

    mode: str = schema_field(
        "default",
        "torch.compile mode: default, reduce-overhead (CUDA graphs), max-autotune, or "
        "max-autotune-no-cudagraphs.",
        choices=COMPILE_MODES,
        accelerate_env="ACCELERATE_DYNAMO_MODE",
    )
    use_fullgraph: bool = schema_field(
        False,
        "Compile the whole forward as one graph: a graph break is an error instead of a split.",
        accelerate_env="ACCELERATE_DYNAMO_USE_FULLGRAPH",
    )
    use_dynamic: bool | None = schema_field(
        None,
        "Trace with dynamic shapes: true, false, or none (torch decides: it recompiles for "
        "dynamic shapes once a size changes).",
        accelerate_env="ACCELERATE_DYNAMO_USE_DYNAMIC",
    )
    use_regional_compilation: bool = schema_field(
        False,
        "Compile each repeated block (e.g. every transformer layer) on its own: a much faster "
        "cold start, the same results.",
        accelerate_env="ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION",
    )
    cache_dir: str = schema_field(
        "",
        "Where torch.compile's caches (Inductor, AOTAutograd, Triton) and torch_xla's "
        "persistent cache live, kept between launches instead of under /tmp. Empty: "
        "runs_dir/compile_cache. Checkpoints carry a run's compiled artifacts too.",
    )


@dataclass(frozen=True)
class CheckpointOptions:
    """Periodic saves, durable places and save-and-stop: runs that outlive their machine."""

    every: str = schema_field(
        "auto",
        "Save the whole training state at a step every rank agrees on, in the background: "
        "seconds ('600'), a duration ('15min', '2h') or steps ('500 steps'); 'off'. 'auto': "
        "every 15min when checkpoint_dir is set or resume is not 'never', else off.",
        number_as_text=True,
    )
    dir: str = schema_field(
        "",
        "Where periodic and stop checkpoints go: a folder (Colab's Drive, /kaggle/working) or "
        "an fsspec URL (gs://, s3://, hf://), written locally first and copied in the "
        "background. Empty: runs_dir/checkpoints/<the function's name>.",
    )
    keep: int = schema_field(2, "How many of the newest checkpoints to keep.", minimum=1)
    grace: float = schema_field(
        120.0,
        "Seconds the ranks have to save when asked to stop (SIGTERM or SIGUSR1, max_duration, "
        "Stop's save and stop, run.stop(save=True)) before they are ended.",
        minimum=1.0,
    )
