"""Hugging Face Accelerate's ``accelerate.utils`` names, for ``from nbaccel.utils import ...``.

Code written for Accelerate runs with ``accelerate.utils`` changed to ``nbaccel.utils``:
seeding, module-level collectives, batch-size search, empty-weight model creation, unwrapping
(``extract_model_from_parallel``), ``save``, ``tqdm``, ``write_basic_config``, availability
checks, Accelerate's enums, plugins and kwargs handlers, and DeepSpeed's ``DummyOptim`` /
``DummyScheduler``. The configuration of features nbaccel lacks (Megatron-LM, tensor
parallelism, fp8 recipes) imports fine and raises ``NotImplementedError`` with the reason when
used. The names load on first use, so ``import nbaccel.utils`` in a notebook kernel does not
import torch, and neither do the enums, plugins, handlers, ``DummyOptim``/``DummyScheduler``,
``write_basic_config`` and the ``is_*_available`` package checks. The others (``set_seed``,
``gather``, ...) come to a kernel as stand-ins that import torch when first called
(``nbaccel.lazy_names``); a function sent to the workers gets the real ones.

>>> from nbaccel.utils import set_seed, gather_object
>>> set_seed(0)
>>> gather_object(["only rank"])
['only rank']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nbaccel import lazy_names

if TYPE_CHECKING:
    from nbaccel.accel.data.skip_batches import skip_first_batches
    from nbaccel.accel.refusals import (
        AORecipeKwargs,
        FP8RecipeKwargs,
        MegatronLMPlugin,
        MSAMPRecipeKwargs,
        TERecipeKwargs,
        TorchTensorParallelPlugin,
    )
    from nbaccel.config.accelerate.configs import DataLoaderConfiguration, ProjectConfiguration
    from nbaccel.config.accelerate.enums import (
        DistributedType,
        DynamoBackend,
        LoggerType,
        PrecisionType,
        RNGType,
    )
    from nbaccel.config.accelerate.fsdp_plugin import FullyShardedDataParallelPlugin
    from nbaccel.config.accelerate.kwargs_handlers import (
        AutocastKwargs,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradientAccumulationPlugin,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        KwargsHandler,
        ProfileKwargs,
        TorchDynamoPlugin,
    )
    from nbaccel.config.accelerate.plugins import DeepSpeedPlugin
    from nbaccel.config.deepspeed.placeholders import DummyOptim, DummyScheduler
    from nbaccel.utils.availability import (
        is_bf16_available,
        is_cuda_available,
        is_datasets_available,
        is_deepspeed_available,
        is_mlflow_available,
        is_rich_available,
        is_tensorboard_available,
        is_torch_xla_available,
        is_transformers_available,
        is_wandb_available,
    )
    from nbaccel.utils.basic_config import write_basic_config
    from nbaccel.utils.memory import (
        find_executable_batch_size,
        release_memory,
        should_reduce_batch_size,
    )
    from nbaccel.utils.modeling import (
        extract_model_from_parallel,
        init_empty_weights,
        init_on_device,
    )
    from nbaccel.utils.operations import (
        broadcast,
        broadcast_object_list,
        gather,
        gather_object,
        pad_across_processes,
        reduce,
        send_to_device,
        wait_for_everyone,
    )
    from nbaccel.utils.progress import tqdm
    from nbaccel.utils.random import set_seed, synchronize_rng_state, synchronize_rng_states
    from nbaccel.utils.saving import save

_HANDLERS = (
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "ProfileKwargs",
    "TorchDynamoPlugin",
)
# Each name, by the module that defines it (imported on first use).
_DEFINED_IN = {
    "DistributedType": "nbaccel.config.accelerate.enums",
    "skip_first_batches": "nbaccel.accel.data.skip_batches",
    **dict.fromkeys(
        (
            "broadcast",
            "broadcast_object_list",
            "gather",
            "gather_object",
            "pad_across_processes",
            "reduce",
            "send_to_device",
            "wait_for_everyone",
        ),
        "nbaccel.utils.operations",
    ),
    **dict.fromkeys(
        ("set_seed", "synchronize_rng_state", "synchronize_rng_states"), "nbaccel.utils.random"
    ),
    **dict.fromkeys(
        ("find_executable_batch_size", "release_memory", "should_reduce_batch_size"),
        "nbaccel.utils.memory",
    ),
    **dict.fromkeys(
        ("extract_model_from_parallel", "init_empty_weights", "init_on_device"),
        "nbaccel.utils.modeling",
    ),
    "save": "nbaccel.utils.saving",
    "tqdm": "nbaccel.utils.progress",
    "write_basic_config": "nbaccel.utils.basic_config",
    **dict.fromkeys(
        (
            "is_bf16_available",
            "is_cuda_available",
            "is_datasets_available",
            "is_deepspeed_available",
            "is_mlflow_available",
            "is_rich_available",
            "is_tensorboard_available",
            "is_torch_xla_available",
            "is_transformers_available",
            "is_wandb_available",
        ),
        "nbaccel.utils.availability",
    ),
    # -- Accelerate's plugins, kwargs handlers and configuration classes (torch-free) -------
    "DeepSpeedPlugin": "nbaccel.config.accelerate.plugins",
    "FullyShardedDataParallelPlugin": "nbaccel.config.accelerate.fsdp_plugin",
    **dict.fromkeys(_HANDLERS, "nbaccel.config.accelerate.kwargs_handlers"),
    **dict.fromkeys(
        ("ProjectConfiguration", "DataLoaderConfiguration"), "nbaccel.config.accelerate.configs"
    ),
    **dict.fromkeys(
        ("DynamoBackend", "LoggerType", "PrecisionType", "RNGType"),
        "nbaccel.config.accelerate.enums",
    ),
    **dict.fromkeys(("DummyOptim", "DummyScheduler"), "nbaccel.config.deepspeed.placeholders"),
    # Refused by name: using one raises NotImplementedError with the reason (accel/refusals.py).
    **dict.fromkeys(
        (
            "AORecipeKwargs",
            "FP8RecipeKwargs",
            "MSAMPRecipeKwargs",
            "MegatronLMPlugin",
            "TERecipeKwargs",
            "TorchTensorParallelPlugin",
        ),
        "nbaccel.accel.refusals",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _DEFINED_IN:
        # A stand-in while the defining module would import torch into a kernel (set_seed,
        # gather, ...): it loads on first use, and a worker unpickles the real function.
        return lazy_names.load(_DEFINED_IN[name], name, package=__name__)
    raise AttributeError(f"module 'nbaccel.utils' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "AORecipeKwargs",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "DynamoBackend",
    "FP8RecipeKwargs",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "MSAMPRecipeKwargs",
    "MegatronLMPlugin",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "TERecipeKwargs",
    "TorchDynamoPlugin",
    "TorchTensorParallelPlugin",
    "broadcast",
    "broadcast_object_list",
    "extract_model_from_parallel",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "init_empty_weights",
    "init_on_device",
    "is_bf16_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_mlflow_available",
    "is_rich_available",
    "is_tensorboard_available",
    "is_torch_xla_available",
    "is_transformers_available",
    "is_wandb_available",
    "pad_across_processes",
    "reduce",
    "release_memory",
    "save",
    "send_to_device",
    "set_seed",
    "should_reduce_batch_size",
    "skip_first_batches",
    "synchronize_rng_state",
    "synchronize_rng_states",
    "tqdm",
    "wait_for_everyone",
    "write_basic_config",
]
