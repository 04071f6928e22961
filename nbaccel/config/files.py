"""Config files: where they live, reading them (nbaccel's or Accelerate's format), writing them.

nbaccel's own YAML is the schema as nested mappings (sections ``fsdp:``, ``deepspeed:``) and
round-trips exactly. A file in Accelerate's format is recognised and mapped. Locations are
computed from an environment mapping passed in, never from ``os.environ`` directly.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nbaccel.config.accelerate.compat import from_accelerate_yaml, looks_like_accelerate
from nbaccel.config.schema import Config, check_names, flatten, options, sections
from nbaccel.env_names import HOME_VAR
from nbaccel.errors import ConfigError

DEFAULT_NAME = "default_config.yaml"


def nbaccel_default_file(env: Mapping[str, str]) -> Path:
    """``$NBACCEL_HOME/default_config.yaml``, else under ``$XDG_CONFIG_HOME`` or ``~/.config``.

    >>> nbaccel_default_file({"HOME": "/home/ada"})
    PosixPath('/home/ada/.config/nbaccel/default_config.yaml')
    """
    if env.get(HOME_VAR):
        return Path(env[HOME_VAR]) / DEFAULT_NAME
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
    if not any(env.get(k) for k in ("HOME", HOME_VAR, "XDG_CONFIG_HOME", "HF_HOME")):
        return None
    for path in (nbaccel_default_file(env), accelerate_default_file(env)):
        if path.is_file():
            return path
    return None


def load_file(path: Path) -> dict[str, Any]:
    """Read a config file (nbaccel's or Accelerate's format) into ``{dotted path: value}``."""
    import yaml  # deferred: only config files need it

    try:
        text = path.read_text()
        data = yaml.safe_load(text)
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
    values = _flatten_nested(data, str(path))
    _check_process_meaning(values, text, path)
    return values


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


# The help comment `nbaccel config` wrote above num_processes while it counted one machine's
# processes. nbaccel's YAML has no format version, and this line is the only mark that tells
# such a file from a new one; a hand-written file without it is only checked for a count that
# cannot be a total (the schema's check).
_PER_MACHINE_COMMENT = re.compile(r"^\s*#\s*Worker processes per machine\.", re.MULTILINE)


def _check_process_meaning(values: Mapping[str, Any], text: str, path: Path) -> None:
    """Refuse an nbaccel file that states a per-machine num_processes (the meaning before it
    became the total over all machines), rather than silently starting fewer processes."""
    total, machines = values.get("num_processes"), values.get("num_machines")
    if type(total) is not int or type(machines) is not int or machines <= 1 or total < 1:
        return  # one machine: both meanings agree; bad types are the schema's to report
    per_machine = (
        f"write num_processes: {total * machines} (or give `nbaccel launch` "
        f"--nproc_per_node {total})"
    )
    if _PER_MACHINE_COMMENT.search(text):
        raise ConfigError(
            f"Config file {path}: num_processes: {total} with num_machines: {machines} was "
            "written by `nbaccel config` when num_processes counted the processes of one "
            "machine (its comment says 'Worker processes per machine'). num_processes now "
            "counts the processes of all machines together, as in Accelerate, so this file "
            f"would start {total} processes in all instead of {total * machines}. For the same "
            f"job {per_machine}, and delete that comment line: it is how nbaccel tells files "
            "written before the change.",
            field="num_processes",
        )
    if total % machines:
        raise ConfigError(
            f"Config file {path}: num_processes: {total} cannot be split evenly over "
            f"num_machines: {machines}. num_processes counts the processes of all machines "
            "together, as in Accelerate, and every machine starts the same number; before, "
            "nbaccel counted one machine's, which this file may have been written for. For "
            f"{total} per machine {per_machine}; for {total} in all, use a multiple of "
            f"{machines}.",
            field="num_processes",
        )


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
