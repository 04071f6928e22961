"""Who this process is in a torch_xla run: rank, world, the XLA device; SPMD turned on
for FSDPv2. Imports torch_xla only inside functions (nbaccel's main environment has none).
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from nbaccel.accel.state import DistributedType, ProcessState
from nbaccel.config.schema import Config
from nbaccel.context import active_session
from nbaccel.errors import ConfigError
from nbaccel.hardware.xla_plan import check_versions


def detect_xla_state(config: Config) -> ProcessState:
    """This process's place in an XLA run; turns SPMD on first when the strategy is fsdp."""
    session = active_session()
    plan = session.xla if session is not None else None
    spmd = plan.spmd if plan is not None else config.strategy == "fsdp"
    _check_config(config, spmd)
    torch_xla, xr = _import_torch_xla()
    if spmd:
        _enable_spmd(torch_xla, xr)
    device = torch_xla.device()
    run_dir = session.context.run_dir if session is not None else ""
    if spmd:  # one process drives every device
        rank, local_rank, world, local_world = 0, 0, 1, 1
    elif session is not None:
        ctx = session.context
        rank, local_rank, world = ctx.rank, ctx.local_rank, ctx.world_size
        local_world = ctx.local_world_size
    else:  # torch_xla.launch / xmp.spawn without nbaccel, or one plain process
        rank, local_rank = xr.global_ordinal(), xr.local_ordinal()
        world, local_world = xr.world_size(), xr.local_device_count()
    if world > 1 and not dist.is_initialized() and xr.addressable_device_count() == 1:
        # Users' own torch.distributed calls work as on GPUs (nbaccel's launcher creates this
        # group too). Only with one device per process: the default group is per process,
        # so threaded devices (TPU v2/v3) rely on torch_xla's collectives, as nbaccel does.
        importlib.import_module("torch_xla.distributed.xla_backend")  # registers "xla"
        dist.init_process_group(
            "xla", init_method="xla://", timeout=timedelta(seconds=config.collective_timeout)
        )
    return ProcessState(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        device=device,
        distributed_type=DistributedType.XLA,
        run_dir=run_dir,
    )


def _check_config(config: Config, spmd: bool) -> None:
    if config.mixed_precision == "fp16":
        raise ConfigError(
            "mixed_precision='fp16' is not available on XLA devices: TPUs compute in bfloat16, "
            "which needs no loss scaling. Use mixed_precision='bf16' (or 'no').",
            field="mixed_precision",
        )
    if config.shard_optimizer_state:
        raise ConfigError(
            "shard_optimizer_state=True shards the optimizer over a torch.distributed group "
            "(ZeroRedundancyOptimizer), which XLA runs do not use. Use strategy='fsdp' to "
            "shard parameters, gradients and optimizer state on TPUs (FSDPv2).",
            field="shard_optimizer_state",
        )
    if not spmd:
        return
    fsdp = config.fsdp
    unsupported = [
        (fsdp.sharding_strategy != "FULL_SHARD", "fsdp_sharding_strategy", "FULL_SHARD"),
        (fsdp.cpu_offload, "fsdp_cpu_offload", "False"),
        (fsdp.activation_checkpointing, "fsdp_activation_checkpointing", "False"),
    ]
    for wrong, name, supported in unsupported:
        if wrong:
            raise ConfigError(
                f"strategy='fsdp' on XLA devices runs torch_xla's FSDPv2 (SPMD), which has no "
                f"{name}={getattr(fsdp, name.removeprefix('fsdp_'))!r}: it shards every "
                f"parameter along one mesh axis. Set {name}={supported}.",
                field=name,
            )


def _import_torch_xla() -> tuple[Any, Any]:
    problem = check_versions()  # from package metadata: a mismatch fails with a clear fix
    if problem is not None:
        raise ConfigError(problem, field="strategy")
    try:
        import torch_xla
        import torch_xla.runtime as xr
    except ImportError as error:
        raise ConfigError(
            "This run trains through torch_xla (strategy='xla', TPU chips found, or "
            f"PJRT_DEVICE set), but importing torch_xla failed: {error}. Install torch_xla "
            "matching torch (pip install 'nbaccel[xla]'), or use strategy='ddp'.",
            field="strategy",
        ) from error
    return torch_xla, xr


def _enable_spmd(torch_xla: Any, xr: Any) -> None:
    if xr.is_spmd():
        return
    if torch_xla._XLAC._xla_get_spmd_config_is_locked():
        # torch_xla would replicate the existing tensors to force SPMD; on torch_xla 2.9 the
        # process then dies at the first step without a message, so refuse instead.
        raise ConfigError(
            "strategy='fsdp' on XLA devices needs SPMD mode, which torch_xla must turn on "
            "before the XLA device is first used, but this process already used it "
            "(torch_xla.device(), a tensor or model moved to 'xla', ...). Create the "
            "Accelerator before touching the XLA device, or call "
            "torch_xla.runtime.use_spmd() at the very start.",
            field="strategy",
        )
    xr.use_spmd()
