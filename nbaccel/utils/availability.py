"""Whether optional packages and devices are there (Accelerate's ``is_*_available``).

Package checks look the package up without importing it: importing some of them costs
seconds or has side effects (torch_xla writes environment variables and starts its runtime).
Only the device checks import torch, when called, so a notebook kernel can ask the others.
"""

from __future__ import annotations

import importlib.util

from nbaccel.hardware.xla_plan import check_versions

__all__ = [
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
]


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def is_torch_xla_available() -> bool:
    """Whether torch_xla is installed and matches torch (so that importing it works).

    >>> isinstance(is_torch_xla_available(), bool)
    True
    """
    return check_versions() is None


def is_cuda_available() -> bool:
    """Whether torch sees a CUDA device."""
    import torch

    return torch.cuda.is_available()


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bfloat16 compute is supported here: on CUDA devices that support it, on CPUs
    (autocast runs bf16 on every x86/ARM CPU torch supports), and on TPUs.

    >>> is_bf16_available()
    True
    """
    if not ignore_tpu and is_torch_xla_available():
        return True
    import torch

    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    return True


def is_datasets_available() -> bool:
    """Whether Hugging Face ``datasets`` is installed."""
    return _installed("datasets")


def is_transformers_available() -> bool:
    """Whether Hugging Face ``transformers`` is installed."""
    return _installed("transformers")


def is_deepspeed_available() -> bool:
    """Whether DeepSpeed is installed."""
    return _installed("deepspeed")


def is_rich_available() -> bool:
    """Whether ``rich`` is installed."""
    return _installed("rich")


def is_tensorboard_available() -> bool:
    """Whether a TensorBoard writer is installed (``tensorboard`` or ``tensorboardX``)."""
    return _installed("tensorboard") or _installed("tensorboardX")


def is_wandb_available() -> bool:
    """Whether Weights & Biases (``wandb``) is installed."""
    return _installed("wandb")


def is_mlflow_available() -> bool:
    """Whether MLflow is installed."""
    return _installed("mlflow")
