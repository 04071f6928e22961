"""Merge configuration sources into one validated Config, recording where each value came from.

Precedence, lowest first: built-in defaults < the default config file (nbaccel's, else the
user's Accelerate default) < a config file named by argument or ``NBACCEL_CONFIG`` <
environment (``NBACCEL_<FIELD>``, then Accelerate's ``ACCELERATE_*`` names as aliases) <
values given in code (a Config or mapping, then keyword arguments). ``resolve`` is a pure
function of its inputs: the environment is passed in as a mapping, never read here, and it
is the only reader of these variables.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from nbaccel.config.files import default_file, load_file
from nbaccel.config.schema import (
    Config,
    Option,
    check_names,
    flatten,
    from_flat,
    option,
    options,
    parse_text,
    sections,
)
from nbaccel.env_names import CONFIG_FILE_VAR, NON_OPTION_VARS
from nbaccel.errors import ConfigError

ENV_PREFIX = "NBACCEL_"


@dataclass(frozen=True)
class Resolved:
    """A Config and each option's source, by flat name.

    Sources: 'default', 'file:<path>', 'env:<VAR>' or 'argument'.
    """

    config: Config
    sources: Mapping[str, str]


def env_names(opt: Option | str) -> tuple[str, ...]:
    """Environment variables that set an option, highest priority first.

    >>> env_names("mixed_precision")
    ('NBACCEL_MIXED_PRECISION', 'ACCELERATE_MIXED_PRECISION')
    >>> env_names("fsdp.cpu_offload")
    ('NBACCEL_FSDP_CPU_OFFLOAD',)
    """
    opt = option(opt) if isinstance(opt, str) else opt
    alias = (opt.accelerate_env,) if opt.accelerate_env else ()
    return (ENV_PREFIX + opt.name.upper(), *alias)


class ShowsConfig(Protocol):
    """What ``resolve`` reads from a ``ConfigPanel``: the Config it shows."""

    @property
    def config(self) -> Config: ...


ConfigSource = Config | Mapping[str, Any] | str | Path | ShowsConfig | None


def resolve(
    explicit: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str],
    config: ConfigSource = None,
    use_default_file: bool = True,
    defaults: Mapping[str, Any] | None = None,
) -> Resolved:
    """Build the run's Config from every source, failing early with the source of a bad value.

    ``config`` is a Config or mapping (given in code), the path of a YAML file, or a
    ``ConfigPanel`` (all its values count, so the run is what the panel shows).
    ``defaults`` replaces built-in defaults for one caller (``nbaccel launch`` runs scripts
    that initialise their own process group): files, env and arguments still win.

    >>> r = resolve({"num_processes": 2}, env={"NBACCEL_MIXED_PRECISION": "bf16"})
    >>> r.config.num_processes, r.config.mixed_precision, r.sources["mixed_precision"]
    (2, 'bf16', 'env:NBACCEL_MIXED_PRECISION')
    """
    _check_source(config)
    values: dict[str, Any] = {}
    sources = {opt.name: "default" for opt in options()}

    def take(layer: Mapping[str, Any], source: str) -> None:
        layer = _expand_sections(layer)
        check_names(layer, source)
        for key, value in layer.items():
            name = option(key).name
            values[name] = value
            sources[name] = source

    take(dict(defaults or {}), "default")
    if use_default_file and (path := default_file(env)) is not None:
        take(load_file(path), f"file:{path}")
    named = config if isinstance(config, (str, Path)) else env.get(CONFIG_FILE_VAR)
    if named:
        take(load_file(Path(named)), f"file:{named}")
    env_values, env_sources = _env_layer(env)
    values.update(env_values)
    sources.update(env_sources)
    shown = getattr(config, "config", None)  # a ConfigPanel (duck-typed: ui is above us)
    if isinstance(shown, Config):  # every value the panel shows, defaults included
        take(flatten(shown), "config panel")
    elif isinstance(config, Config):  # given in code: as explicit as a keyword argument
        take(_set_fields(config), "argument")
    elif isinstance(config, Mapping):
        take(config, "argument")
    take(dict(explicit or {}), "argument")
    try:
        return Resolved(from_flat(values), sources)
    except ConfigError as error:
        name = error.field if error.field in sources else None
        where = f" (from {sources[name]})" if name else ""
        raise ConfigError(f"{error}{where}", field=error.field) from None


def _check_source(config: object) -> None:
    if config is None or isinstance(config, (Config, Mapping, str, os.PathLike)):
        return
    if isinstance(getattr(config, "config", None), Config):
        return  # a ConfigPanel
    raise ConfigError(
        f"config= got {type(config).__name__} {config!r:.60}, which is none of what it takes: "
        "an nbaccel.Config, a mapping of field names to values, the path of a YAML file, or "
        "an nbaccel.ConfigPanel. Pass one of those (or leave config out).",
        field="config",
    )


def _env_layer(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    known = {var: opt for opt in options() for var in env_names(opt)}
    for var in env:
        if var.startswith(ENV_PREFIX) and var not in known and var not in NON_OPTION_VARS:
            close = difflib.get_close_matches(var, list(known), n=1)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise ConfigError(f"Unknown environment variable {var}.{hint}", field=var)
    layer: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for opt in options():
        for var in reversed(env_names(opt)):  # the NBACCEL_ name wins over the alias
            if var in env:
                try:
                    layer[opt.name] = parse_text(opt, env[var])
                except ConfigError as error:
                    raise ConfigError(f"{error} (from env:{var})", field=opt.name) from None
                sources[opt.name] = f"env:{var}"
    return layer, sources


def _expand_sections(layer: Mapping[str, Any]) -> dict[str, Any]:
    """Accept ``fsdp={"cpu_offload": True}`` or ``fsdp=FSDPOptions(...)`` beside flat names."""
    expanded: dict[str, Any] = {}
    for key, value in layer.items():
        if key in sections():
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                value = dataclasses.asdict(value)
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"{key} must be a mapping of its options, got {value!r}.", field=key
                )
            expanded.update({f"{key}.{leaf}": v for leaf, v in value.items()})
        else:
            expanded[key] = value
    return expanded


def _set_fields(config: Config) -> dict[str, Any]:
    """The options of a Config that differ from the defaults (so other layers fill the rest)."""
    default = flatten(Config())
    return {name: value for name, value in flatten(config).items() if value != default[name]}
