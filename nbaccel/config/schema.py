"""The one configuration schema behind the launcher, YAML files, the CLI, the wizard and widgets.

``Config`` is a frozen dataclass with nested sections (``fsdp``, ``deepspeed``, ``dynamo``).
Every leaf field carries its help text, choices, lower bound and Accelerate's environment name
in its metadata; ``options()`` flattens them into ``Option`` records (dotted ``path``, flat
``name`` used by env vars, CLI flags and keyword arguments), so each face of the config is
generated from here and a field added once appears everywhere. Plain data, stdlib only.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nbaccel.config.consistency import check_consistency
from nbaccel.config.field_values import (
    Option,
    check_value,
    gpu_id_list,
    make_option,
    normal_value,
    parse_text,
    shown_ranks,
)
from nbaccel.config.sections import (
    CheckpointOptions,
    DeepSpeedOptions,
    DynamoOptions,
    FSDPOptions,
    schema_field,
)
from nbaccel.errors import ConfigError

__all__ = [
    "CheckpointOptions",
    "Config",
    "DeepSpeedOptions",
    "DynamoOptions",
    "FSDPOptions",
    "Option",
    "options",
    "parse_text",
    "shown_ranks",
]

MIXED_PRECISIONS = ("no", "fp16", "bf16")
STRATEGIES = ("auto", "ddp", "fsdp", "deepspeed", "xla")
TRACKERS = ("tensorboard", "csv", "jsonl", "wandb", "mlflow")
DYNAMO_BACKENDS = ("no", "eager", "aot_eager", "inductor", "cudagraphs")
XLA_START_METHODS = ("spawn", "fork")
# More CPU processes than this many per core is almost always a typo (num_processes=80 for
# 8); each process would get a sliver of a core and the run crawls or runs out of memory.
OVERSUBSCRIBE_FACTOR = 8


def worker_threads(config: Config, processes: int, inherited: str | None) -> str:
    """``OMP_NUM_THREADS`` for each of ``processes`` workers on this machine: the config's
    ``threads_per_process``, else what the environment already says (``inherited``), else
    the usable cores shared out.

    >>> worker_threads(Config(threads_per_process=3), 2, "8"), worker_threads(Config(), 1, "8")
    ('3', '8')
    """
    if config.threads_per_process is not None:
        return str(config.threads_per_process)
    return inherited or str(max(1, usable_cpu_cores() // max(1, processes)))


def usable_cpu_cores() -> int:
    """Cores this process may run on (a container's CPU set, not the host's count): what
    ``OVERSUBSCRIBE_FACTOR`` multiplies, and what the launcher divides threads by."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Config:
    """A resolved, validated run configuration (immutable).

    >>> Config(num_processes=2, mixed_precision="bf16").mixed_precision
    'bf16'
    >>> Config(mixed_precision="fp32")
    Traceback (most recent call last):
    ...
    nbaccel.errors.ConfigError: mixed_precision='fp32' is not one of 'no', 'fp16', 'bf16'.
    """

    num_processes: int | None = schema_field(
        None,
        "Worker processes in all, over every machine (as Accelerate's --num_processes); each "
        "machine starts num_processes / num_machines. Default: one per visible GPU on each "
        "machine, else 1.",
        minimum=1,
    )
    allow_oversubscribe: bool = schema_field(
        False,
        f"Allow more than {OVERSUBSCRIBE_FACTOR} CPU processes per core (refused otherwise: "
        "usually a typo, and each process would get a sliver of a core).",
    )
    num_machines: int = schema_field(
        1, "Machines taking part (multi-node via nbaccel launch).", minimum=1
    )
    machine_rank: int = schema_field(0, "This machine's rank, 0 .. num_machines-1.", minimum=0)
    main_process_ip: str = schema_field(
        "127.0.0.1", "Address of machine 0 (its rendezvous store), reachable from every machine."
    )
    main_process_port: int | None = schema_field(
        None,
        "Rendezvous port on machine 0. Default: a free port on one machine, 29500 on several.",
        minimum=1,
        maximum=65535,
    )
    hosts: tuple[str, ...] = schema_field(
        (),
        "Run on these machines from this process, one nbaccel agent each over SSH: host "
        "names (as ssh reaches them), or one entry that is 'slurm' (the allocation this runs "
        "in) or a hostfile (DeepSpeed's format: 'node1 slots=4'). Empty: this machine.",
    )
    ssh_options: str = schema_field(
        "", "Extra ssh arguments for hosts, as on a command line (e.g. '-F ~/.ssh/cluster')."
    )
    remote_python: str = schema_field(
        "", "The Python to run on hosts (default: this interpreter's path, the same on each)."
    )
    use_cpu: bool = schema_field(
        False,
        "Run CPU processes (gloo) even when GPUs are present.",
        accelerate_env="ACCELERATE_USE_CPU",
    )
    gpu_ids: str = schema_field(
        "all",
        "The GPUs of this machine the workers use: 'all', or indices such as '0,2' among the "
        "GPUs this process sees (CUDA_VISIBLE_DEVICES narrows them first); each worker sees "
        "only those, rank r the r-th, and num_processes defaults to their number.",
        int_list=True,
    )
    mixed_precision: str = schema_field(
        "no",
        "Autocast precision for the forward pass: no, fp16 (with a loss scaler) or bf16.",
        choices=MIXED_PRECISIONS,
        accelerate_env="ACCELERATE_MIXED_PRECISION",
    )
    gradient_accumulation_steps: int = schema_field(
        1,
        "Micro-batches whose gradients are summed before each optimizer step.",
        accelerate_env="ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
        minimum=1,
    )
    sync_each_batch: bool = schema_field(
        False,
        "With accumulation, reduce gradients on every micro-batch, not only the last: more "
        "communication, but FSDP keeps gradients sharded in between (less memory).",
    )
    max_grad_norm: float | None = schema_field(
        None,
        "Clip the gradient norm to this value before each step (none: no clipping).",
        accelerate_env="ACCELERATE_GRADIENT_CLIPPING",
        minimum=0.0,
    )
    strategy: str = schema_field(
        "auto",
        "How the model is distributed: auto (DDP with several processes, XLA on TPUs), ddp, "
        "fsdp, deepspeed or xla.",
        choices=STRATEGIES,
    )
    shard_optimizer_state: bool = schema_field(
        False,
        "With DDP (strategy auto or ddp): shard the optimizer state across processes "
        "(ZeRO-1, torch's ZeroRedundancyOptimizer); parameters and gradients stay whole.",
    )
    xla_start_method: str = schema_field(
        "spawn",
        "How torch_xla starts its worker processes on TPUs: spawn (a fresh interpreter per "
        "chip, the safe default) or fork (faster start; safe here because the process that "
        "forks never touches the XLA device).",
        choices=XLA_START_METHODS,
    )
    fsdp: FSDPOptions = field(default_factory=FSDPOptions, metadata={"help": FSDPOptions.__doc__})
    deepspeed: DeepSpeedOptions = field(
        default_factory=DeepSpeedOptions, metadata={"help": DeepSpeedOptions.__doc__}
    )
    dynamo_backend: str = schema_field(
        "no",
        "torch.compile the model in prepare() with this backend (no: eager).",
        choices=DYNAMO_BACKENDS,
    )
    dynamo: DynamoOptions = field(
        default_factory=DynamoOptions, metadata={"help": DynamoOptions.__doc__}
    )
    log_with: tuple[str, ...] = schema_field(
        (),
        "Experiment trackers fed by Accelerator.log (comma list): tensorboard, csv, jsonl, "
        "wandb, mlflow.",
        choices=TRACKERS,
    )
    project_dir: str = schema_field(
        "", "Folder for trackers' files and checkpoints. Default: the run's run_dir."
    )
    init_process_group: bool = schema_field(
        True,
        "Initialise torch.distributed's default group before calling the function. "
        "Turn off if the function calls init_process_group() itself.",
    )
    collective_timeout: float = schema_field(
        1800.0,
        "Seconds a rank may wait in a collective before the run fails, naming the stuck ranks.",
        minimum=0.001,
    )
    rdzv_timeout: float = schema_field(
        900.0,
        "Seconds to wait for every machine to join the rendezvous (multi-node).",
        minimum=0.001,
    )
    max_restarts: int = schema_field(
        0,
        "Restart every worker after a failure, up to this many times (torch elastic's "
        "max_restarts); a function resumes with load_state from its latest checkpoint.",
        minimum=0,
    )
    log_ranks: str = schema_field(
        "0",
        "Ranks whose output is shown live: '0', 'all', or a comma list such as '0,1'.",
    )
    dashboard_after: float = schema_field(
        0.25,
        "Seconds a blocking call's run goes before its live widget dashboard is built; a run "
        "that ends sooner shows only its summary (status, memory, curves, the log's tail). "
        "0: at once. Launches that return at once (nbaccel.launch) show it at once.",
        minimum=0.0,
    )
    runs_dir: str = schema_field(
        "nbaccel_runs",
        "Folder under which each run gets its own run_dir (config, per-rank logs, events).",
    )
    metrics_in_memory: int = schema_field(
        10_000,
        "How many of rank 0's latest logged metrics run.metrics keeps in the kernel's memory; "
        "older ones are read back from run_dir/events.jsonl when asked for.",
        minimum=0,
    )
    preload_libraries: bool = schema_field(
        True,
        "Have the helper import, before it forks the next launch's workers, the installed "
        "libraries the kernel and the last launch's workers imported (never the notebook's "
        "own modules or editable installs), so a relaunch does not pay their imports again.",
    )
    shared_memory_limit_gb: float | None = schema_field(
        None,
        "GiB of shared memory that large buffers sent to this machine's workers (arrays, "
        "DataFrames, Arrow tables, tensors) may take, kept between launches while unchanged; "
        "data beyond it goes through the pipe, a copy per rank. Default: half of this "
        "machine's memory; 0: never share.",
        minimum=0.0,
    )
    threads_per_process: int | None = schema_field(
        None,
        "CPU threads each worker uses (OMP_NUM_THREADS, torch.set_num_threads). Default: an "
        "OMP_NUM_THREADS already set, else this machine's cores divided by its processes.",
        minimum=1,
    )
    detach: bool = schema_field(
        False,
        "Run the workers under a supervisor of their own that outlives the kernel: restarting "
        "or losing the kernel leaves the run going; nbaccel.attach(run_id) finds it again.",
    )
    keep_workers: bool = schema_field(
        False,
        "When the function returns on every rank, keep the ranks alive as an nbaccel.Workers "
        "group (run.workers, nbaccel.last_workers()): the process group, the Accelerator, the "
        "devices' memory and each rank's returned value as `result`, for evaluation in the "
        "next cells without a relaunch.",
    )
    max_duration: float | None = schema_field(
        None,
        "Seconds after which the run saves and stops, as on SIGTERM (None: no limit): end "
        "before Colab's or Kaggle's cap with a checkpoint to resume from.",
        minimum=0.001,
    )
    checkpoint: CheckpointOptions = field(
        default_factory=CheckpointOptions, metadata={"help": CheckpointOptions.__doc__}
    )
    resume: str = schema_field(
        "never",
        "'auto': continue from the newest complete checkpoint in checkpoint_dir (its durable "
        "copy or the local one) when there is one; 'never'; or a checkpoint folder or URL.",
    )
    debugger: bool = schema_field(
        True,
        "breakpoint() and pdb.set_trace() on a rank open pdb in the launching cell (Jupyter's "
        "input box, or the terminal); off: each rank skips them, saying so once.",
    )
    post_mortem: bool = schema_field(
        False,
        "When a rank raises, open pdb in the cell at its failing frame before the run ends "
        "(with debugger on, and someone to type: a kernel with a frontend, or a terminal).",
    )
    stall_warning: float | None = schema_field(
        120.0,
        "Seconds without output, a logged metric or a finished step from any rank after "
        "which the run shows every rank's stack and the collective it waits in, once per "
        "stall; the run goes on (None: never).",
        minimum=0.001,
    )

    def __post_init__(self) -> None:
        for opt in options():
            check_value(opt, opt.get(self))
        shown_ranks(self.log_ranks)  # raises ConfigError when malformed
        gpu_id_list(self.gpu_ids)  # too
        check_consistency(self)

    def processes_per_machine(self, gpus: int) -> int:
        """How many workers each machine starts: ``num_processes / num_machines`` (an exact
        division, checked), or when ``num_processes`` is unset one per GPU visible to the
        workers (``gpus``; 0 for CPU processes), at least 1. The one place that turns the
        total into a per-machine count: every machine of a job starts the same number.

        >>> Config(num_processes=4, num_machines=2).processes_per_machine(gpus=8)
        2
        >>> Config(num_machines=2).processes_per_machine(gpus=0)
        1
        """
        if self.num_processes is None:
            return max(gpus, 1)
        return self.num_processes // self.num_machines

    def total_processes(self, gpus: int) -> int:
        """The world size: ``num_processes``, or when it is unset ``processes_per_machine``
        on each of the ``num_machines`` (``gpus`` as there).

        >>> Config(num_machines=2).total_processes(gpus=4)
        8
        >>> Config(num_processes=6, num_machines=2).total_processes(gpus=4)
        6
        """
        return self.processes_per_machine(gpus) * self.num_machines

    def replace(self, **changes: Any) -> Config:
        """A copy with some fields changed, by flat name (``fsdp_cpu_offload=True`` works)."""
        check_names(changes, "argument")
        return from_flat({**flatten(self), **changes})


@functools.cache
def options() -> tuple[Option, ...]:
    """Every leaf field, in schema order (sections in place)."""
    found: list[Option] = []
    for spec, hint in _fields_with_types(Config):
        if dataclasses.is_dataclass(hint):
            section = spec.name
            for sub, sub_hint in _fields_with_types(hint):  # type: ignore[arg-type]
                found.append(make_option(sub, sub_hint, f"{section}.{sub.name}"))
        else:
            found.append(make_option(spec, hint, spec.name))
    return tuple(found)


def option(name: str) -> Option:
    """The option with this flat name or dotted path."""
    for opt in options():
        if name in (opt.name, opt.path):
            return opt
    check_names([name], "argument")
    raise AssertionError("unreachable")


@functools.cache
def sections() -> dict[str, str]:
    """Nested section names and their descriptions."""
    return {
        spec.name: spec.metadata["help"]
        for spec, hint in _fields_with_types(Config)
        if dataclasses.is_dataclass(hint)
    }


def flatten(config: Config) -> dict[str, Any]:
    """``{flat name: value}`` for every option."""
    return {opt.name: opt.get(config) for opt in options()}


def from_flat(values: Mapping[str, Any]) -> Config:
    """Build a Config from ``{flat name or dotted path: value}`` (missing ones: defaults)."""
    check_names(values, "argument")
    nested: dict[str, Any] = {}
    section_values: dict[str, dict[str, Any]] = {name: {} for name in sections()}
    for key, value in values.items():
        opt = option(key)
        value = normal_value(opt, value)
        if "." in opt.path:
            section, leaf = opt.path.split(".")
            section_values[section][leaf] = value
        else:
            nested[opt.path] = value
    for section, fields in section_values.items():
        nested[section] = _section_types()[section](**fields)
    return Config(**nested)


def check_names(names: Iterable[Any], origin: str) -> None:
    """Raise ConfigError for a name that is no option, with a did-you-mean."""
    known = [opt.name for opt in options()] + [opt.path for opt in options() if "." in opt.path]
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"Unknown config field {name!r} ({origin}).{hint} "
                f"Valid fields: {', '.join(opt.name for opt in options())}.",
                field=str(name),
            )


@functools.cache
def _section_types() -> dict[str, Any]:
    """Section name -> its dataclass (type hints evaluated once: they cost ~0.3 ms)."""
    return {
        spec.name: hint
        for spec, hint in _fields_with_types(Config)
        if dataclasses.is_dataclass(hint)
    }


def _fields_with_types(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(cls)
    return [(spec, hints[spec.name]) for spec in dataclasses.fields(cls)]
