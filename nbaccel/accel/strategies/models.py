"""Preparing a model: device, autocast forward, torch.compile, FSDP2; and undoing it.

``prepare_model`` returns what the training loop calls. ``unwrap_model`` peels DDP (and
torch_xla's FSDPv2) and torch.compile off again and restores the original ``forward``, so
saved weights have no ``module.`` / ``_orig_module.`` / ``_orig_mod.`` prefixes and an
unwrapped model runs in full precision. The strategies (``nbaccel.accel.strategies``) use
these and add their own wrapping (DDP, FSDPv2).

``Compilation`` carries what the Accelerator was told about ``torch.compile``: the backend,
the keywords (``mode``, ``fullgraph``, ``dynamic``, ``options``, ``disable``: the dynamo
section and ``TorchDynamoPlugin``) and whether to compile by region. Regional compilation
(``compile_regions``) compiles each block of a ``ModuleList`` of same-class blocks on its own,
so the compiler's cache turns N compilations into one, and each remaining part whole; as in
Accelerate's ``compile_regions_fsdp2`` it compiles in place (``module.compile()``), so the
module tree and state-dict keys stay unchanged and FSDP's hooks keep running around each
block. The price: ``unwrap_model(keep_compile=False)`` cannot take in-place compilation off
(the same module is being trained); the weights and the numbers are the same either way.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from nbaccel.accel.checkpoints.weight_files import save_state_file
from nbaccel.accel.precision import Precision
from nbaccel.accel.state import ProcessState
from nbaccel.accel.strategies import sharding
from nbaccel.config.accelerator_options import AcceleratorOptions
from nbaccel.config.sections import FSDPOptions

# Marks a forward that prepare() wrapped in autocast; the original is kept on the wrapper.
_ORIGINAL_FORWARD = "__nbaccel_original_forward__"


@dataclass(frozen=True)
class Compilation:
    """How ``prepare`` compiles a model: ``torch.compile(backend=..., **kwargs)``, whole or by
    region (``regional``).

    >>> from nbaccel.config.schema import Config
    >>> options = AcceleratorOptions(Config(dynamo_backend="aot_eager"), {},
    ...                              compile_kwargs={"fullgraph": True})
    >>> Compilation.of(options).keywords()
    {'backend': 'aot_eager', 'fullgraph': True}
    >>> Compilation().enabled
    False
    """

    backend: str = "no"
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    regional: bool = False

    @classmethod
    def of(cls, options: AcceleratorOptions) -> Compilation:
        """What the Accelerator's config and options ask for."""
        config = options.config
        regional = config.dynamo.use_regional_compilation
        return cls(config.dynamo_backend, dict(options.compile_kwargs), regional)

    @property
    def enabled(self) -> bool:
        return self.backend != "no"

    def keywords(self) -> dict[str, Any]:
        """The keywords for ``torch.compile`` / ``module.compile``."""
        return {"backend": self.backend, **self.kwargs}


def prepare_model(
    model: torch.nn.Module,
    state: ProcessState,
    precision: Precision,
    *,
    device_placement: bool,
    dynamo_backend: str = "no",
    compilation: Compilation | None = None,
) -> torch.nn.Module:
    """On the device, forward in autocast, compiled: what every strategy starts from.

    ``compilation`` (from ``Compilation.of(options)``) wins over ``dynamo_backend``, which
    compiles with the backend alone and no other keyword.
    """
    compiled = compilation if compilation is not None else Compilation(dynamo_backend)
    if device_placement:
        model = model.to(state.device)
    if precision.dtype is not None and not hasattr(model.forward, _ORIGINAL_FORWARD):
        model.forward = _autocast_forward(model.forward, precision)
    if compiled.enabled:
        # Compiled before any DDP wrapping (the data-parallel strategy wraps the result):
        # torch.compile(DDP(...)) compiles nothing for some models (pytorch#140416).
        if compiled.regional:
            compile_regions(model, **compiled.keywords())
        else:
            model = torch.compile(model, **compiled.keywords())  # type: ignore[assignment]
    return model


def prepare_sharded_model(
    model: torch.nn.Module,
    state: ProcessState,
    precision: Precision,
    options: FSDPOptions,
    compilation: Compilation,
) -> dict[int, torch.nn.Parameter]:
    """FSDP2 in place (see ``sharding``); returns {id(old parameter): sharded parameter}."""
    if precision.dtype is not None and not hasattr(model.forward, _ORIGINAL_FORWARD):
        # Parameters are cast by FSDP's policy; autocast still keeps softmax, norms and
        # losses in fp32, as in the DDP path, so both strategies compute the same way.
        model.forward = _autocast_forward(model.forward, precision)
    swap = sharding.shard_model(model, options, state, precision.dtype)
    if compilation.enabled:
        # torch.compile of the FSDP root compiles nothing (FACTS.md); compiling in place
        # (each region, or each shard unit) does, with FSDP's hooks around the compiled
        # forward.
        if compilation.regional and has_repeated_blocks(model):
            compile_regions(model, **compilation.keywords())
            return swap
        units = [m for m in model.modules() if sharding.is_sharded(m) and m is not model]
        for unit in units or [model]:
            unit.compile(**compilation.keywords())
    return swap


def compile_regions(module: torch.nn.Module, **compile_kwargs: Any) -> None:
    """Compile ``module`` in place region by region: each block of a ``ModuleList`` whose
    blocks share one class, and every part without such a list as a whole.

    >>> blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), blocks)
    >>> compile_regions(model, backend="eager")
    >>> [m._compiled_call_impl is not None for m in (model, model[0], *blocks)]
    [False, True, True, True, True]
    """
    if isinstance(module, torch.nn.ModuleList) and _is_repeated_blocks(module):
        for block in module:
            block.compile(**compile_kwargs)
    elif has_repeated_blocks(module):
        for child in module.children():
            compile_regions(child, **compile_kwargs)
    else:
        module.compile(**compile_kwargs)


def has_repeated_blocks(module: torch.nn.Module) -> bool:
    """True when ``module`` holds, at any depth, a ``ModuleList`` of same-class blocks."""
    return any(_is_repeated_blocks(m) for m in module.modules())


def _is_repeated_blocks(module: torch.nn.Module) -> bool:
    if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
        return False
    return all(type(block) is type(module[0]) for block in module)


def _autocast_forward(forward: Callable[..., Any], precision: Precision) -> Callable[..., Any]:
    @functools.wraps(forward)
    def forward_in_autocast(*args: Any, **kwargs: Any) -> Any:
        with precision.forward_autocast():
            outputs = forward(*args, **kwargs)
        # Outputs leave in fp32 so the loss and metrics computed outside are full precision.
        return to_fp32(outputs)

    setattr(forward_in_autocast, _ORIGINAL_FORWARD, forward)
    return forward_in_autocast


_HALF = (torch.float16, torch.bfloat16)


def to_fp32(outputs: Any) -> Any:
    """``outputs`` with every fp16/bf16 tensor in it as fp32, what Accelerate's
    ``convert_outputs_to_fp32`` gives (the same values: the cast is exact).

    Only what holds a half tensor is rebuilt; a dict subclass (transformers' ``ModelOutput``,
    made by the forward that just ran) gets its half entries replaced in place: rebuilding
    one runs its dataclass ``__post_init__``, about half of nbaccel's Python work per step
    beyond a raw loop's for a small GPT-2 on the CPU (benchmarks/gpu_step_rate.py).

    >>> out = to_fp32({"logits": torch.ones(1, dtype=torch.bfloat16), "ids": [torch.ones(1)]})
    >>> out["logits"].dtype, out["ids"][0].dtype
    (torch.float32, torch.float32)
    """
    if isinstance(outputs, torch.Tensor):
        return outputs.float() if outputs.dtype in _HALF else outputs
    if isinstance(outputs, dict):
        changed = {}
        for key, value in outputs.items():
            converted = to_fp32(value)
            if converted is not value:
                changed[key] = converted
        if not changed:
            return outputs
        if type(outputs) is dict:
            return {**outputs, **changed}
        try:
            for key, value in changed.items():
                outputs[key] = value  # ModelOutput's __setitem__ sets the attribute too
        except (TypeError, AttributeError, NotImplementedError):  # a read-only mapping
            return type(outputs)({**outputs, **changed})  # as Accelerate rebuilds it
        return outputs
    if isinstance(outputs, list | tuple):
        items = [to_fp32(value) for value in outputs]
        if all(new is old for new, old in zip(items, outputs, strict=True)):
            return outputs
        if isinstance(outputs, tuple) and hasattr(outputs, "_fields"):  # a namedtuple
            return type(outputs)(*items)
        return type(outputs)(items)
    return outputs  # other leaves (None, numbers, caches) unchanged


def unwrap_model(
    model: torch.nn.Module, keep_autocast: bool = False, keep_compile: bool = False
) -> torch.nn.Module:
    """The user's module: DDP removed; torch.compile too and forward restored unless kept.

    Restoring the forward changes the module that is being trained (it is the same object),
    as in Accelerate; checkpoints and save_model keep the autocast forward.
    """
    while isinstance(model, DistributedDataParallel) or _is_xla_fsdp(model):
        model = model.module  # type: ignore[assignment]  # DDP's, or FSDPv2's wrapped module
    inner = model
    while True:
        compiled = getattr(inner, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(compiled, torch.nn.Module):
            break
        inner = compiled
    original = getattr(inner.forward, _ORIGINAL_FORWARD, None)
    if original is not None and not keep_autocast:
        inner.forward = original
    return model if keep_compile else inner


def _is_xla_fsdp(model: torch.nn.Module) -> bool:
    # By name: torch_xla is not importable everywhere, and importing it costs seconds.
    return type(model).__name__ == "SpmdFullyShardedDataParallel" and hasattr(model, "module")


def no_sync(model: torch.nn.Module) -> Any:
    """Suspend gradient sync: DDP's no_sync, FSDP's requires_gradient_sync; else nothing."""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if sharding.is_sharded(model):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: Any) -> Iterator[None]:
    # Gradients accumulate unsharded-and-unreduced; the next synced backward reduce-scatters.
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def save_model_file(model: torch.nn.Module, directory: Path) -> Path:
    """Write the unwrapped model's weights to ``directory/model.safetensors``.

    safetensors refuses tensors that share storage (tied embeddings); its ``save_model``
    drops the duplicates and records them, and ``safetensors.torch.load_model`` restores.
    """
    return save_state_file(model.state_dict(), directory)
