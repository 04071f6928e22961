"""Config files: where they live, reading them (nbaccel's or Accelerate's format), writing them.

nbaccel's own YAML is the schema as nested mappings (sections ``fsdp:``, ``deepspeed:``) and
round-trips exactly. A file in Accelerate's format is recognised and mapped. Locations are
computed from an environment mapping passed in, never from ``os.environ`` directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nbaccel.config.accelerate_compat import from_accelerate_yaml, looks_like_accelerate
from nbaccel.config.schema import Config, check_names, flatten, options, sections
from nbaccel.errors import ConfigError

DEFAULT_NAME = "default_config.yaml"


def nbaccel_default_file(env: Mapping[str, str]) -> Path:
    """``$NBACCEL_HOME/default_config.yaml``, else under ``$XDG_CONFIG_HOME`` or ``~/.config``.

    >>> nbaccel_default_file({"HOME": "/home/ada"})
    PosixPath('/home/ada/.config/nbaccel/default_config.yaml')
    """
    if env.get("NBACCEL_HOME"):
        return Path(env["NBACCEL_HOME"]) / DEFAULT_NAME
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")) / ".config")
    return Path(base).expanduser() / "nbaccel" / DEFAULT_NAME


def accelerate_default_file(env: Mapping[str, str]) -> Path:
    """Where Accelerate keeps its default config (``$HF_HOME/accelerate/...``).

    >>> accelerate_default_file({"HOME": "/home/ada"})
    PosixPath('/home/ada/.cache/huggingface/accelerate/default_config.yaml')
    """
    if env.get("HF_HOME"):
        base = Path(env["HF_HOME"])
    else:
        cache = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", "~")) / ".cache")
        base = Path(cache) / "huggingface"
    return base.expanduser() / "accelerate" / DEFAULT_NAME


def default_file(env: Mapping[str, str]) -> Path | None:
    """nbaccel's default config if it exists, else the user's Accelerate default, else None.

    Only the given environment says where home is: without HOME (or an override) there is
    no default file, so ``resolve(env={})`` never reads the real home folder.
    """
    if not any(env.get(k) for k in ("HOME", "NBACCEL_HOME", "XDG_CONFIG_HOME", "HF_HOME")):
        return None
    for path in (nbaccel_default_file(env), accelerate_default_file(env)):
        if path.is_file():
            return path
    return None


def load_file(path: Path) -> dict[str, Any]:
    """Read a config file (nbaccel's or Accelerate's format) into ``{dotted path: value}``."""
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
    if looks_like_accelerate(data):
        return from_accelerate_yaml(data, str(path))
    return _flatten_nested(data, str(path))


def _flatten_nested(data: Mapping[str, Any], origin: str) -> dict[str, Any]:
    values: dict[str, Any] = {}
    known_sections = sections()
    for key, value in data.items():
        if key in known_sections:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{origin}: {key} must be a mapping of its options.", field=key)
            for leaf, leaf_value in value.items():
                values[f"{key}.{leaf}"] = leaf_value
        else:
            values[str(key)] = value
    check_names(values, f"file {origin}")
    return values


def dump(config: Config) -> str:
    """nbaccel's YAML for ``config``: every option, sections nested, help as comments."""
    import yaml

    lines = ["# nbaccel config: every field with its help; `nbaccel config show` explains sources."]
    current_section = ""
    for opt in options():
        section = opt.path.split(".")[0] if "." in opt.path else ""
        if section != current_section and section:
            lines.append(f"{section}:")
        current_section = section
        indent = "  " if section else ""
        key = opt.path.split(".")[-1]
        value = opt.get(config)
        value = list(value) if isinstance(value, tuple) else value
        text = yaml.safe_dump({key: value}, default_flow_style=True, width=1000).strip()[1:-1]
        lines.append(f"{indent}# {opt.help}")
        lines.append(f"{indent}{text}")
    return "\n".join(lines) + "\n"


def save(config: Config, path: Path) -> Path:
    """Write ``config`` as nbaccel YAML, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(dump(config))
    partial.replace(path)
    return path


def as_nested(config: Config) -> dict[str, Any]:
    """The config as plain nested data (what config.json in a run_dir holds)."""
    nested: dict[str, Any] = {}
    for opt in options():
        value = opt.get(config)
        value = list(value) if isinstance(value, tuple) else value
        if "." in opt.path:
            section, leaf = opt.path.split(".")
            nested.setdefault(section, {})[leaf] = value
        else:
            nested[opt.path] = value
    return nested


__all__ = ["as_nested", "default_file", "dump", "flatten", "load_file", "save"]
