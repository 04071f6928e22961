"""Accelerate's ``notebook_launcher`` keywords, mapped onto nbaccel's one schema.

``accelerate.notebook_launcher(f, args, num_processes, mixed_precision, use_port,
master_addr, node_rank, num_nodes, rdzv_backend, rdzv_endpoint, rdzv_conf, rdzv_id,
max_restarts, monitor_interval, log_line_prefix_template)``: a cell written for it runs under
``nbaccel.notebook_launcher`` unchanged, with these given by keyword or by position (nbaccel's
launchers take them in this order: ``POSITIONAL``). Keywords that name a schema field are
renamed to it (``use_port`` -> ``main_process_port``, so ``config show`` and every check see
them); the elastic agent's own knobs are accepted where nbaccel already does what they ask
and refused, with the reason, where it does not. Never ignored. Plain data, stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from nbaccel.errors import ConfigError

# accelerate.notebook_launcher's parameters after (function, args, num_processes), in its
# order: nbaccel's launchers take them at the same positions (and as keywords).
POSITIONAL = (
    "mixed_precision",
    "use_port",
    "master_addr",
    "node_rank",
    "num_nodes",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_conf",
    "rdzv_id",
    "max_restarts",
    "monitor_interval",
    "log_line_prefix_template",
)
# Accelerate's keyword -> the schema field that means the same thing.
RENAMED = {
    "use_port": "main_process_port",
    "master_addr": "main_process_ip",
    "node_rank": "machine_rank",
    "num_nodes": "num_machines",
}
# The elastic agent's keywords and the values that ask nothing nbaccel does not already do.
_RENDEZVOUS_BACKENDS = ("static", "c10d")
_ELASTIC_ONLY = (
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_conf",
    "rdzv_id",
    "monitor_interval",
    "log_line_prefix_template",
)
# max_restarts is not listed: it is the schema's own field under Accelerate's name, so it
# passes through untouched and the schema checks it (an int >= 0).
ACCELERATE_KEYWORDS = (*RENAMED, *_ELASTIC_ONLY)
_FOR_SEVERAL_MACHINES = (
    "For several machines run the same cell on each with num_nodes=N, node_rank=R, "
    "master_addr=<machine 0>, use_port=<port> (Accelerate's form), or drive them all from "
    "one cell with hosts=[...] (docs/multi-machine.md)."
)


def given_arguments(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """Those of Accelerate's launcher parameters (``POSITIONAL``) that a call gave: nbaccel's
    launchers default them to None, "not given", so the config file and env still count.

    >>> given_arguments({"mixed_precision": "bf16", "use_port": None, "function": print})
    {'mixed_precision': 'bf16'}
    """
    return {name: parameters[name] for name in POSITIONAL if parameters.get(name) is not None}


def from_accelerate_keywords(given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` with Accelerate's launcher keywords mapped to schema fields; others untouched.

    Raises ``ConfigError`` naming the keyword when its value asks for something nbaccel's
    launch cannot do (a custom rendezvous endpoint, a log prefix). ``max_restarts`` is the
    schema's own field (torch elastic restarts the workers), checked by the schema.

    >>> from_accelerate_keywords({"use_port": "29511", "mixed_precision": "bf16"})
    {'mixed_precision': 'bf16', 'main_process_port': 29511}
    >>> from_accelerate_keywords({"max_restarts": 1, "rdzv_backend": "static"})
    {'max_restarts': 1}
    """
    mapped = {key: value for key, value in given.items() if key not in ACCELERATE_KEYWORDS}
    for key, value in given.items():
        if key in RENAMED:
            field = RENAMED[key]
            if field in given:
                raise ConfigError(
                    f"Both {key}= (Accelerate's name) and {field}= were given; they are the "
                    f"same setting. Keep one.",
                    field=field,
                )
            mapped[field] = _port(value) if key == "use_port" else value
        elif key == "rdzv_endpoint":
            mapped.update(_endpoint(value, given) if value else {})
        elif key in _ELASTIC_ONLY:
            _check_elastic_keyword(key, value)
    if given.get("rdzv_backend") == "c10d" and _positive_int(given.get("num_nodes")) > 1:
        raise ConfigError(
            "rdzv_backend='c10d' with num_nodes > 1 lets torch elastic order the machines "
            "itself (by host name and process id), so a cell could not know which ranks it "
            "runs before they start. nbaccel joins the machines of a job through torch's "
            "static rendezvous, where node_rank places each machine (Accelerate's default "
            "too): remove rdzv_backend, or use hosts=[...] to drive every machine from one "
            "cell.",
            field="rdzv_backend",
        )
    return mapped


def processes_in_total(num_processes: int, given: Mapping[str, Any]) -> int:
    """``num_processes`` as the schema counts it: over every machine. Accelerate's
    ``notebook_launcher`` counts it per machine when ``num_nodes=`` is given (its
    ``nproc_per_node``), so a cell written for it starts the same job here.

    >>> processes_in_total(2, {"num_nodes": 3})
    6
    >>> processes_in_total(4, {"num_machines": 2})  # nbaccel's own field: already a total
    4
    """
    return num_processes * max(1, _positive_int(given.get("num_nodes")))


def _positive_int(value: Any) -> int:
    """``value`` if it is an int (the schema checks anything else, naming the field)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _endpoint(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """Accelerate's ``rdzv_endpoint="host:port"``: machine 0's address, as its
    ``master_addr``/``use_port`` give it.

    >>> _endpoint("10.0.0.1:29400", {})
    {'main_process_ip': '10.0.0.1', 'main_process_port': 29400}
    """
    host, _, port = str(value).rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"rdzv_endpoint={value!r} is not 'host:port' (machine 0's address and port).",
            field="rdzv_endpoint",
        )
    for key in ("master_addr", "use_port", "main_process_ip", "main_process_port"):
        if key in given:
            raise ConfigError(
                f"Both rdzv_endpoint= and {key}= were given; they name the same address. Keep one.",
                field="rdzv_endpoint",
            )
    return {"main_process_ip": host, "main_process_port": int(port)}


def _port(value: Any) -> Any:
    """Accelerate passes the port as text ("29500"); the schema wants an int."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value  # anything else reaches the schema's own check, which names the field


def _check_elastic_keyword(key: str, value: Any) -> None:
    if key == "rdzv_backend":
        if value not in _RENDEZVOUS_BACKENDS:
            raise ConfigError(
                f"rdzv_backend={value!r} is not available: nbaccel's workers meet through "
                f"torch's c10d TCP store, and the machines of a job in torch's static "
                f"rendezvous. Remove the keyword, or use 'static'.",
                field=key,
            )
    elif key == "monitor_interval":
        # Accelerate's agent polls its workers every monitor_interval seconds; nbaccel's
        # helper is woken by each worker's exit, so any interval asked for is met.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(
                f"monitor_interval must be a number of seconds, got {value!r}.", field=key
            )
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(
                f"monitor_interval must be a finite number > 0, got {value!r}.", field=key
            )
    elif key == "rdzv_conf":
        if value not in ("", None, {}):
            raise ConfigError(
                f"{key}={value!r} is not available. {_FOR_SEVERAL_MACHINES}", field=key
            )
    elif key == "rdzv_id":
        if value not in ("none", None):
            raise ConfigError(
                f"rdzv_id={value!r}: nbaccel names each run itself (run.run_id), and the "
                f"rendezvous of a job after its port (main_process_port), the same on every "
                f"machine. Remove the keyword. {_FOR_SEVERAL_MACHINES}",
                field=key,
            )
    elif value is not None:  # log_line_prefix_template
        raise ConfigError(
            f"log_line_prefix_template={value!r} is not available: nbaccel labels each "
            "rank's lines itself ('[rank N]') and log_ranks chooses which ranks are shown. "
            "Remove the keyword.",
            field=key,
        )
