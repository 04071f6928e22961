"""Settings that contradict each other, whatever the machine: checked as every ``Config`` is
made (``Config.__post_init__``), so a file, the environment and code all meet the same rules.
Plain data, stdlib only.
"""

from __future__ import annotations

from typing import Any

from nbaccel.config import cadence
from nbaccel.errors import ConfigError

# The functions below take a ``nbaccel.config.schema.Config``; typed ``Any`` since the schema
# imports this module (a type import back would make a circle of the two).
Config = Any


def check_consistency(config: Config) -> None:
    """Settings that contradict each other, whatever the machine."""
    if config.machine_rank >= config.num_machines:
        raise ConfigError(
            f"machine_rank={config.machine_rank} but num_machines={config.num_machines}: "
            f"machine ranks go from 0 to {config.num_machines - 1}.",
            field="machine_rank",
        )
    _check_process_split(config)
    _check_hosts(config)
    if config.strategy == "deepspeed" and config.use_cpu:
        raise ConfigError(
            "strategy='deepspeed' needs CUDA GPUs, but use_cpu=True. Use strategy='fsdp' "
            "(which runs on CPU) or turn use_cpu off.",
            field="strategy",
        )
    if config.shard_optimizer_state and config.strategy not in ("auto", "ddp"):
        raise ConfigError(
            f"shard_optimizer_state=True shards a DDP run's optimizer (ZeRO-1), but "
            f"strategy={config.strategy!r} has its own sharding. Use strategy='ddp', or "
            "fsdp_sharding_strategy / deepspeed_zero_stage to choose what is sharded.",
            field="shard_optimizer_state",
        )
    if config.fsdp.sharding_strategy == "HYBRID_SHARD" and config.num_machines == 1:
        raise ConfigError(
            "fsdp_sharding_strategy='HYBRID_SHARD' shards within a machine and replicates "
            "across machines, but num_machines=1. Use FULL_SHARD on one machine.",
            field="fsdp_sharding_strategy",
        )
    cadence.parse(config.checkpoint.every)  # raises ConfigError naming checkpoint_every
    if config.strategy == "xla" and config.use_cpu:
        raise ConfigError(
            "strategy='xla' runs on TPUs; use_cpu=True asks for CPU processes. Choose one.",
            field="strategy",
        )


def _check_hosts(config: Config) -> None:
    """``hosts`` drives every machine from here; the other ways to several machines, and
    what needs this machine only, do not mix with it."""
    if not config.hosts:
        return
    clash = (
        ("num_machines", config.num_machines > 1, "each machine's own launcher joins the job"),
        ("detach", config.detach, "a detached run's supervisor runs on this machine only"),
        ("strategy", config.strategy == "xla", "TPU hosts launch through torch_xla"),
        ("gpu_ids", config.gpu_ids != "all", "GPUs are chosen on this machine only"),
    )
    for name, present, why in clash:
        if present:
            raise ConfigError(
                f"hosts={list(config.hosts)} starts every machine's workers from here, but "
                f"{name}={getattr(config, name)!r} asks for a launch where {why}. Use one: "
                f"hosts alone, or leave hosts empty.",
                field="hosts",
            )


def _check_process_split(config: Config) -> None:
    """``num_processes`` counts every machine's processes, and each machine starts the same
    number, so the total must split evenly (checked here for every source: file, env, code)."""
    total, machines = config.num_processes, config.num_machines
    if total is None or total % machines == 0:
        return
    below, above = total // machines * machines, (total // machines + 1) * machines
    nearest = f"{below} or {above}" if below else str(above)
    raise ConfigError(
        f"num_processes={total} cannot be split evenly over num_machines={machines}: "
        "num_processes counts the processes of all machines together (as Accelerate's "
        "--num_processes does), and every machine starts the same number. Use a multiple of "
        f"{machines} ({nearest}); if you meant {total} per machine (nbaccel's meaning before), "
        f"set num_processes={total * machines}, or pass `nbaccel launch` --nproc_per_node "
        f"{total}.",
        field="num_processes",
    )
