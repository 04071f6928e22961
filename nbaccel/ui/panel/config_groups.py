"""How the config panel groups its fields, and which fields this machine makes irrelevant.

The groups follow the wizard's questions (``nbaccel config`` asks in schema order): where
the processes run, the precision, the strategy and its sharding, the training loop, logging,
and the rest under *advanced* (collapsed). A field the schema gains without being named here
lands in *advanced*, so nothing is ever left out of the panel.

``MACHINE_RELEVANT`` goes one step beyond the wizard's ``APPLIES_WHEN``: a field that cannot
change anything on *this* machine (``xla_start_method`` without a TPU or ``PJRT_DEVICE``,
``use_cpu`` without a GPU) is hidden too, unless its value is not the default (then it was
set on purpose and stays in view) or the panel is asked to show fields for other machines.
Unlike a field the wizard skips, such a field keeps its value. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nbaccel.config.schema import Option, options


@dataclass(frozen=True)
class Group:
    """A titled group of fields: ``key`` names its CSS class (``nbaccel-group-<key>``)."""

    key: str
    title: str
    fields: tuple[str, ...]  # flat names, or a section prefix ending in "." ("fsdp.")
    collapsed: bool = False


GROUPS = (
    Group(
        "processes",
        "Processes and machines",
        (
            *("num_processes", "allow_oversubscribe", "use_cpu", "gpu_ids", "num_machines"),
            *("machine_rank", "main_process_ip", "main_process_port", "rdzv_timeout"),
            *("hosts", "ssh_options", "remote_python", "max_restarts"),
        ),
    ),
    Group("precision", "Precision", ("mixed_precision",)),
    Group(
        "strategy",
        "Strategy and sharding",
        ("strategy", "shard_optimizer_state", "xla_start_method", "fsdp.", "deepspeed."),
    ),
    Group(
        "loop",
        "Training loop",
        (
            *("gradient_accumulation_steps", "sync_each_batch", "max_grad_norm"),
            *("dynamo_backend", "dynamo."),
        ),
    ),
    Group("logging", "Logging", ("log_with", "project_dir", "log_ranks", "runs_dir")),
    # Everything not named above (init_process_group, timeouts, metrics_in_memory, and any
    # field the schema gains later).
    Group("advanced", "Advanced", (), collapsed=True),
)


def group_of(opt: Option) -> Group:
    """The group a field belongs to: the first naming it (or its section), else *advanced*.

    >>> from nbaccel.config.schema import option
    >>> group_of(option("fsdp_cpu_offload")).title, group_of(option("collective_timeout")).key
    ('Strategy and sharding', 'advanced')
    """
    for group in GROUPS:
        for name in group.fields:
            if opt.name == name or (name.endswith(".") and opt.path.startswith(name)):
                return group
    return GROUPS[-1]


def grouped_options() -> dict[str, list[Option]]:
    """``{group key: its options in schema order (the wizard's order)}``, every group listed.

    >>> [opt.name for opt in grouped_options()["precision"]]
    ['mixed_precision']
    """
    found: dict[str, list[Option]] = {group.key: [] for group in GROUPS}
    for opt in options():
        found[group_of(opt).key].append(opt)
    return found


@dataclass(frozen=True)
class Machine:
    """What the panel knows of this machine: GPUs visible to workers, TPU chips found, and
    whether ``PJRT_DEVICE`` asks for torch_xla (then XLA settings matter without a TPU)."""

    gpus: int
    tpu_chips: int = 0
    pjrt_device: bool = False

    @property
    def xla(self) -> bool:
        return bool(self.tpu_chips) or self.pjrt_device


# Flat name -> whether the field can change anything on this machine, given the values.
MACHINE_RELEVANT: dict[str, Callable[[Machine, Mapping[str, Any]], bool]] = {
    # torch_xla starts its workers only on TPUs (or with PJRT_DEVICE), or with strategy xla.
    "xla_start_method": lambda machine, values: machine.xla or values["strategy"] == "xla",
    # Without a GPU every run is a CPU run already, and there is no GPU to choose.
    "use_cpu": lambda machine, values: machine.gpus > 0 or machine.xla,
    "gpu_ids": lambda machine, values: machine.gpus > 0,
}


def matters_here(opt: Option, machine: Machine, values: Mapping[str, Any]) -> bool:
    """Whether ``opt`` can change anything on ``machine``; a value other than the default
    always counts (it was set on purpose: hiding it would hide what runs).

    >>> from nbaccel.config.schema import option
    >>> values = {"strategy": "auto", "xla_start_method": "spawn"}
    >>> matters_here(option("xla_start_method"), Machine(gpus=0), values)
    False
    >>> matters_here(option("xla_start_method"), Machine(gpus=0, tpu_chips=4), values)
    True
    """
    relevant = MACHINE_RELEVANT.get(opt.name)
    return relevant is None or relevant(machine, values) or values[opt.name] != opt.default
