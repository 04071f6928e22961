"""The parts of Accelerate's API that nbaccel refuses by name, each with its reason.

nbaccel covers Accelerate's training-loop API for data parallelism (DDP), FSDP2, ZeRO,
DeepSpeed and XLA. Tensor, pipeline and context parallelism, fp8 training (TransformerEngine,
MS-AMP, torchao), Megatron-LM and big-model inference (device maps, CPU and disk offloading) are
outside its scope. A program that uses one of those gets a ``NotImplementedError`` that says
which feature it touched, why nbaccel lacks it and what to use instead, instead of an
``AttributeError`` or, worse, a silent no-op.

How a refused member behaves depends on how Accelerate exposes it:

- a method: a real method that raises ``RefusedError`` when called;
- a property or an instance attribute: a descriptor that raises ``RefusedAttributeError`` when
  read or assigned. That error is both a ``NotImplementedError`` and an ``AttributeError``, so
  ``hasattr(acc, "fp8_enabled")`` is ``False`` and ``getattr(acc, "fp8_enabled", None)`` gives
  ``None`` (code that probes, such as transformers' ``Trainer``, keeps working) while a plain
  read still explains itself.

The members are written into the class at its creation by ``refuse_members`` (a class
decorator), not served by ``__getattr__``: ``dir()``, ``inspect`` and IDEs see them, and a class
that implements a member and also refuses it fails at import.

>>> @refuse_members
... class Facade:
...     pass
>>> hasattr(Facade(), "fp8_enabled")
False
>>> Facade().maybe_context_parallel()
Traceback (most recent call last):
...
nbaccel.accel.refusals.RefusedError: Accelerator.maybe_context_parallel is not supported ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, TypeVar

T = TypeVar("T", bound=type)

Kind = Literal["method", "property", "attribute", "function", "class", "argument"]


class RefusedError(NotImplementedError):
    """A refused Accelerate member was used; the message says why and what to use instead."""


class RefusedAttributeError(RefusedError, AttributeError):
    """A refused property or attribute was read: also an ``AttributeError``, so that
    ``hasattr`` answers ``False`` and ``getattr(obj, name, default)`` returns the default."""


@dataclass(frozen=True)
class Refusal:
    """One Accelerate name nbaccel does not provide.

    ``where`` is how a program reaches it (``Accelerator``, ``accelerate``,
    ``accelerate.utils``, ``Accelerator(...)`` for constructor arguments); ``kind`` is what it
    is there.
    """

    where: str
    name: str
    kind: Kind
    reason: str
    instead: str

    @property
    def message(self) -> str:
        """What happened, why, and the fix, in one error message."""
        subject = {
            "Accelerator": f"Accelerator.{self.name}",
            "Accelerator(...)": f"Accelerator({self.name}=...)",
        }.get(self.where, f"{self.where}.{self.name}")
        return f"{subject} is not supported by nbaccel: {self.reason}. {self.instead}"


# Why, per refused feature. Shared by every name that belongs to it, so that one feature
# explains itself the same way wherever a program meets it.
_OUT_OF_SCOPE = "is outside nbaccel's scope, which is data parallelism (DDP), FSDP2, ZeRO,"
_SCOPE_END = " DeepSpeed and XLA"
_TENSOR = (
    f"tensor parallelism (ParallelismConfig(tp_size=...), the torch_device_mesh 'tp' dimension) "
    f"{_OUT_OF_SCOPE}{_SCOPE_END}",
    "To fit a model too large for one device, shard it with FSDP2 (strategy='fsdp' or "
    "fsdp_plugin=FullyShardedDataParallelPlugin(...)) or DeepSpeed ZeRO-3.",
)
_PIPELINE = (
    f"pipeline parallelism (prepare_pippy, ParallelismConfig pipeline stages) {_OUT_OF_SCOPE}"
    f"{_SCOPE_END}; Accelerate itself raises NotImplementedError for pipeline_parallel_rank",
    "Shard the model with FSDP2 (strategy='fsdp') or DeepSpeed ZeRO-3 instead of splitting it "
    "into stages.",
)
_CONTEXT = (
    f"context (sequence) parallelism (ParallelismConfig(cp_size=...), DeepSpeed Ulysses) "
    f"{_OUT_OF_SCOPE}{_SCOPE_END}",
    "Remove the call: under nbaccel every rank sees whole sequences. For long sequences, shard "
    "the model with FSDP2 and use activation checkpointing.",
)
_MESH = (
    "nbaccel builds no N-dimensional device mesh (Accelerate's ParallelismConfig), so there is "
    "no per-dimension rank to report; Accelerate raises too when no parallelism_config is set",
    "With nbaccel all processes are data-parallel: the data-parallel rank is "
    "accelerator.process_index, out of accelerator.num_processes.",
)
_FP8 = (
    f"fp8 training (TransformerEngine, MS-AMP, torchao recipes) {_OUT_OF_SCOPE}{_SCOPE_END} "
    "with fp32, bf16 or fp16 mixed precision",
    "Train with mixed_precision='bf16' (or 'fp16'), and drop fp8 recipe handlers from "
    "kwargs_handlers.",
)
_MEGATRON = (
    f"Megatron-LM integration {_OUT_OF_SCOPE}{_SCOPE_END}",
    "Use FSDP2 (strategy='fsdp') or DeepSpeed (deepspeed_plugin=DeepSpeedPlugin(...)) for "
    "large models.",
)

_BIG_MODEL = (
    f"device-map dispatch and CPU/disk offloading for inference of a model larger than one "
    f"device (Accelerate's big_modeling) {_OUT_OF_SCOPE}{_SCOPE_END} for training",
    "The model nbaccel trained is a plain torch module (accelerator.unwrap_model) and "
    "accelerator.save_model writes a plain safetensors file: load it with Accelerate's own "
    "big_modeling functions (from accelerate import load_checkpoint_and_dispatch, ...) in the "
    "inference process.",
)


def _entries(where: str, kind: Kind, feature: tuple[str, str], *names: str) -> dict[str, Refusal]:
    reason, instead = feature
    return {name: Refusal(where, name, kind, reason, instead) for name in names}


# Accelerator members (methods, properties, and the attributes Accelerate sets in __init__).
ACCELERATOR_REFUSALS: Mapping[str, Refusal] = {
    **_entries("Accelerator", "property", _TENSOR, "tensor_parallel_rank"),
    **_entries("Accelerator", "property", _PIPELINE, "pipeline_parallel_rank"),
    **_entries("Accelerator", "property", _CONTEXT, "context_parallel_rank"),
    **_entries("Accelerator", "method", _CONTEXT, "maybe_context_parallel"),
    **_entries("Accelerator", "method", _CONTEXT, "deepspeed_ulysses_dl_adapter"),
    **_entries("Accelerator", "property", _MESH, "data_parallel_rank", "data_parallel_shard_rank"),
    **_entries("Accelerator", "property", _FP8, "fp8_backend"),
    **_entries(
        "Accelerator",
        "attribute",
        _FP8,
        "fp8_enabled",
        "has_fp8_handler",
        "delayed_fp8_autocast",
        "fp8_recipe_handler",
        "ao_recipe_handler",
        "te_recipe_handler",
        "msamp_recipe_handler",
    ),
}

# Names imported from the top level of ``accelerate``.
TOP_LEVEL_REFUSALS: Mapping[str, Refusal] = {
    **_entries("accelerate", "function", _PIPELINE, "prepare_pippy"),
    **_entries("accelerate", "class", _TENSOR, "ParallelismConfig"),
    **_entries(
        "accelerate",
        "function",
        _BIG_MODEL,
        "cpu_offload",
        "cpu_offload_with_hook",
        "disk_offload",
        "dispatch_model",
        "infer_auto_device_map",
        "load_checkpoint_and_dispatch",
        "load_checkpoint_in_model",
    ),
}

# Names imported from ``accelerate.utils``.
UTILS_REFUSALS: Mapping[str, Refusal] = {
    **_entries("accelerate.utils", "class", _MEGATRON, "MegatronLMPlugin"),
    **_entries("accelerate.utils", "class", _TENSOR, "TorchTensorParallelPlugin"),
    **_entries(
        "accelerate.utils",
        "class",
        _FP8,
        "FP8RecipeKwargs",
        "TERecipeKwargs",
        "MSAMPRecipeKwargs",
        "AORecipeKwargs",
    ),
}

# Accelerator(...) constructor arguments: refused when given a value other than None.
ARGUMENT_REFUSALS: Mapping[str, Refusal] = {
    **_entries("Accelerator(...)", "argument", _MEGATRON, "megatron_lm_plugin"),
    **_entries("Accelerator(...)", "argument", _TENSOR, "torch_tp_plugin", "parallelism_config"),
}


class RefusedProperty:
    """A property (or instance attribute) of Accelerate's that nbaccel refuses.

    Read on the class it is itself (so ``inspect`` and the API-surface test find it); read or
    assigned on an instance it raises ``RefusedAttributeError``.
    """

    def __init__(self, refusal: Refusal) -> None:
        self.refusal = refusal
        self.__doc__ = f"Not supported by nbaccel: {refusal.reason}. {refusal.instead}"

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is None:
            return self
        raise RefusedAttributeError(self.refusal.message)

    def __set__(self, instance: object, value: object) -> NoReturn:
        # Also catches a facade whose __init__ assigns a member it refuses.
        raise RefusedAttributeError(self.refusal.message)


def refused_function(refusal: Refusal) -> Callable[..., NoReturn]:
    """A function (or method) that raises ``RefusedError`` with ``refusal``'s message.

    >>> pippy = refused_function(TOP_LEVEL_REFUSALS["prepare_pippy"])
    >>> pippy.__name__, pippy.refusal.kind
    ('prepare_pippy', 'function')
    """

    def refused(*args: object, **kwargs: object) -> NoReturn:
        raise RefusedError(refusal.message)

    refused.__name__ = refused.__qualname__ = refusal.name
    refused.__doc__ = f"Not supported by nbaccel: {refusal.reason}. {refusal.instead}"
    refused.refusal = refusal  # type: ignore[attr-defined]  # how tests and tools recognise it
    return refused


def refused_class(refusal: Refusal) -> type:
    """A class whose construction raises ``RefusedError``; ``isinstance`` checks still work.

    >>> Config = refused_class(TOP_LEVEL_REFUSALS["ParallelismConfig"])
    >>> isinstance(object(), Config)
    False
    >>> Config(tp_size=2)
    Traceback (most recent call last):
    ...
    nbaccel.accel.refusals.RefusedError: accelerate.ParallelismConfig is not supported by ...
    """

    def __init__(self: object, *args: object, **kwargs: object) -> NoReturn:
        raise RefusedError(refusal.message)

    doc = f"Not supported by nbaccel: {refusal.reason}. {refusal.instead}"
    return type(refusal.name, (), {"__init__": __init__, "__doc__": doc, "refusal": refusal})


def refusal_of(owner: type, name: str) -> Refusal | None:
    """The refusal ``owner.name`` stands for, or ``None`` when it is not a refused member."""
    for klass in owner.__mro__:
        member = vars(klass).get(name)
        if isinstance(member, RefusedProperty):
            return member.refusal
        if member is not None:
            found = getattr(member, "refusal", None)
            return found if isinstance(found, Refusal) else None
    return None


def refuse_members(cls: T) -> T:
    """Class decorator: add every member of ``ACCELERATOR_REFUSALS`` to ``cls``.

    Raises ``TypeError`` when ``cls`` already defines one of them: a member is implemented or
    refused, never both.
    """
    clashes = sorted(name for name in ACCELERATOR_REFUSALS if hasattr(cls, name))
    if clashes:
        raise TypeError(
            f"{cls.__name__} defines {', '.join(clashes)}, which nbaccel.accel.refusals also "
            "refuses. Remove the name from ACCELERATOR_REFUSALS if it is now implemented, "
            "or drop the implementation."
        )
    for name, refusal in ACCELERATOR_REFUSALS.items():
        if refusal.kind == "method":
            method = refused_function(refusal)
            method.__qualname__ = f"{cls.__qualname__}.{name}"
            setattr(cls, name, method)
        else:
            member = RefusedProperty(refusal)
            member.__set_name__(cls, name)
            setattr(cls, name, member)
    return cls


def refuse_arguments(arguments: Mapping[str, object]) -> None:
    """Raise ``RefusedError`` for the first refused constructor argument that was given.

    ``None`` counts as not given, as in Accelerate's signature defaults.

    >>> refuse_arguments({"parallelism_config": None, "mixed_precision": "bf16"})
    >>> refuse_arguments({"megatron_lm_plugin": object()})
    Traceback (most recent call last):
    ...
    nbaccel.accel.refusals.RefusedError: Accelerator(megatron_lm_plugin=...) is not supported ...
    """
    for name, value in arguments.items():
        refusal = ARGUMENT_REFUSALS.get(name)
        if refusal is not None and value is not None:
            raise RefusedError(refusal.message)


def all_refusals() -> dict[tuple[str, str], Refusal]:
    """Every refusal, by (where, name)."""
    tables = (ACCELERATOR_REFUSALS, TOP_LEVEL_REFUSALS, UTILS_REFUSALS, ARGUMENT_REFUSALS)
    return {(r.where, r.name): r for table in tables for r in table.values()}


# Module-level stand-ins, for nbaccel and nbaccel.utils to export under Accelerate's names
# (``from nbaccel import prepare_pippy`` then fails only when called, with the reason).
prepare_pippy = refused_function(TOP_LEVEL_REFUSALS["prepare_pippy"])
ParallelismConfig = refused_class(TOP_LEVEL_REFUSALS["ParallelismConfig"])
cpu_offload = refused_function(TOP_LEVEL_REFUSALS["cpu_offload"])
cpu_offload_with_hook = refused_function(TOP_LEVEL_REFUSALS["cpu_offload_with_hook"])
disk_offload = refused_function(TOP_LEVEL_REFUSALS["disk_offload"])
dispatch_model = refused_function(TOP_LEVEL_REFUSALS["dispatch_model"])
infer_auto_device_map = refused_function(TOP_LEVEL_REFUSALS["infer_auto_device_map"])
load_checkpoint_and_dispatch = refused_function(TOP_LEVEL_REFUSALS["load_checkpoint_and_dispatch"])
load_checkpoint_in_model = refused_function(TOP_LEVEL_REFUSALS["load_checkpoint_in_model"])
MegatronLMPlugin = refused_class(UTILS_REFUSALS["MegatronLMPlugin"])
TorchTensorParallelPlugin = refused_class(UTILS_REFUSALS["TorchTensorParallelPlugin"])
FP8RecipeKwargs = refused_class(UTILS_REFUSALS["FP8RecipeKwargs"])
TERecipeKwargs = refused_class(UTILS_REFUSALS["TERecipeKwargs"])
MSAMPRecipeKwargs = refused_class(UTILS_REFUSALS["MSAMPRecipeKwargs"])
AORecipeKwargs = refused_class(UTILS_REFUSALS["AORecipeKwargs"])
