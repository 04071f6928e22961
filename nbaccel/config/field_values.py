"""One field of the config schema as every face sees it, and what a value of it may be.

``Option`` is the flat record ``schema.options()`` makes of each leaf field; ``check_value``
holds a value to the field's type, choices and bounds, ``parse_text`` turns the text of an
environment variable, CLI flag or widget into that type (``normal_value`` the other forms
code and YAML may use), ``shown_ranks`` reads ``log_ranks`` and ``gpu_id_list`` ``gpu_ids``.
Checks that involve several fields at once live with ``Config`` in ``schema.py``. Plain
data, stdlib only.
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
    int_list: bool = False  # a str field holding "0,2": a list or an int is taken too
    number_as_text: bool = False  # a str field that may be given as a number: 600 -> "600"

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


def gpu_id_list(gpu_ids: str) -> tuple[int, ...] | None:
    """Parse ``gpu_ids``: the GPU indices in the order given, or None for "all".

    >>> gpu_id_list("2, 0"), gpu_id_list("all")
    ((2, 0), None)
    >>> gpu_id_list("0,0")
    Traceback (most recent call last):
    ...
    nbaccel.errors.ConfigError: gpu_ids='0,0' names GPU 0 twice: each process gets a GPU of its own. Name each GPU once.
    """  # noqa: E501
    if gpu_ids.strip().lower() == "all":
        return None
    entries = [entry.strip() for entry in gpu_ids.split(",")]
    wrong = next((entry for entry in entries if not entry.isdigit()), None)
    if wrong is not None:
        what = "an empty entry" if not wrong else f"{wrong!r}, which is not a GPU index"
        raise ConfigError(
            f"gpu_ids={gpu_ids!r} holds {what}: give 'all', or GPU indices >= 0 separated by "
            "commas, such as '0,1' (Accelerate's --gpu_ids form).",
            field="gpu_ids",
        )
    ids = tuple(int(entry) for entry in entries)
    twice = next((i for i in ids if ids.count(i) > 1), None)
    if twice is not None:
        raise ConfigError(
            f"gpu_ids={gpu_ids!r} names GPU {twice} twice: each process gets a GPU of its "
            "own. Name each GPU once.",
            field="gpu_ids",
        )
    return ids


def normal_value(opt: Option, value: Any) -> Any:
    """``value`` in the form the field holds, where code and YAML may write it otherwise: a
    list for a tuple field; a list of ints or one int for an ``int_list`` text field.

    >>> from nbaccel.config.schema import option
    >>> normal_value(option("gpu_ids"), [0, 2]), normal_value(option("log_with"), ["csv"])
    ('0,2', ('csv',))
    """
    if isinstance(value, list) and opt.kind is tuple:
        return tuple(value)
    if opt.int_list:
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, (list, tuple)) and all(
            isinstance(item, int) and not isinstance(item, bool) for item in value
        ):
            return ",".join(map(str, value))
    if opt.number_as_text and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}"
    return value  # anything else meets the field's own check, which names it


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
    if opt.int_list:
        return "text such as '0,2' (or a list of ints)"
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
        int_list=bool(meta.get("int_list")),
        number_as_text=bool(meta.get("number_as_text")),
    )
