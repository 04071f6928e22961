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

Parent side: stdlib and PyYAML only; importing this never imports torch or deepspeed.
"""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from nbaccel.config import Config
from nbaccel.config_sections import DeepSpeedOptions
from nbaccel.errors import ConfigError

__all__ = [
    "AUTO",
    "KNOWN_KEYS",
    "auto_paths",
    "deepspeed_config",
    "fill_auto_values",
    "mixed_precision_of",
]

AUTO = "auto"
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
MICRO, TOTAL, ACCUMULATION, CLIPPING = (
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "gradient_accumulation_steps",
    "gradient_clipping",
)

# DeepSpeed's top-level keys (deepspeed/runtime/config.py and its sections). Unknown keys are
# kept, since DeepSpeed grows new ones, but one close to these is most likely a typo that
# DeepSpeed would silently ignore (it ignores top-level keys it does not read).
_KNOWN = """train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps
    gradient_clipping steps_per_print dump_state disable_allgather communication_data_type
    seq_parallel_comm_data_type prescale_gradients gradient_predivide_factor
    gradient_allreduce_op sparse_gradients zero_optimization zero_allow_untested_optimizer
    zero_force_ds_cpu_optimizer optimizer scheduler fp16 bf16 bfloat16 amp torch_autocast
    activation_checkpointing comms_logger tensorboard wandb csv_monitor comet flops_profiler
    wall_clock_breakdown memory_breakdown autotuning compression_training quantize_training
    eigenvalue progressive_layer_drop curriculum_learning data_efficiency sparse_attention
    pipeline hybrid_engine checkpoint data_types aio dataloader_drop_last elasticity nebula
    datastates_ckpt weight_quantization compile timers tensor_parallel expert_parallel
    sequence_parallel_size use_data_before_expert_parallelism graph_harvesting vocabulary_size
    msamp log_level managed_gradient_accumulation"""
KNOWN_KEYS = frozenset(_KNOWN.split())

_FILE_FIELD = "deepspeed_config_file"
_DEFAULT_OPTIONS = DeepSpeedOptions()
# How a setting is called when it came from the deepspeed_* options rather than a file.
_OPTION_NAMES = {
    "zero_optimization.stage": "deepspeed_zero_stage",
    "zero_optimization.offload_optimizer.device": "deepspeed_offload_optimizer_device",
    "zero_optimization.offload_param.device": "deepspeed_offload_param_device",
}
# Values with a fixed form, in an order where a parent is checked before its children
# (missing values pass): DeepSpeed would refuse these too, but in every worker.
_FORMS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("zero_optimization", lambda v: isinstance(v, dict), 'a mapping: {"stage": 2, ...}'),
    (
        "zero_optimization.stage",
        lambda v: type(v) is int and 0 <= v <= 3,
        "a ZeRO stage: 0 (off), 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters)",
    ),
    *(
        (f"zero_optimization.offload_{part}{leaf}", valid, form)
        for part in ("optimizer", "param")
        for leaf, valid, form in (
            ("", lambda v: isinstance(v, dict), 'a mapping such as {"device": "cpu"}'),
            (".device", lambda v: v in OFFLOAD_DEVICES, "one of 'none', 'cpu', 'nvme'"),
        )
    ),
    *(
        (f"{name}{leaf}", valid, 'like {"enabled": true}, false or "auto"')
        for name in ("fp16", "bf16", "bfloat16")
        for leaf, valid in (
            ("", lambda v: isinstance(v, dict)),
            (".enabled", lambda v: v in (True, False, AUTO)),
        )
    ),
    *(
        (key, lambda v: v == AUTO or (type(v) is int and v >= 1), 'a whole number >= 1 or "auto"')
        for key in (MICRO, TOTAL, ACCUMULATION)
    ),
    (
        CLIPPING,
        lambda v: v == AUTO or (type(v) in (int, float) and v >= 0),
        'a number >= 0 (0: no clipping) or "auto"',
    ),
)
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
    source = _Source(options.config_file or None, from_options=not options.config_file)
    ds = _read_file(options.config_file) if options.config_file else _from_options(options)
    _check_structure(ds, source)
    if source.file:
        _check_options_agree(ds, options, source)
    run = (config.gradient_accumulation_steps, config.max_grad_norm, config.mixed_precision)
    _check_run_agrees(ds, *run, source)
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
    source = _Source(None)
    _check_structure(ds, source)
    _check_run_agrees(ds, accumulation_steps, max_grad_norm, mixed_precision, source)
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
    return [path for path, value in _leaves(ds_config, "") if value == AUTO]


def mixed_precision_of(ds_config: Mapping[str, Any], default: str = "no") -> str:
    """``"fp16"``, ``"bf16"`` or ``"no"``: what DeepSpeed will train in (``default`` while auto).

    A file can switch bf16 on for a run whose ``mixed_precision`` is ``"no"``: the worker's
    precision (autocast, no GradScaler) must follow the file then.

    >>> mixed_precision_of({"bf16": {"enabled": True}}), mixed_precision_of({}, "fp16")
    ('bf16', 'fp16')
    """
    states = {name: _enabled(ds_config, name) for name in ("fp16", "bf16")}
    for name, state in states.items():
        if state is True:
            return name
    if all(state is False for state in states.values()):
        return "no"
    return default


# -- reading and building ---------------------------------------------------------------------
def _read_file(text: str) -> dict[str, Any]:
    path = Path(text).expanduser()
    where = f"{_FILE_FIELD}={text!r}"
    if not path.is_file():
        raise ConfigError(
            f"{where}: no such file (looked for {path.resolve()}). nbaccel reads the DeepSpeed "
            "config before any process starts. Fix the path, or leave deepspeed_config_file "
            "empty to build the config from deepspeed_zero_stage and the deepspeed_offload_* "
            "options.",
            field=_FILE_FIELD,
        )
    try:
        raw = path.read_text(encoding="utf-8")
        if path.suffix.lower() in (".yaml", ".yml"):
            data = yaml.safe_load(raw)
        else:
            data = json.loads(raw, object_pairs_hook=lambda pairs: _no_duplicates(pairs, where))
    except (ValueError, yaml.YAMLError, OSError) as exc:  # JSONDecodeError is a ValueError
        if isinstance(exc, ConfigError):
            raise
        detail = str(exc)
        if isinstance(exc, json.JSONDecodeError):
            detail = f"not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        raise ConfigError(
            f"{where} could not be read: {detail}. DeepSpeed config files are JSON (or YAML "
            "when the name ends in .yaml or .yml); fix the file at that place.",
            field=_FILE_FIELD,
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where} holds a {type(data).__name__}, not a mapping of settings. A DeepSpeed "
            'config is one object, such as {"zero_optimization": {"stage": 2}}.',
            field=_FILE_FIELD,
        )
    return data


def _no_duplicates(pairs: list[tuple[str, Any]], where: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:  # json keeps the last silently; DeepSpeed refuses the file
            raise ConfigError(
                f"{where} sets {key!r} twice in one object; DeepSpeed refuses such a file. "
                "Keep one of the two.",
                field=_FILE_FIELD,
            )
        found[key] = value
    return found


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


# -- checks -----------------------------------------------------------------------------------
class _Source:
    """Where the values came from, to name them in messages: a file, the options, or neither."""

    def __init__(self, file: str | None, from_options: bool = False) -> None:
        self.file, self.from_options = file, from_options
        self.where = file or "the DeepSpeed config"

    def error(self, path: str, value: Any, why: str) -> ConfigError:
        option = _OPTION_NAMES.get(path) if self.from_options else None
        said = f"{option}={value!r}" if option else f"{path}={value!r} in {self.where}"
        return ConfigError(f"{said} {why}", field=option or _FILE_FIELD)


def _check_structure(ds: dict[str, Any], source: _Source) -> None:
    for key in ds:
        close = difflib.get_close_matches(str(key), KNOWN_KEYS, n=1, cutoff=0.8)
        if str(key) not in KNOWN_KEYS and close:
            raise ConfigError(
                f"{key!r} in {source.where} is no DeepSpeed setting: did you mean {close[0]!r}? "
                "DeepSpeed ignores top-level keys it does not know, so this one would silently "
                "do nothing. Rename it.",
                field=_FILE_FIELD,
            )
    for path, valid, form in _FORMS:
        value = _get(ds, path)
        if value is not None and not valid(value):
            raise source.error(path, value, f"is invalid: it must be {form}. Fix that value.")
    stage = _get(ds, "zero_optimization.stage") or 0
    param, optimizer = (_offload_device(ds, part, source) for part in ("param", "optimizer"))
    if param != "none" and stage < 3:
        raise source.error(
            "zero_optimization.offload_param.device",
            param,
            f"needs ZeRO stage 3 (only stage 3 shards parameters, so only it can offload them), "
            f"but the stage is {stage}. Use stage 3, or offload the optimizer only.",
        )
    if optimizer != "none" and stage == 0:
        raise source.error(
            "zero_optimization.offload_optimizer.device",
            optimizer,
            "needs ZeRO stage 1, 2 or 3 (offload moves the ZeRO optimizer's partitions), but the "
            "stage is 0. Use stage 2 (the usual choice with offload) or turn offload off.",
        )
    if _enabled(ds, "fp16") is True and _enabled(ds, "bf16") is True:
        raise source.error(
            "fp16.enabled",
            True,
            "while bf16 is enabled too: DeepSpeed trains in one of them. Enable one, or set "
            'both to "auto" to follow mixed_precision.',
        )
    for path in auto_paths(ds):
        if not _fillable(path):
            raise source.error(
                path,
                AUTO,
                "has nothing to be filled from: nbaccel fills 'auto' in the batch sizes, "
                "gradient_accumulation_steps, gradient_clipping, fp16/bf16 'enabled' and "
                "zero_optimization (Accelerate fills optimizer and scheduler values from its "
                "DummyOptim/DummyScheduler, which nbaccel does not have). Put a number there, "
                "or remove the optimizer/scheduler section and pass a torch optimizer and LR "
                "scheduler to prepare().",
            )


def _offload_device(ds: dict[str, Any], part: str, source: _Source) -> str:
    path = f"zero_optimization.offload_{part}"
    device = str(_get(ds, f"{path}.device") or "none")
    if device == "nvme" and not _get(ds, f"{path}.nvme_path"):
        raise source.error(
            f"{path}.device",
            device,
            "needs a folder on an NVMe drive to swap to (nvme_path), and none is given; only a "
            f'DeepSpeed config file can give it: {path} = {{"device": "nvme", "nvme_path": '
            '"/local_nvme"}. Or offload to "cpu".',
        )
    return device


def _check_options_agree(ds: dict[str, Any], options: DeepSpeedOptions, source: _Source) -> None:
    for path, option in _OPTION_NAMES.items():
        name = option.removeprefix("deepspeed_")
        mine, value = getattr(options, name), _get(ds, path)
        if mine == getattr(_DEFAULT_OPTIONS, name):
            continue  # not chosen for this run: the file rules
        effective = value if value is not None else (0 if name == "zero_stage" else "none")
        if mine != effective:
            said = (
                repr(value) if value is not None else f"nothing (DeepSpeed's default {effective!r})"
            )
            raise ConfigError(
                f"{option}={mine!r} contradicts {source.file}, which sets {path} to {said}. "
                "When a DeepSpeed config file is given its values rule (as in Accelerate), and "
                f"nbaccel will not guess which one you meant. Remove {option} from the run's "
                f"settings, or change {path} in the file.",
                field=option,
            )


def _check_run_agrees(
    ds: dict[str, Any], steps: int, max_norm: float | None, precision: str, source: _Source
) -> None:
    """A value the run chose (not its default) that the DeepSpeed config contradicts."""
    theirs = ds.get(ACCUMULATION, AUTO)
    if theirs != AUTO and steps != 1 and theirs != steps:
        raise ConfigError(
            f"gradient_accumulation_steps={steps} for this run, but {source.where} sets it to "
            f"{theirs}. DeepSpeed divides the loss and steps the optimizer by its own count, so "
            f'the two would disagree on when a step happens. Set it to "auto" in the DeepSpeed '
            "config (filled from the run), or make both the same.",
            field=ACCUMULATION,
        )
    clip = ds.get(CLIPPING, AUTO)
    if clip != AUTO and max_norm is not None and float(clip) != max_norm:
        raise ConfigError(
            f"max_grad_norm={max_norm} for this run, but {source.where} sets gradient_clipping "
            f'to {clip}; under DeepSpeed the engine clips, with its value. Set it to "auto" in '
            "the DeepSpeed config (filled from max_grad_norm), or make both the same.",
            field="max_grad_norm",
        )
    if precision == "no":
        return  # the run chose nothing: the DeepSpeed config's precision rules
    other = "bf16" if precision == "fp16" else "fp16"
    for name, bad, state in ((other, True, "enabled"), (precision, False, "disabled")):
        if _enabled(ds, name) is bad:
            raise ConfigError(
                f"mixed_precision={precision!r} for this run, but {source.where} has {name} "
                f'{state}; DeepSpeed trains in one precision. Set "{name}": {{"enabled": '
                '"auto"} in the DeepSpeed config (filled from mixed_precision), or make both '
                "the same.",
                field="mixed_precision",
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


# -- small helpers ----------------------------------------------------------------------------
def _enabled(ds: Mapping[str, Any], name: str) -> bool | str | None:
    """True/False/"auto" as written; None when the section is absent (bf16 has an old alias)."""
    keys = ("bf16", "bfloat16") if name == "bf16" else (name,)
    for key in keys:
        section = ds.get(key)
        if isinstance(section, Mapping):
            value = section.get("enabled", AUTO)
            return value if isinstance(value, (bool, str)) else None
    return None


def _get(ds: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted path, None where any part is missing."""
    value: Any = ds
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _fillable(path: str) -> bool:
    return path in (MICRO, TOTAL, ACCUMULATION, CLIPPING) or path.startswith(
        ("zero_optimization.", "fp16.enabled", "bf16.enabled", "bfloat16.enabled")
    )


def _leaves(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _leaves(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, f"{prefix}[{index}]")
    else:
        yield prefix, value
