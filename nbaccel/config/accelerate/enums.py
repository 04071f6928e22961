"""Accelerate's enums (``accelerate.utils.PrecisionType`` and the others), torch-free.

Programs written for Accelerate compare against these and pass them as arguments
(``Accelerator(mixed_precision=PrecisionType.BF16, log_with=LoggerType.TENSORBOARD)``,
``if accelerator.distributed_type == DistributedType.MULTI_GPU:``), so the member names and
values are Accelerate's 1.x ones, including members for hardware nbaccel never reports
(``MULTI_NPU``, ``MEGATRON_LM``): a comparison with them must run and be false, not fail.

Every enum is a ``str`` enum, so a member equals its value and goes wherever nbaccel takes a
string. As in Accelerate, ``PrecisionType``, ``DynamoBackend``, ``LoggerType`` and ``RNGType``
print as their value, answer ``in`` for values and list them; ``DistributedType`` is a plain
``str`` enum there, and here too.

>>> PrecisionType.BF16 == "bf16", str(LoggerType.TENSORBOARD), "fp16" in PrecisionType
(True, 'tensorboard', True)
>>> DynamoBackend.list()[:3]
['NO', 'EAGER', 'AOT_EAGER']
"""

from __future__ import annotations

import enum

__all__ = ["DistributedType", "DynamoBackend", "LoggerType", "PrecisionType", "RNGType"]


class _ValueEnumType(enum.EnumMeta):
    """Lets ``"bf16" in PrecisionType`` test values (Python 3.11's ``in`` takes members only)."""

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class _ValueEnum(str, enum.Enum, metaclass=_ValueEnumType):
    """A str enum that prints as its value, with Accelerate's ``list()``."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def list(cls) -> list[str]:
        """Every value, in definition order."""
        return [str(member) for member in cls]


class PrecisionType(_ValueEnum):
    """A ``mixed_precision`` value (nbaccel trains in ``no``, ``fp16`` and ``bf16``; ``fp8``
    is refused where it is used, naming the reason)."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class DynamoBackend(_ValueEnum):
    """A ``torch.compile`` backend, as Accelerate's ``dynamo_backend`` names it."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class LoggerType(_ValueEnum):
    """An experiment tracker for ``log_with=`` (``ALL``: every one installed)."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"


class RNGType(_ValueEnum):
    """A random number generator a prepared dataloader synchronises (``rng_types=``)."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class DistributedType(str, enum.Enum):
    """How the model is distributed. nbaccel reports ``NO``, ``MULTI_CPU``, ``MULTI_GPU``,
    ``FSDP``, ``DEEPSPEED`` and ``XLA``; the others exist so that Accelerate programs that
    compare against them run."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
