"""Merge configuration sources into one validated Config, recording where each value came from.

Precedence, lowest first: built-in defaults < config file < environment (``NBACCEL_<FIELD>``,
then Accelerate's ``ACCELERATE_*`` names as aliases) < explicit arguments. ``resolve`` is a
pure function of its inputs: the environment is passed in as a mapping, never read here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbaccel.config import Config, check_field_names, field_specs, parse_text
from nbaccel.errors import ConfigError

ENV_PREFIX = "NBACCEL_"


@dataclass(frozen=True)
class Resolved:
    """A Config and each value's source: 'default', 'file:<path>', 'env:<VAR>' or 'argument'."""

    config: Config
    sources: Mapping[str, str]


def env_names(name: str) -> tuple[str, ...]:
    """Environment variables that set a field, highest priority first.

    >>> env_names("mixed_precision")
    ('NBACCEL_MIXED_PRECISION', 'ACCELERATE_MIXED_PRECISION')
    """
    spec = next(spec for spec in field_specs() if spec.name == name)
    alias = spec.metadata.get("accelerate_env")
    return (ENV_PREFIX + name.upper(),) + ((alias,) if alias else ())


def resolve(
    explicit: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str],
    config: Config | Mapping[str, Any] | str | Path | None = None,
) -> Resolved:
    """Build the run's Config from every source, failing early with the source of a bad value.

    ``config`` is a Config (its values count as explicit), a mapping of fields, or the path of
    a YAML file with ``field: value`` lines.

    >>> r = resolve({"num_processes": 2}, env={"NBACCEL_MIXED_PRECISION": "bf16"})
    >>> r.config.num_processes, r.config.mixed_precision, r.sources["mixed_precision"]
    (2, 'bf16', 'env:NBACCEL_MIXED_PRECISION')
    """
    values: dict[str, Any] = {}
    sources = {spec.name: "default" for spec in field_specs()}

    def take(layer: Mapping[str, Any], source: str) -> None:
        check_field_names(layer, source)
        for name, value in layer.items():
            values[name] = value
            sources[name] = source

    if isinstance(config, (str, Path)):
        path = Path(config)
        take(load_yaml_fields(path), f"file:{path}")

    for spec in field_specs():
        for var in reversed(env_names(spec.name)):  # the NBACCEL_ name wins over the alias
            if var in env:
                values[spec.name] = _parse_or_explain(spec, env[var], f"env:{var}")
                sources[spec.name] = f"env:{var}"

    if isinstance(config, Config):  # given in code: as explicit as a keyword argument
        take(_set_fields(config), "argument")
    elif isinstance(config, Mapping):
        take(config, "argument")
    take(dict(explicit or {}), "argument")
    try:
        return Resolved(Config(**values), sources)
    except ConfigError as error:
        where = f" (from {sources[error.field]})" if error.field in sources else ""
        raise ConfigError(f"{error}{where}", field=error.field) from None


def load_yaml_fields(path: Path) -> dict[str, Any]:
    """Read a YAML config file into a field mapping, with errors that name the file."""
    import yaml  # deferred: only config files need it

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError(f"Cannot read config file {path}: {error.strerror}.") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"Config file {path} is not valid YAML: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path} must hold a mapping of field: value lines.")
    return data


def _parse_or_explain(spec: dataclasses.Field[Any], text: str, source: str) -> Any:
    try:
        return parse_text(spec, text)
    except ConfigError as error:
        raise ConfigError(f"{error} (from {source})") from None


def _set_fields(config: Config) -> dict[str, Any]:
    """The fields of a Config that differ from the defaults (so env can still fill the rest)."""
    default = Config()
    return {
        spec.name: getattr(config, spec.name)
        for spec in field_specs()
        if getattr(config, spec.name) != getattr(default, spec.name)
    }
