"""DeepSpeed's config for a run: read or built, checked before launch, "auto" filled in the worker.

``deepspeed_config(config)`` returns the dict ``deepspeed.initialize`` will get. With
``deepspeed_config_file`` set it is that file (JSON, or YAML when named ``.yaml``/``.yml``), in
the forms of Accelerate's DeepSpeed guide; without it, the equivalent dict is built from the
``deepspeed_*`` options. Values nbaccel takes from the run stay ``"auto"`` until the worker knows
them (the DataLoader's batch size, the process count): ``fill_auto_values`` replaces them there.

The rules are Accelerate's. When a file is given, its values rule: they are passed to DeepSpeed
as written, and keys it leaves out take DeepSpeed's defaults. The exception is what nbaccel
fills from the run (batch sizes, ``gradient_accumulation_steps``, ``gradient_clipping``,
``fp16``/``bf16`` ``enabled``): left out counts as ``"auto"``. A setting made explicitly for the
run (a non-default option) that contradicts the file is an error, never a silent choice.

Reading the file and the checks are in ``nbaccel.config.deepspeed_checks``. Parent side: stdlib
and PyYAML only; importing this never imports torch or deepspeed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from nbaccel.config.deepspeed_checks import (
    ACCUMULATION,
    AUTO,
    CLIPPING,
    KNOWN_KEYS,
    MICRO,
    TOTAL,
    Source,
    check_options_agree,
    check_run_agrees,
    check_structure,
    enabled,
    leaves,
    read_file,
)
from nbaccel.config.schema import Config
from nbaccel.config.sections import DeepSpeedOptions
from nbaccel.errors import ConfigError

__all__ = [
    "AUTO",
    "KNOWN_KEYS",
    "auto_paths",
    "deepspeed_config",
    "fill_auto_values",
    "mixed_precision_of",
]

# zero_optimization sizes Accelerate derives from the model's hidden size h.
_HIDDEN_SIZE_RULES: dict[str, Callable[[int], int]] = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def deepspeed_config(config: Config) -> dict[str, Any]:
    """The DeepSpeed config for this run (a new dict), validated; raises ConfigError.

    >>> ds = deepspeed_config(Config(strategy="deepspeed").replace(deepspeed_zero_stage=3))
    >>> ds["zero_optimization"], ds["train_micro_batch_size_per_gpu"]
    ({'stage': 3}, 'auto')
    >>> deepspeed_config(Config().replace(deepspeed_offload_param_device="cpu"))
    Traceback (most recent call last):
    ...
    nbaccel.errors.ConfigError: deepspeed_offload_param_device='cpu' needs ZeRO stage 3 ...
    """
    options = config.deepspeed
    source = Source(options.config_file or None, from_options=not options.config_file)
    ds = read_file(options.config_file) if options.config_file else _from_options(options)
    check_structure(ds, source)
    if source.file:
        check_options_agree(ds, options, source)
    run = (config.gradient_accumulation_steps, config.max_grad_norm, config.mixed_precision)
    check_run_agrees(ds, *run, source)
    return ds


def fill_auto_values(
    ds_config: Mapping[str, Any],
    *,
    micro_batch_size: int | None,
    world_size: int,
    accumulation_steps: int,
    max_grad_norm: float | None,
    mixed_precision: str,
    hidden_size: int | None = None,
) -> dict[str, Any]:
    """A copy of ``ds_config`` with every ``"auto"`` replaced by the run's value.

    ``micro_batch_size``: the prepared DataLoader's per-process batch size (None: no
    DataLoader). ``hidden_size``: the model's (``model.config.hidden_size``), if it has one.

    >>> ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    ...       "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}
    >>> filled = fill_auto_values(ds, micro_batch_size=8, world_size=2, accumulation_steps=4,
    ...                           max_grad_norm=1.0, mixed_precision="bf16")
    >>> filled["train_batch_size"], filled["gradient_accumulation_steps"], filled["bf16"]
    (64, 4, {'enabled': True})
    """
    ds = copy.deepcopy(dict(ds_config))
    source = Source(None)
    check_structure(ds, source)
    check_run_agrees(ds, accumulation_steps, max_grad_norm, mixed_precision, source)
    if ds.get(ACCUMULATION, AUTO) == AUTO:
        ds[ACCUMULATION] = accumulation_steps
    _fill_batch_sizes(ds, micro_batch_size, world_size)
    if ds.get(CLIPPING, AUTO) == AUTO:
        if max_grad_norm is None:
            ds.pop(CLIPPING, None)  # DeepSpeed's default, 0.0, clips nothing
        else:
            ds[CLIPPING] = float(max_grad_norm)
    for name in ("fp16", "bf16"):
        key = "bfloat16" if name == "bf16" and "bfloat16" in ds and "bf16" not in ds else name
        wanted = mixed_precision == name
        section = ds.get(key)
        if section is None:
            if wanted:  # as Accelerate: the run's precision is switched on if the file is silent
                ds[key] = {"enabled": True}
        elif section.get("enabled", AUTO) == AUTO:
            section["enabled"] = wanted
    if isinstance(ds.get("zero_optimization"), dict):
        _fill_zero_sizes(ds["zero_optimization"], hidden_size)
    return ds


def auto_paths(ds_config: Mapping[str, Any]) -> list[str]:
    """Dotted paths of the values that are still ``"auto"``.

    >>> auto_paths({"optimizer": {"params": {"lr": "auto"}}, "train_batch_size": 8})
    ['optimizer.params.lr']
    """
    return [path for path, value in leaves(ds_config, "") if value == AUTO]


def mixed_precision_of(ds_config: Mapping[str, Any], default: str = "no") -> str:
    """``"fp16"``, ``"bf16"`` or ``"no"``: what DeepSpeed will train in (``default`` while auto).

    A file can switch bf16 on for a run whose ``mixed_precision`` is ``"no"``: the worker's
    precision (autocast, no GradScaler) must follow the file then.

    >>> mixed_precision_of({"bf16": {"enabled": True}}), mixed_precision_of({}, "fp16")
    ('bf16', 'fp16')
    """
    states = {name: enabled(ds_config, name) for name in ("fp16", "bf16")}
    for name, state in states.items():
        if state is True:
            return name
    if all(state is False for state in states.values()):
        return "no"
    return default


# -- building ---------------------------------------------------------------------------------
def _from_options(options: DeepSpeedOptions) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": options.zero_stage}
    if options.offload_optimizer_device != "none":
        zero["offload_optimizer"] = {"device": options.offload_optimizer_device}
    if options.offload_param_device != "none":
        zero["offload_param"] = {"device": options.offload_param_device}
    # Everything the run decides stays "auto": the worker's Accelerator may change it
    # (Accelerator(gradient_accumulation_steps=4)), and batch sizes are known only there.
    return {
        TOTAL: AUTO,
        MICRO: AUTO,
        ACCUMULATION: AUTO,
        CLIPPING: AUTO,
        "zero_optimization": zero,
        "fp16": {"enabled": AUTO},
        "bf16": {"enabled": AUTO},
    }


# -- filling ----------------------------------------------------------------------------------
def _fill_batch_sizes(ds: dict[str, Any], micro_batch_size: int | None, world_size: int) -> None:
    steps = ds[ACCUMULATION]
    micro = ds.get(MICRO, AUTO)
    total = ds.get(TOTAL, AUTO)
    if micro == AUTO:
        micro = micro_batch_size
    if micro is None:
        if total == AUTO:
            raise ConfigError(
                f"DeepSpeed needs the per-GPU batch size, but {MICRO} and {TOTAL} are 'auto' "
                "(or not set) and no DataLoader was prepared to take it from. Pass the training "
                "DataLoader in the same prepare() call as the model "
                "(acc.prepare(model, optimizer, loader)), or set train_micro_batch_size_per_gpu "
                "to a number in the DeepSpeed config file.",
                field=MICRO,
            )
        micro, remainder = divmod(total, steps * world_size)
        if remainder or not micro:
            raise ConfigError(
                f"{TOTAL}={total} cannot be split into {steps} accumulation steps on "
                f"{world_size} processes. Make it a multiple of {steps * world_size}, or set it "
                'to "auto" (filled from the DataLoader\'s batch size).',
                field=TOTAL,
            )
    if total == AUTO:
        total = micro * steps * world_size
    if total != micro * steps * world_size:
        raise ConfigError(
            f"{TOTAL}={total}, but {MICRO}={micro} x {ACCUMULATION}={steps} x {world_size} "
            f"processes = {micro * steps * world_size}; DeepSpeed requires them to agree. Set "
            f'{TOTAL} to "auto" (nbaccel computes it), or change the numbers so they agree.',
            field=TOTAL,
        )
    ds[MICRO], ds[TOTAL] = micro, total


def _fill_zero_sizes(zero: dict[str, Any], hidden_size: int | None) -> None:
    for key, value in list(zero.items()):
        if isinstance(value, dict):
            _fill_zero_sizes(value, hidden_size)
        elif value == AUTO:
            rule = _HIDDEN_SIZE_RULES.get(key)
            if rule is not None and hidden_size:
                zero[key] = rule(hidden_size)
            else:
                # Nothing in the run gives a value (no hidden size, or a key Accelerate does not
                # derive either): dropping the key lets DeepSpeed's own default apply.
                del zero[key]
