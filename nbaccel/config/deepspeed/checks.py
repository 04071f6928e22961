"""Reading a DeepSpeed config file, and checking a config before any process starts.

``read_file`` loads ``deepspeed_config_file`` (JSON, or YAML when named ``.yaml``/``.yml``).
``check_structure`` refuses what DeepSpeed would refuse later, in every worker (values of the
wrong form, offload without the ZeRO stage it needs), and what it would silently ignore (a
misspelt top-level key, an ``"auto"`` nothing fills); ``check_options_agree`` and
``check_run_agrees`` refuse a config that contradicts a setting made explicitly for the run.
A ``Source`` names a bad value as the user wrote it: a path in the file, or the option.

The key names and ``AUTO`` live here, and ``nbaccel.config.deepspeed.settings`` (the public
side, which
builds and fills the config) imports them. Parent side: stdlib and PyYAML only; importing this
never imports torch or deepspeed.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from nbaccel.config.sections import DeepSpeedOptions
from nbaccel.errors import ConfigError

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


# -- reading ----------------------------------------------------------------------------------
def read_file(text: str) -> dict[str, Any]:
    """The mapping in the file at ``text`` (deepspeed_config_file); raises ConfigError."""
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


# -- checks -----------------------------------------------------------------------------------
class Source:
    """Where the values came from, to name them in messages: a file, the options, or neither.

    >>> print(Source(None, from_options=True).error("zero_optimization.stage", 5, "is bad."))
    deepspeed_zero_stage=5 is bad.
    >>> print(Source("ds.json").error("zero_optimization.stage", 5, "is bad."))
    zero_optimization.stage=5 in ds.json is bad.
    """

    def __init__(self, file: str | None, from_options: bool = False) -> None:
        self.file, self.from_options = file, from_options
        self.where = file or "the DeepSpeed config"

    def error(self, path: str, value: Any, why: str) -> ConfigError:
        option = _OPTION_NAMES.get(path) if self.from_options else None
        said = f"{option}={value!r}" if option else f"{path}={value!r} in {self.where}"
        return ConfigError(f"{said} {why}", field=option or _FILE_FIELD)


def check_structure(ds: dict[str, Any], source: Source) -> None:
    """Keys, forms, and combinations DeepSpeed would refuse or ignore; raises ConfigError."""
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
    if enabled(ds, "fp16") is True and enabled(ds, "bf16") is True:
        raise source.error(
            "fp16.enabled",
            True,
            "while bf16 is enabled too: DeepSpeed trains in one of them. Enable one, or set "
            'both to "auto" to follow mixed_precision.',
        )
    for path, value in leaves(ds, ""):
        if value == AUTO and not _fillable(path):
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


def _offload_device(ds: dict[str, Any], part: str, source: Source) -> str:
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


def check_options_agree(ds: dict[str, Any], options: DeepSpeedOptions, source: Source) -> None:
    """A ``deepspeed_*`` option chosen for the run (not its default) that the file contradicts."""
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


def check_run_agrees(
    ds: dict[str, Any], steps: int, max_norm: float | None, precision: str, source: Source
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
        if enabled(ds, name) is bad:
            raise ConfigError(
                f"mixed_precision={precision!r} for this run, but {source.where} has {name} "
                f'{state}; DeepSpeed trains in one precision. Set "{name}": {{"enabled": '
                '"auto"} in the DeepSpeed config (filled from mixed_precision), or make both '
                "the same.",
                field="mixed_precision",
            )


# -- small helpers ----------------------------------------------------------------------------
def enabled(ds: Mapping[str, Any], name: str) -> bool | str | None:
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


def leaves(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every non-container value under ``value``, in order."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from leaves(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from leaves(item, f"{prefix}[{index}]")
    else:
        yield prefix, value
