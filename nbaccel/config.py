"""The one configuration schema behind the launcher, YAML files, the CLI and the widgets.

Each field carries its help text, its valid choices and the environment variables that set
it (``NBACCEL_<NAME>``, plus Hugging Face Accelerate's name where one exists) in its
``dataclasses.field`` metadata, so every face of the config is generated from here.
Plain data, stdlib only.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from nbaccel.errors import ConfigError

MIXED_PRECISIONS = ("no", "fp16", "bf16")


def _option(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    accelerate_env: str | None = None,
    minimum: float | None = None,
) -> Any:
    return field(
        default=default,
        metadata={
            "help": help,
            "choices": choices,
            "accelerate_env": accelerate_env,
            "minimum": minimum,
        },
    )


@dataclass(frozen=True)
class Config:
    """A resolved, validated run configuration (immutable).

    >>> Config(num_processes=2, mixed_precision="bf16").mixed_precision
    'bf16'
    >>> Config(mixed_precision="fp32")
    Traceback (most recent call last):
    ...
    nbaccel.errors.ConfigError: mixed_precision='fp32' is not one of 'no', 'fp16', 'bf16'.
    """

    num_processes: int | None = _option(
        None,
        "Worker processes on this machine. Default: one per visible GPU, else 1.",
        minimum=1,
    )
    mixed_precision: str = _option(
        "no",
        "Autocast precision for the forward pass: no, fp16 (with a loss scaler) or bf16.",
        choices=MIXED_PRECISIONS,
        accelerate_env="ACCELERATE_MIXED_PRECISION",
    )
    gradient_accumulation_steps: int = _option(
        1,
        "Micro-batches whose gradients are summed before each optimizer step.",
        accelerate_env="ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
        minimum=1,
    )
    use_cpu: bool = _option(
        False,
        "Run on CPU processes (gloo) even when GPUs are present.",
        accelerate_env="ACCELERATE_USE_CPU",
    )
    init_process_group: bool = _option(
        True,
        "Initialise torch.distributed's default group before calling the function. "
        "Turn off if the function calls init_process_group() itself.",
    )
    collective_timeout: float = _option(
        1800.0,
        "Seconds a rank may wait in a collective before the run fails, naming the stuck ranks.",
        minimum=0.001,
    )
    log_ranks: str = _option(
        "0",
        "Ranks whose output is shown live: '0', 'all', or a comma list such as '0,1'.",
    )
    runs_dir: str = _option(
        "nbaccel_runs",
        "Folder under which each run gets its own run_dir (config, per-rank logs, events).",
    )

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            _check_value(spec, getattr(self, spec.name))
        shown_ranks(self.log_ranks)  # raises ConfigError when malformed

    def replace(self, **changes: Any) -> Config:
        """Return a copy with some fields changed (validated like the original)."""
        check_field_names(changes)
        return dataclasses.replace(self, **changes)


def field_specs() -> tuple[dataclasses.Field[Any], ...]:
    """The schema's fields, in declaration order (what every config face iterates over)."""
    return dataclasses.fields(Config)


def check_field_names(names: Any, origin: str = "argument") -> None:
    """Raise ConfigError for any name that is not a Config field, with a did-you-mean."""
    known = [spec.name for spec in field_specs()]
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"Unknown config field {name!r} ({origin}).{hint} Valid fields: {', '.join(known)}."
            )


def shown_ranks(log_ranks: str) -> frozenset[int] | None:
    """Parse ``log_ranks``: None means every rank.

    >>> sorted(shown_ranks("0,2"))
    [0, 2]
    >>> shown_ranks("all") is None
    True
    """
    if log_ranks.strip().lower() == "all":
        return None
    try:
        ranks = frozenset(int(part) for part in log_ranks.split(",") if part.strip())
    except ValueError:
        raise ConfigError(
            f"log_ranks={log_ranks!r} is not 'all' or a comma list of ranks such as '0,1'.",
            field="log_ranks",
        ) from None
    if not ranks or min(ranks) < 0:
        raise ConfigError(
            f"log_ranks={log_ranks!r} must name at least one rank >= 0.", field="log_ranks"
        )
    return ranks


def _check_value(spec: dataclasses.Field[Any], value: Any) -> None:
    name, meta = spec.name, spec.metadata
    expected = _python_type(spec)
    if value is None and "None" in str(spec.type):
        return
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not expected:
        raise ConfigError(
            f"{name} must be {expected.__name__}, got {value!r} ({type(value).__name__}).",
            field=name,
        )
    choices = meta.get("choices")
    if choices and value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{name}={value!r} is not one of {listed}.", field=name)
    minimum = meta.get("minimum")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} must be >= {minimum:g}, got {value!r}.", field=name)


def _python_type(spec: dataclasses.Field[Any]) -> type:
    """The scalar type of a field (``int | None`` -> int). Annotations are strings here."""
    text = str(spec.type).replace("None", "").replace("|", "").strip()
    return {"int": int, "float": float, "bool": bool, "str": str}[text]


def parse_text(spec: dataclasses.Field[Any], text: str) -> Any:
    """Convert a string from an environment variable or a CLI flag to the field's type.

    >>> parse_text(field_specs()[0], "4")
    4
    """
    kind = _python_type(spec)
    stripped = text.strip()
    if "None" in str(spec.type) and stripped.lower() in ("", "none", "auto"):
        return None
    if kind is bool:
        lowered = stripped.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{spec.name}={text!r} is not a boolean (true/false, 1/0, yes/no).")
    if kind in (int, float):
        try:
            return kind(stripped)
        except ValueError:
            raise ConfigError(f"{spec.name}={text!r} is not a valid {kind.__name__}.") from None
    return stripped
