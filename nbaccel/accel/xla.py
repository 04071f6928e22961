"""The Accelerator on XLA devices (TPUs; torch_xla's CPU device in tests), through torch_xla.

Only processes that train through torch_xla import this module's torch_xla parts, and only
inside functions: nbaccel's main environment has no torch_xla. Two modes, as torch_xla has:

* Data parallel (``strategy='xla'``, or ``'auto'`` on a TPU): one rank per XLA device (a
  process each, or threads of one process on TPU v2/v3). The model is replicated, not
  wrapped: rank 0's initial weights are broadcast (as DDP does) and the gradients are
  all-reduced in the optimizer step (``xm.reduce_gradients``, what ``xm.optimizer_step``
  does), only on steps that sync, so gradient accumulation needs no ``no_sync``.
* SPMD with FSDPv2 (``strategy='fsdp'``): one process drives every device. Parameters are
  sharded along the ``fsdp`` axis of a (devices, 1) mesh; each global batch is loaded once
  and split along the same axis. nbaccel reports one process (``num_processes == 1``).

``distributed_type`` is ``DistributedType.XLA`` in both modes, as in Hugging Face Accelerate,
so code that branches on it for TPUs keeps working. torch_xla records operations lazily and
compiles them into graphs at each ``torch_xla.sync()``; where nbaccel syncs, a comment says
why. Collectives use torch_xla's own (``xm.all_gather``, ``xm.rendezvous``): a
torch.distributed group exists only with one device per process, never across threads.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nbaccel.accel import collectives, xla_prepare
from nbaccel.accel.checkpoint import DeviceHooks
from nbaccel.accel.collectives import tree_map
from nbaccel.accel.precision import Precision
from nbaccel.accel.state import DistributedType, ProcessState
from nbaccel.accel.xla_prepare import Batch
from nbaccel.config.schema import Config
from nbaccel.context import active_session
from nbaccel.errors import ConfigError
from nbaccel.xla_plan import check_versions


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


class XlaRuntime:
    """What changes on XLA devices: collectives, graph cuts, model and loader preparation."""

    def __init__(self, state: ProcessState) -> None:
        import torch_xla.runtime as xr

        self.state = state
        self.device = state.device
        # SPMD (FSDPv2): the mesh over every device; None in data parallel.
        self.mesh = xla_prepare.fsdp_mesh() if xr.is_spmd() else None
        self._loaders_syncing = 0  # torch_xla loaders mid-iteration (they sync per batch)

    # -- graph cuts and collectives ------------------------------------------------------
    def sync(self) -> None:
        """Compile and run what was recorded so far (``torch_xla.sync()``)."""
        import torch_xla

        torch_xla.sync()

    def after_step(self) -> None:
        """Called after each real optimizer step."""
        # Cut the graph at the step, unless a torch_xla loader does it at the next batch:
        # otherwise each step's operations join one ever-growing graph, compiled anew.
        if not self._loaders_syncing:
            self.sync()

    def barrier(self, tag: str = "nbaccel.wait_for_everyone") -> None:
        # A sync first: the barrier is also the point where every rank's work is issued.
        self.sync()
        if self.state.world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.rendezvous(tag)

    def _collective(self, one: Callable[[torch.Tensor], torch.Tensor], data: Any) -> Any:
        # Sync before: the collective then runs in a graph of its own, identical on every
        # rank (pending work may differ between ranks). Sync after: results are computed
        # once, not by each read of each tensor.
        self.sync()
        result = tree_map(lambda t: one(t.to(self.device)), data)
        self.sync()
        return result

    def gather(self, data: Any) -> Any:
        """``collectives.gather`` over XLA devices (one process: a copy, as there)."""
        if self.state.world_size == 1:
            return collectives.gather(data)
        import torch_xla.core.xla_model as xm

        return self._collective(
            lambda t: xm.all_gather(t.reshape(1) if t.dim() == 0 else t, dim=0), data
        )

    def reduce(self, data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """``collectives.reduce`` over XLA devices."""
        if self.state.world_size == 1 or reduction == "none":
            return collectives.reduce(data, reduction, scale)
        import torch_xla.core.xla_model as xm

        world = self.state.world_size
        divisor = world if reduction == "mean" else 1

        def one(tensor: torch.Tensor) -> torch.Tensor:
            summed: torch.Tensor = xm.all_reduce(
                xm.REDUCE_SUM, tensor.clone(), scale=scale / divisor
            )
            return summed

        return self._collective(one, data)

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj`` in rank order; lists are concatenated."""
        if self.state.world_size == 1:
            return collectives.gather_object(obj)
        import torch_xla.core.xla_model as xm

        parts = [pickle.loads(p) for p in xm.rendezvous("nbaccel.gather_object", _dumps(obj))]
        if all(isinstance(p, list) for p in parts):
            return [item for part in parts for item in part]
        return parts

    def share(self, obj: Any) -> Any:
        """Rank 0's picklable ``obj``, on every rank (a broadcast)."""
        if self.state.world_size == 1:
            return obj
        import torch_xla.core.xla_model as xm

        mine = _dumps(obj) if self.state.rank == 0 else b""
        return pickle.loads(xm.rendezvous("nbaccel.share", mine)[0])

    def pad_across_processes(self, data: Any, dim: int, pad_index: int, first: bool) -> Any:
        distributed = self.state.world_size > 1
        return collectives.pad_across_processes(
            data, dim, pad_index, first, gather_sizes=self.gather if distributed else None
        )

    # -- optimizer and checkpoints -------------------------------------------------------
    def optimizer_hooks(self) -> dict[str, Any]:
        """``AcceleratedOptimizer`` arguments: gradient all-reduce and the step's graph cut."""
        reduce = None
        if self.state.world_size > 1:  # never under SPMD: there the compiler reduces
            import torch_xla.core.xla_model as xm

            reduce = xm.reduce_gradients
        return {"reduce": reduce, "after_step": self.after_step}

    def checkpoint_hooks(self) -> DeviceHooks:
        import torch_xla.core.xla_model as xm

        return DeviceHooks(
            to_host=self.to_host,
            barrier=lambda: self.barrier("nbaccel.checkpoint"),
            share=self.share,
            rng_state=lambda: int(xm.get_rng_state()),
            set_rng_state=lambda seed: xm.set_rng_state(int(seed)),
            after_load=self.sync,  # the loaded values become device data, not pending copies
        )

    def to_host(self, data: Any) -> Any:
        """CPU copies of the device tensors in ``data`` (state dicts), for ``torch.save``."""
        # One sync computes every pending value; the copies after it only transfer. Sharded
        # (SPMD) tensors arrive whole.
        self.sync()
        return tree_map(
            lambda t: t.cpu() if t.device.type == "xla" else t, data, other=lambda leaf: leaf
        )

    # -- models and batches ---------------------------------------------------------------
    def prepare_model(
        self, model: torch.nn.Module, precision: Precision, placement: bool, config: Config
    ) -> tuple[torch.nn.Module, dict[int, torch.nn.Parameter]]:
        """See ``xla_prepare.prepare_model``."""
        return xla_prepare.prepare_model(model, self.state, self.mesh, precision, placement, config)

    def device_stream(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """``batches`` on the device; see ``xla_prepare.device_stream``."""
        self._loaders_syncing += 1  # it syncs before each batch: the step need not
        try:
            yield from xla_prepare.device_stream(batches, self.device, self.mesh)
        finally:
            self._loaders_syncing -= 1


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
