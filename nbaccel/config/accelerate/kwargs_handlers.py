"""Accelerate's kwargs handlers and its two small plugins, as torch-free dataclasses.

Same names, constructor keywords, order and defaults as Accelerate 1.15
(``accelerate.utils.dataclasses``), so ``from nbaccel.utils import DistributedDataParallelKwargs``
is a drop-in. The difference: nothing here reads the environment. Where Accelerate's
``__post_init__`` fills a None from ``ACCELERATE_*`` variables, the field stays None ("not
set") and ``nbaccel.config.accelerator_options`` takes the launch's resolved Config instead.

A handler passed to ``Accelerator(kwargs_handlers=[...])`` reaches the worker as plain
keywords (``to_kwargs()``: the fields that differ from the class's defaults, as Accelerate's);
``GradientAccumulationPlugin`` and ``TorchDynamoPlugin`` fill config fields. Plain data, stdlib
only: the worker side turns these into torch objects.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from nbaccel.config.sections import COMPILE_MODES

__all__ = [
    "HANDLER_TYPES",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "Handlers",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "ProfileKwargs",
    "TorchDynamoPlugin",
    "collect_handlers",
    "foreign_type",
]

PROFILER_ACTIVITIES = ("cpu", "xpu", "mtia", "cuda", "hpu")
PROFILER_SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first")


class KwargsHandler:
    """Base of the handlers: ``to_kwargs()`` gives the fields set away from their defaults.

    >>> GradScalerKwargs(init_scale=1024.0).to_kwargs()
    {'init_scale': 1024.0}
    """

    def to_dict(self) -> dict[str, Any]:
        return {spec.name: copy.deepcopy(getattr(self, spec.name)) for spec in _fields(self)}

    def to_kwargs(self) -> dict[str, Any]:
        default = type(self)().to_dict()
        return {k: v for k, v in self.to_dict().items() if default[k] != v}


def _fields(obj: object) -> tuple[dataclasses.Field[Any], ...]:
    return dataclasses.fields(obj)  # type: ignore[arg-type]


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(
            f"{name}={value!r} is not one of {', '.join(map(repr, choices))}. Use one of those."
        )


@dataclass
class AutocastKwargs(KwargsHandler):
    """Keywords for ``torch.autocast`` in ``Accelerator.autocast()``.

    >>> AutocastKwargs(cache_enabled=True).to_kwargs()
    {'cache_enabled': True}
    """

    enabled: bool = True
    cache_enabled: bool | None = None


class DDPCommunicationHookType(str, enum.Enum):
    """A DDP communication hook (Accelerate's names and values)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

    def __str__(self) -> str:
        return self.value


def _hook(name: str, value: Any, allowed: tuple[DDPCommunicationHookType, ...]) -> Any:
    text = getattr(value, "value", value)  # Accelerate's own enum, ours, or its string
    hook = next((h for h in allowed if h.value == text), None)
    if hook is None:
        _choice(name, text, tuple(h.value for h in allowed))
    return hook


# Hooks that can wrap another (compress its result); the power_sgd ones cannot.
_WRAPPERS = (
    DDPCommunicationHookType.NO,
    DDPCommunicationHookType.FP16,
    DDPCommunicationHookType.BF16,
)


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Keywords for ``DistributedDataParallel`` and the communication hook to register on it.

    ``to_kwargs()`` leaves the ``comm_*`` fields out (they are no DDP keyword), as Accelerate.

    >>> DistributedDataParallelKwargs(find_unused_parameters=True, comm_hook="fp16").to_kwargs()
    {'find_unused_parameters': True}
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.comm_hook = _hook("comm_hook", self.comm_hook, tuple(DDPCommunicationHookType))
        self.comm_wrapper = _hook("comm_wrapper", self.comm_wrapper, _WRAPPERS)

    def to_dict(self) -> dict[str, Any]:
        hooks = ("comm_hook", "comm_wrapper", "comm_state_option")
        return {k: v for k, v in super().to_dict().items() if k not in hooks}


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Keywords for the fp16 loss scaler (``torch.amp.GradScaler``).

    >>> GradScalerKwargs(backoff_factor=0.25).to_kwargs()
    {'backoff_factor': 0.25}
    """

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Keywords for ``torch.distributed.init_process_group``; a None ``timeout`` becomes
    Accelerate's default for the backend (1800 s, or 600 s for nccl).

    >>> InitProcessGroupKwargs(timeout=timedelta(seconds=800)).to_kwargs()
    {'timeout': datetime.timedelta(seconds=800)}
    """

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        if self.timeout is None:
            self.timeout = timedelta(seconds=600 if self.backend == "nccl" else 1800)
        elif not isinstance(self.timeout, timedelta):
            raise TypeError(
                f"InitProcessGroupKwargs(timeout={self.timeout!r}): the timeout is a "
                "datetime.timedelta, e.g. timedelta(seconds=800)."
            )


@dataclass
class ProfileKwargs(KwargsHandler):
    """Settings for ``torch.profiler.profile`` in ``Accelerator.profile()``.

    >>> ProfileKwargs(activities=["cpu"], record_shapes=True).to_kwargs()
    {'activities': ['cpu'], 'record_shapes': True}
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable[..., Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def __post_init__(self) -> None:
        for activity in self.activities or ():
            _choice("ProfileKwargs activity", activity, PROFILER_ACTIVITIES)
        for key in self.schedule_option or {}:
            _choice("ProfileKwargs schedule_option key", key, PROFILER_SCHEDULE_KEYS)


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """How gradients accumulate; pass as ``Accelerator(gradient_accumulation_plugin=...)``.

    ``num_steps`` and ``sync_each_batch`` fill the run's config (``None`` steps: 1, as in
    Accelerate); ``adjust_scheduler`` and ``sync_with_dataloader`` go to the worker as they are.

    >>> GradientAccumulationPlugin(num_steps=4).num_steps
    4
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """``torch.compile`` settings; pass as ``Accelerator(dynamo_plugin=...)``.

    ``backend``, ``mode``, ``fullgraph``, ``dynamic`` and ``use_regional_compilation`` fill
    the config's ``dynamo_backend`` and ``dynamo`` section (None: the launch's, as Accelerate
    reads ``ACCELERATE_DYNAMO_*``); ``options`` and ``disable`` go to ``torch.compile`` as they
    are. ``backend`` may be a string in any case or Accelerate's ``DynamoBackend``.

    >>> TorchDynamoPlugin(backend="INDUCTOR", mode="max-autotune").backend
    'inductor'
    """

    backend: str | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        if self.backend is not None:
            self.backend = str(getattr(self.backend, "value", self.backend)).lower()
        if self.mode is not None:
            _choice("TorchDynamoPlugin mode", self.mode, COMPILE_MODES)


HANDLER_TYPES = (
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    AutocastKwargs,
    ProfileKwargs,
)


@dataclass(frozen=True)
class Handlers:
    """The kwargs handlers of one Accelerator, at most one of each kind."""

    ddp: DistributedDataParallelKwargs | None = None
    scaler: GradScalerKwargs | None = None
    init: InitProcessGroupKwargs | None = None
    autocast: AutocastKwargs | None = None
    profile: ProfileKwargs | None = None


# Which Handlers field holds each kind (Handlers' fields are in HANDLER_TYPES' order).
_SLOTS = dict(zip(HANDLER_TYPES, ("ddp", "scaler", "init", "autocast", "profile"), strict=True))


def collect_handlers(given: Iterable[object] | None) -> Handlers:
    """Sort ``kwargs_handlers`` by kind; refuses two of one kind and unknown types.

    >>> handlers = collect_handlers([GradScalerKwargs(init_scale=2.0)])
    >>> handlers.scaler.init_scale, handlers.ddp
    (2.0, None)
    """
    found: dict[str, Any] = {}
    for handler in given or ():
        kind = next((k for k in HANDLER_TYPES if isinstance(handler, k)), None)
        if kind is None:
            raise TypeError(_unknown_handler(handler))
        slot = _SLOTS[kind]
        if slot in found:
            raise ValueError(
                f"You can only pass one {kind.__name__} in kwargs_handlers (as in Accelerate); "
                f"got {found[slot]!r} and {handler!r}. Merge them into one."
            )
        found[slot] = handler
    return Handlers(**found)


def _unknown_handler(handler: object) -> str:
    kind = type(handler)
    if isinstance(handler, GradientAccumulationPlugin | TorchDynamoPlugin):
        keyword = (
            "gradient_accumulation_plugin"
            if isinstance(handler, GradientAccumulationPlugin)
            else "dynamo_plugin"
        )
        return f"{kind.__name__} is no kwargs handler: pass it as Accelerator({keyword}=...)."
    if kind.__module__.startswith("accelerate."):
        return foreign_type("kwargs_handlers", handler, kind.__name__)
    names = ", ".join(k.__name__ for k in HANDLER_TYPES)
    return (
        f"Unsupported kwargs handler {handler!r:.80} ({kind.__module__}.{kind.__qualname__}): "
        f"nbaccel takes {names} (Accelerate's FP8 recipe handlers are not supported)."
    )


def foreign_type(argument: str, value: object, wanted: str) -> str:
    """The message for an argument of the wrong type, pointing Accelerate's own at ours."""
    kind = type(value)
    if kind.__module__.startswith("accelerate.") and kind.__name__ == wanted:
        return (
            f"{argument} got Accelerate's own {wanted} ({kind.__module__}); nbaccel takes its "
            f"own, with the same keywords: from nbaccel.utils import {wanted}."
        )
    return f"{argument} must be a {wanted}, got {kind.__name__} {value!r:.80}."
