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

Reading the file and the checks are in ``nbaccel.config.deepspeed.checks``. Parent side: stdlib
and PyYAML only; importing this never imports torch or deepspeed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from nbaccel.config.deepspeed.checks import (
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

# How the config a DeepSpeedPlugin gave as a dict is named in messages.
_GIVEN_DICT = "the DeepSpeedPlugin's hf_ds_config dict"
_FILE_FIELD = "deepspeed_config_file"
_SAVE_16BIT = "stage3_gather_16bit_weights_on_model_save"

# zero_optimization sizes Accelerate derives from the model's hidden size h.
_HIDDEN_SIZE_RULES: dict[str, Callable[[int], int]] = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def deepspeed_config(config: Config, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config for this run (a new dict), validated; raises ConfigError.

    ``given``: a config dict that takes the place of ``deepspeed_config_file`` (a
    ``DeepSpeedPlugin(hf_ds_config={...})``); the same rules apply to it as to a file.

    >>> ds = deepspeed_config(Config(strategy="deepspeed").replace(deepspeed_zero_stage=3))
    >>> ds["zero_optimization"], ds["train_micro_batch_size_per_gpu"]
    ({'stage': 3}, 'auto')
    >>> deepspeed_config(Config().replace(deepspeed_offload_param_device="cpu"))
    Traceback (most recent call last):
    ...
    nbaccel.errors.ConfigError: deepspeed_offload_param_device='cpu' needs ZeRO stage 3 ...
    """
    options = config.deepspeed
    if given is not None and options.config_file:
        raise ConfigError(
            f"A DeepSpeed config dict was given (DeepSpeedPlugin(hf_ds_config={{...}})) and "
            f"deepspeed_config_file={options.config_file!r} too; nbaccel will not guess which "
            "one rules. Give one of them.",
            field=_FILE_FIELD,
        )
    if given is not None:
        source = Source(_GIVEN_DICT)
        ds = copy.deepcopy(dict(given))
    elif options.config_file:
        source = Source(options.config_file)
        ds = read_file(options.config_file)
    else:
        source = Source(None, from_options=True)
        ds = _from_options(options)
    check_structure(ds, source)
    if source.file:
        check_options_agree(ds, options, source)
        _apply_save_16bit(ds, options.zero3_save_16bit_model, source.file)
    _check_save_16bit(ds, options.zero3_save_16bit_model, source)
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
            # As Accelerate's set_mixed_precision: where the config is silent, the run's
            # precision is switched on (fp16 with auto_cast: the engine casts float inputs to
            # fp16, as nothing autocasts the engine's forward) and the other one off.
            fp16_on = wanted and name == "fp16"
            ds[key] = {"enabled": True, "auto_cast": True} if fp16_on else {"enabled": wanted}
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
    if options.zero3_save_16bit_model:
        zero[_SAVE_16BIT] = True
    # Everything the run decides stays "auto": the worker's Accelerator may change it
    # (Accelerator(gradient_accumulation_steps=4)), and batch sizes are known only there.
    return {
        TOTAL: AUTO,
        MICRO: AUTO,
        ACCUMULATION: AUTO,
        CLIPPING: AUTO,
        "zero_optimization": zero,
        # No fp16/bf16 sections, as Accelerate's plugin: fill_auto_values adds them.
    }


def _apply_save_16bit(ds: dict[str, Any], wanted: bool, where: str) -> None:
    """deepspeed_zero3_save_16bit_model on (not its default) beside a file or dict: the file
    may leave the key out or say the same, never the opposite (nbaccel will not pick one)."""
    if not wanted:
        return  # not chosen for this run: the file rules
    zero = ds.get("zero_optimization")
    if not isinstance(zero, dict):
        return  # check_structure has refused a malformed section; an absent one is stage 0
    theirs = zero.get(_SAVE_16BIT, AUTO)
    if theirs in (AUTO, True):
        zero[_SAVE_16BIT] = True
        return
    raise ConfigError(
        f"deepspeed_zero3_save_16bit_model=True contradicts {where}, which sets "
        f"zero_optimization.{_SAVE_16BIT} to {theirs!r}. When a DeepSpeed config is given its "
        "values rule (as in Accelerate), and nbaccel will not guess which one you meant. "
        "Remove the option from the run's settings, or change the value in the config.",
        field="deepspeed_zero3_save_16bit_model",
    )


def _check_save_16bit(ds: dict[str, Any], wanted: bool, source: Source) -> None:
    """The option on below ZeRO stage 3, where DeepSpeed ignores it: refused, not dropped.
    (A file's own key is left to DeepSpeed, which ignores it there harmlessly.)"""
    zero = ds.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if not wanted or stage == 3:
        return
    where = "" if source.from_options else f" in {source.where}"
    raise ConfigError(
        f"deepspeed_zero3_save_16bit_model=True only applies to ZeRO stage 3 (stages 0-2 keep "
        f"whole weights on every process), but the stage{where} is {stage}. Use stage 3, or "
        "turn it off.",
        field="deepspeed_zero3_save_16bit_model",
    )


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
