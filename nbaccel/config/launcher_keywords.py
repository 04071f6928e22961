"""Accelerate's ``notebook_launcher`` keywords, mapped onto nbaccel's one schema.

``accelerate.notebook_launcher(f, args, num_processes, mixed_precision, use_port,
master_addr, node_rank, num_nodes, rdzv_backend, rdzv_endpoint, rdzv_conf, rdzv_id,
max_restarts, monitor_interval, log_line_prefix_template)``: a cell written for it runs under
``nbaccel.notebook_launcher`` unchanged. Keywords that name a schema field are renamed to it
(``use_port`` -> ``main_process_port``, so ``config show`` and every check see them); the
elastic agent's own knobs are accepted where nbaccel already does what they ask and refused,
with the reason, where it does not. Never ignored. Plain data, stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from nbaccel.errors import ConfigError

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
    "One-machine launches from Python rendezvous over a private TCP store on 127.0.0.1; "
    "for several machines run `nbaccel launch --num_machines N --machine_rank R "
    "--main_process_ip HOST --num_processes TOTAL script.py` on each (TOTAL counts every "
    "machine's processes; --nproc_per_node P gives the count per machine instead)."
)


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
        elif key in _ELASTIC_ONLY:
            _check_elastic_keyword(key, value)
    return mapped


def _port(value: Any) -> Any:
    """Accelerate passes the port as text ("29500"); the schema wants an int."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value  # anything else reaches the schema's own check, which names the field


def _check_elastic_keyword(key: str, value: Any) -> None:
    if key == "rdzv_backend":
        if value not in _RENDEZVOUS_BACKENDS:
            raise ConfigError(
                f"rdzv_backend={value!r} is not available: nbaccel's workers always meet "
                f"through torch's c10d TCP store (rdzv_backend 'static' or 'c10d' mean the "
                f"same on one machine). Remove the keyword, or use 'c10d'.",
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
    elif key in ("rdzv_endpoint", "rdzv_conf"):
        if value not in ("", None, {}):
            raise ConfigError(
                f"{key}={value!r} is not available. {_FOR_SEVERAL_MACHINES}", field=key
            )
    elif key == "rdzv_id":
        if value not in ("none", None):
            raise ConfigError(
                f"rdzv_id={value!r} names a job for a shared rendezvous, which one-machine "
                f"launches do not use (each run has its own id: run.run_id). "
                f"{_FOR_SEVERAL_MACHINES}",
                field=key,
            )
    elif value is not None:  # log_line_prefix_template
        raise ConfigError(
            f"log_line_prefix_template={value!r} is not available: nbaccel labels each "
            "rank's lines itself ('[rank N]') and log_ranks chooses which ranks are shown. "
            "Remove the keyword.",
            field=key,
        )
