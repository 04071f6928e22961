"""How config fields are presented to people: when a question applies, how a value is
written, and the ``nbaccel launch`` flags for a config.

Shared by the terminal wizard (``nbaccel config``) and the notebook's ``ConfigPanel``, so
both hide the same fields and spell values the same way. Stdlib only, like the schema.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from typing import Any

from nbaccel.config.schema import OVERSUBSCRIBE_FACTOR, Config, options, usable_cpu_cores

Predicate = Callable[[Mapping[str, Any]], bool]


def _multi_node(values: Mapping[str, Any]) -> bool:
    return int(values["num_machines"]) > 1


def _with_hosts(values: Mapping[str, Any]) -> bool:
    return bool(values["hosts"])


# Dotted path (or a section prefix ending in ".") -> when its questions apply. A field not
# named here is always asked; a skipped one gets its schema default.
APPLIES_WHEN: dict[str, Predicate] = {
    "fsdp.": lambda values: values["strategy"] == "fsdp",
    "deepspeed.": lambda values: values["strategy"] == "deepspeed",
    "dynamo.": lambda values: values["dynamo_backend"] != "no",
    "shard_optimizer_state": lambda values: values["strategy"] in ("auto", "ddp"),
    "xla_start_method": lambda values: values["strategy"] in ("auto", "xla", "fsdp"),
    "sync_each_batch": lambda values: int(values["gradient_accumulation_steps"]) > 1,
    # DeepSpeed reads it only at stage 3 (and nbaccel refuses it below).
    "deepspeed.zero3_save_16bit_model": lambda values: int(values["deepspeed_zero_stage"]) == 3,
    **dict.fromkeys(["machine_rank", "main_process_ip", "main_process_port"], _multi_node),
    "rdzv_timeout": lambda values: _multi_node(values) or _with_hosts(values),
    # GPU processes on this machine only (hosts= chooses no GPUs here).
    "gpu_ids": lambda values: not values["use_cpu"] and not _with_hosts(values),
    # How the kernel reaches the hosts of hosts=: nothing to ask without hosts.
    **dict.fromkeys(["ssh_options", "remote_python"], _with_hosts),
    # Asked only when this machine's share of the processes would otherwise be refused on
    # its CPUs (num_processes counts all machines).
    "allow_oversubscribe": lambda values: (
        int(values["num_processes"] or 0) // max(int(values["num_machines"]), 1)
        > OVERSUBSCRIBE_FACTOR * usable_cpu_cores()
    ),
}


def applies(path: str, values: Mapping[str, Any]) -> bool:
    """Whether the wizard asks about ``path`` given the answers so far (by flat name).

    >>> applies("fsdp.cpu_offload", {"strategy": "ddp"}), applies("strategy", {})
    (False, True)
    """
    return all(
        predicate(values)
        for key, predicate in APPLIES_WHEN.items()
        if path == key or (key.endswith(".") and path.startswith(key))
    )


def show_value(value: Any) -> str:
    """A value as the wizard, ``config show`` and flags write it.

    >>> show_value(None), show_value(True), show_value(("csv", "jsonl")), show_value("")
    ('none', 'true', 'csv,jsonl', "''")
    """
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        value = ",".join(value)
    return str(value) if value != "" else "''"


def launch_flags(config: Config) -> str:
    """The ``nbaccel launch`` flags that set ``config``'s non-default values.

    >>> launch_flags(Config(num_processes=2, use_cpu=True, log_with=("csv",)))
    '--num_processes 2 --use_cpu true --log_with csv'
    """
    words: list[str] = []
    for opt in options():
        value = opt.get(config)
        if value != opt.default:
            text = show_value(value)
            words += [f"--{opt.name}", "" if text == "''" else text]
    return shlex.join(words)
