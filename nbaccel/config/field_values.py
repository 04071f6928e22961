"""One field of the config schema as every face sees it, and what a value of it may be.

``Option`` is the flat record ``schema.options()`` makes of each leaf field; ``check_value``
holds a value to the field's type, choices and bounds, ``parse_text`` turns the text of an
environment variable, CLI flag or widget into that type, and ``shown_ranks`` reads
``log_ranks``. Checks that involve several fields at once live with ``Config`` in
``schema.py``. Plain data, stdlib only.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any

from nbaccel.errors import ConfigError


@dataclass(frozen=True)
class Option:
    """One leaf field of the schema, as every config face sees it."""

    path: str  # "fsdp.cpu_offload": YAML nesting and `config show`
    name: str  # "fsdp_cpu_offload": env (NBACCEL_FSDP_CPU_OFFLOAD), CLI flag, keyword
    kind: type  # int, float, bool, str, or tuple (a comma list of str)
    optional: bool  # None is allowed
    default: Any
    help: str
    choices: tuple[Any, ...] | None
    minimum: float | None
    maximum: float | None
    accelerate_env: str | None

    def get(self, config: object) -> Any:
        """This field's value in a ``Config`` (nested sections followed by the dotted path)."""
        value: Any = config
        for part in self.path.split("."):
            value = getattr(value, part)
        return value


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


def parse_text(opt: Option, text: str) -> Any:
    """Convert text from an environment variable, a CLI flag or the wizard to the field's type.

    >>> from nbaccel.config.schema import option
    >>> parse_text(option("num_processes"), "4"), parse_text(option("log_with"), "csv, jsonl")
    (4, ('csv', 'jsonl'))
    """
    stripped = text.strip()
    if opt.optional and stripped.lower() in ("", "none", "auto", "null"):
        return None
    if opt.kind is bool:
        lowered = stripped.lower()
        if lowered in ("1", "true", "yes", "on", "y"):
            return True
        if lowered in ("0", "false", "no", "off", "n"):
            return False
        raise ConfigError(
            f"{opt.name}={text!r} is not a boolean (true/false, yes/no, 1/0).", field=opt.name
        )
    if opt.kind is tuple:
        return tuple(part.strip() for part in stripped.split(",") if part.strip())
    if opt.kind in (int, float):
        try:
            return opt.kind(stripped)
        except ValueError:
            raise ConfigError(
                f"{opt.name}={text!r} is not a valid {opt.kind.__name__}.", field=opt.name
            ) from None
    return stripped


def check_value(opt: Option, value: Any) -> None:
    if value is None and opt.optional:
        return
    if opt.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not _exactly(value, opt.kind):  # exact: a bool is no int here, a str no list
        raise ConfigError(
            f"{opt.name} must be {_kind_name(opt)}, got {value!r} ({type(value).__name__}).",
            field=opt.name,
        )
    items = value if opt.kind is tuple else (value,)
    for item in items:
        if opt.choices and item not in opt.choices:
            listed = ", ".join(repr(c) for c in opt.choices)
            shown = f"{opt.name} entry {item!r}" if opt.kind is tuple else f"{opt.name}={item!r}"
            raise ConfigError(f"{shown} is not one of {listed}.", field=opt.name)
    if opt.kind is float and not math.isfinite(value):
        # NaN slips through every comparison below, and an infinite timeout never fires.
        example = f" such as {opt.default:g}" if isinstance(opt.default, float) else ""
        raise ConfigError(
            f"{opt.name} must be a finite number, got {value!r}: NaN and infinity are "
            f"refused because no bound or timeout could ever trigger. Give a number{example}.",
            field=opt.name,
        )
    if opt.minimum is not None and value < opt.minimum:
        raise ConfigError(f"{opt.name} must be >= {opt.minimum:g}, got {value!r}.", field=opt.name)
    if opt.maximum is not None and value > opt.maximum:
        raise ConfigError(f"{opt.name} must be <= {opt.maximum:g}, got {value!r}.", field=opt.name)


def _exactly(value: Any, kind: type) -> bool:
    return type(value) is kind


def _kind_name(opt: Option) -> str:
    name = "comma list" if opt.kind is tuple else opt.kind.__name__
    return f"{name} or None" if opt.optional else name


def make_option(spec: dataclasses.Field[Any], hint: Any, path: str) -> Option:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    origin = typing.get_origin(hint)
    kind = tuple if (origin is tuple or hint is tuple) else (args[0] if optional else hint)
    meta = spec.metadata
    return Option(
        path=path,
        name=path.replace(".", "_"),
        kind=kind,
        optional=optional,
        default=spec.default,
        help=meta["help"],
        choices=meta.get("choices"),
        minimum=meta.get("minimum"),
        maximum=meta.get("maximum"),
        accelerate_env=meta.get("accelerate_env"),
    )
