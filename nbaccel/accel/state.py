"""Who this process is inside ``Accelerator``: rank, world size, device and distributed type.

Three sources, in order: the nbaccel launch this worker belongs to (its ``ProcessContext``),
the torch.distributed environment a launcher such as torchrun set (``RANK``, ``WORLD_SIZE``,
...), and otherwise one process. With more than one process the default process group is
initialised here when the launcher has not done it (``init_process_group=False``, torchrun),
with ``InitProcessGroupKwargs``' backend, init method and timeout when given. A group that
already exists (an nbaccel launch creates it before the training function runs) gets the
handler's timeout through ``apply_init_process_group_kwargs``; a backend or rendezvous other
than the group's is refused there (the group cannot be made again inside the run).
Processes that train through torch_xla (TPUs) get theirs from ``strategies.xla_setup``.
"""

from __future__ import annotations

import atexit
import gc
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from nbaccel.config.accelerate.enums import (
    DistributedType as DistributedType,  # importers use this path
)
from nbaccel.config.resolve import resolve
from nbaccel.config.schema import Config
from nbaccel.context import active_session
from nbaccel.hardware.devices import detect_tpu
from nbaccel.hardware.xla_plan import uses_xla


@dataclass(frozen=True)
class ProcessState:
    """This process's place in the run.

    >>> state = ProcessState(0, 0, 1, 1, torch.device("cpu"), DistributedType.NO, "")
    >>> state.is_main_process, state.use_distributed
    (True, False)
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    distributed_type: DistributedType
    run_dir: str

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_rank == 0

    @property
    def use_distributed(self) -> bool:
        return self.world_size > 1


def launch_config(config: Config | None) -> Config:
    """The settings an Accelerator starts from: ``config`` if given, else the launch's
    resolved Config, else (torchrun, a plain script) env variables and the default file."""
    if config is not None:
        return config
    session = active_session()
    if session is not None:
        return session.config
    return resolve({}, env=os.environ).config


def torch_process_state(
    config: Config,
    env: Mapping[str, str] | None = None,
    init_kwargs: Mapping[str, Any] | None = None,
) -> ProcessState:
    """The ProcessState of a process that trains through torch.distributed (not torch_xla:
    see ``nbaccel.accel.strategies.detect_process_state``), initialising the default
    process group when the launcher has not (``init_kwargs``: ``InitProcessGroupKwargs``'
    ``backend`` and ``init_method`` for it; the timeout is ``config.collective_timeout``)."""
    env = os.environ if env is None else env
    session = active_session()
    if session is not None:
        ctx = session.context
        rank, local_rank, world, local_world = (
            ctx.rank,
            ctx.local_rank,
            ctx.world_size,
            ctx.local_world_size,
        )
        run_dir = ctx.run_dir
    elif "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        run_dir = ""
    else:
        rank, local_rank, world, local_world, run_dir = 0, 0, 1, 1, ""
    use_cuda = torch.cuda.is_available() and not config.use_cpu
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        # Launched without a group (torchrun, or nbaccel with init_process_group=False):
        # the env:// rendezvous those launchers set up is used, as torch's own tools do.
        chosen = dict(init_kwargs or {})
        backend = chosen.get("backend") or ("cpu:gloo,cuda:nccl" if use_cuda else "gloo")
        dist.init_process_group(
            backend,
            init_method=chosen.get("init_method"),
            timeout=timedelta(seconds=config.collective_timeout),
        )
        # The group is ours, so its teardown is too: a gloo group still alive when the
        # interpreter finalises aborts the process (SIGABRT) in some share of runs.
        atexit.register(_destroy_group_if_alive)
    return ProcessState(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        device=device,
        distributed_type=_distributed_type(config, world, use_cuda),
        run_dir=run_dir,
    )


def apply_init_process_group_kwargs(kwargs: Mapping[str, Any], device: torch.device) -> None:
    """Give the existing default group what ``InitProcessGroupKwargs`` asked for.

    ``timeout`` becomes the group's timeout for every later collective. ``backend`` must be
    the one the group already uses on ``device``, and ``init_method`` absent or ``env://``
    (the rendezvous the launchers set up): a group cannot change either once it exists, so
    anything else is an error naming the fix. Without a group there is nothing to apply.
    """
    if not kwargs or not dist.is_initialized():
        return
    backend = kwargs.get("backend")
    if backend is not None:
        have = _backends_by_device(dist.get_backend_config())
        want = _backends_by_device(str(backend))
        wanted = want.get(device.type, want.get("*"))
        if wanted is not None and wanted != have.get(device.type):
            raise ValueError(
                f"InitProcessGroupKwargs(backend={backend!r}): this run's process group "
                f"already exists with {have.get(device.type)!r} for {device.type} tensors "
                f"(the launch created it before the training function ran), and a group "
                f"cannot change its backend. Leave backend out (nbaccel picks gloo on CPU, "
                f"nccl on GPUs), or create the group yourself and launch with "
                f"init_process_group=False."
            )
    init_method = kwargs.get("init_method")
    if init_method not in (None, "env://"):
        raise ValueError(
            f"InitProcessGroupKwargs(init_method={init_method!r}): this run's process group "
            "already met its peers through the launch's rendezvous, and it cannot meet again "
            "elsewhere. Leave init_method out, or launch with init_process_group=False so "
            "that the group is created with it."
        )
    timeout = kwargs.get("timeout")
    if timeout is not None:
        # torch has no public setter for an existing group's timeout; _set_pg_timeout is what
        # torch's own dist.breakpoint() uses to lengthen it (tests/unit/accel/
        # test_options_wiring.py fails if a torch release removes or changes it).
        distributed_c10d._set_pg_timeout(timeout)


def _backends_by_device(spec: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> {"cpu": "gloo", "cuda": "nccl"}; ``"gloo"`` -> {"*": "gloo"}.

    >>> _backends_by_device("cpu:gloo,cuda:nccl"), _backends_by_device("GLOO")
    ({'cpu': 'gloo', 'cuda': 'nccl'}, {'*': 'gloo'})
    """
    found: dict[str, str] = {}
    for part in spec.lower().split(","):
        device, _, name = part.strip().rpartition(":")
        found[device or "*"] = name
    return found


def uses_xla_here(config: Config, env: Mapping[str, str] | None = None) -> bool:
    """Whether this process trains through torch_xla: as its launch planned it (nbaccel's
    XLA launch sets the session's plan), else as nbaccel would plan a launch here (TPU
    chips found, ``PJRT_DEVICE`` set, or ``strategy='xla'``)."""
    session = active_session()
    if session is not None:
        return session.xla is not None
    return uses_xla(config, detect_tpu(Path("/"), os.environ if env is None else env))


def _destroy_group_if_alive() -> None:
    # FACTS.md: destroying alone still aborted some runs; collecting dead wrappers and
    # meeting at a barrier first (so no peer closes its sockets mid-teardown) did not.
    if not dist.is_initialized():
        return
    gc.collect()
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - a peer already gone; tear down our side regardless
        pass
    dist.destroy_process_group()


def _distributed_type(config: Config, world: int, use_cuda: bool) -> DistributedType:
    if config.strategy == "deepspeed":
        return DistributedType.DEEPSPEED
    if config.strategy == "fsdp":
        if world == 1:
            # As Accelerate users expect from FSDP on one GPU: it runs, with nothing to shard.
            warnings.warn(
                "strategy='fsdp' with one process: there is nothing to shard, so the model "
                "trains unsharded. Checkpoints keep FSDP's layout and load onto any number "
                "of processes. Launch with num_processes > 1 to shard.",
                stacklevel=3,
            )
            return DistributedType.NO
        return DistributedType.FSDP
    if world == 1:
        return DistributedType.NO
    return DistributedType.MULTI_GPU if use_cuda else DistributedType.MULTI_CPU
