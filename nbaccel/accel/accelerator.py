"""``Accelerator``: the training-loop API of Hugging Face Accelerate, run by nbaccel.

A thin facade: ``ProcessState`` says who this process is, ``Precision`` owns autocast and
the loss scaler, ``models`` wraps modules (DDP, compile), ``data`` shards loaders,
``optim`` makes optimizer and scheduler accumulation-aware, ``checkpointing`` saves and
restores, ``trackers`` record ``log`` calls; ``xla`` does these the XLA way on TPUs.
Settings come from the launch that started this worker
(``notebook_launcher(..., mixed_precision="bf16")``); explicit arguments win. Outside nbaccel
(torchrun, a plain script) they come from ``NBACCEL_*`` / ``ACCELERATE_*`` environment
variables and the default config file, as in ``nbaccel.config.resolve``.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from nbaccel.accel import models, sharding
from nbaccel.accel.checkpointing import Checkpointing
from nbaccel.accel.clipping import GradientClipping
from nbaccel.accel.data import (
    PreparedDataLoader,
    PreparedIterableLoader,
    ShardPlan,
    is_iterable_dataset,
)
from nbaccel.accel.deepspeed_engine import DeepSpeedRun
from nbaccel.accel.deepspeed_prepare import prepare_deepspeed
from nbaccel.accel.optim import AcceleratedOptimizer, AcceleratedScheduler, GradientState
from nbaccel.accel.precision import Precision
from nbaccel.accel.state import (
    DistributedType,
    ProcessState,
    detect_process_state,
    launch_config,
)
from nbaccel.accel.trackers import Tracker
from nbaccel.accel.tracking import Tracking
from nbaccel.accel.xla import XlaRuntime
from nbaccel.config.deepspeed import mixed_precision_of
from nbaccel.config.schema import Config
from nbaccel.metrics import report_model

_SCHEDULER_TYPES: tuple[type, ...] = (
    torch.optim.lr_scheduler.LRScheduler,
    torch.optim.lr_scheduler.ReduceLROnPlateau,
)


class Accelerator(Tracking, Checkpointing, GradientClipping):
    """Runs one training loop correctly on 1 process, N CPU processes or N GPUs.

    >>> import torch
    >>> acc = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> model, opt = acc.prepare(model, opt)
    >>> for _ in range(2):
    ...     with acc.accumulate(model):
    ...         loss = model(torch.ones(8, 4)).pow(2).mean()
    ...         acc.backward(loss)
    ...         opt.step(); opt.zero_grad()
    >>> acc.step, acc.sync_gradients, acc.num_processes, str(acc.device)
    (2, True, 1, 'cpu')
    """

    def __init__(
        self,
        *,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool | None = None,
        log_with: str | list[str] | tuple[str, ...] | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        dynamo_backend: str | None = None,
        device_placement: bool = True,
        split_batches: bool = False,
        even_batches: bool = True,
        step_scheduler_with_optimizer: bool = True,
        ddp_kwargs: dict[str, Any] | None = None,
        gradient_accumulation_plugin: Any = None,
        config: Config | None = None,
    ) -> None:
        explicit = {
            "mixed_precision": mixed_precision,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "use_cpu": cpu,
            "log_with": (log_with,) if isinstance(log_with, str) else log_with,
            "project_dir": os.fspath(project_dir) if project_dir is not None else None,
            "dynamo_backend": dynamo_backend,
        }
        if gradient_accumulation_plugin is not None:  # Accelerate's, read by its fields
            explicit["gradient_accumulation_steps"] = gradient_accumulation_plugin.num_steps
            explicit["sync_each_batch"] = gradient_accumulation_plugin.sync_each_batch
        # Validated here (ConfigError naming the choices) before any state is touched.
        self.config = launch_config(config).replace(
            **{k: v for k, v in explicit.items() if v is not None}
        )
        self.state: ProcessState = detect_process_state(self.config)
        xla = self.state.distributed_type is DistributedType.XLA
        self._xla: XlaRuntime | None = XlaRuntime(self.state) if xla else None
        self.precision = Precision(
            self.config.mixed_precision,
            self.state.device,
            sharded=self.state.distributed_type is DistributedType.FSDP,
            engine_scales=self.state.distributed_type is DistributedType.DEEPSPEED,
        )
        self.gradients = GradientState(accumulation_steps=self.config.gradient_accumulation_steps)
        self.device_placement = device_placement
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.step = 0  # accumulate() calls so far: micro-steps
        self.trackers: list[Tracker] = []
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[PreparedDataLoader | PreparedIterableLoader] = []
        self._custom: list[Any] = []
        # What prepare() replaced, by id of the original: FSDP's sharded parameters and
        # ZeRO-1's optimizer, so later optimizers and schedulers follow the replacements.
        self._new_params: dict[int, torch.nn.Parameter] = {}
        self._new_optimizers: dict[int, torch.optim.Optimizer] = {}
        self._deepspeed: DeepSpeedRun | None = None  # strategy='deepspeed': its one engine

    # -- who and where -------------------------------------------------------------------
    device = property(lambda self: self.state.device)
    process_index = property(lambda self: self.state.rank)
    local_process_index = property(lambda self: self.state.local_rank)
    num_processes = property(lambda self: self.state.world_size)
    mixed_precision = property(lambda self: self.config.mixed_precision)
    gradient_accumulation_steps = property(lambda self: self.gradients.accumulation_steps)
    sync_gradients = property(lambda self: self.gradients.sync_gradients)
    scaler = property(lambda self: self.precision.scaler)

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last step was skipped for inf/NaN fp16 gradients."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    # -- prepare ---------------------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: list[bool] | None = None) -> Any:
        """Wrap models, optimizers, schedulers and dataloaders, in any order and number.

        Returns them in the order given (one object alone when one was passed).
        """
        kinds = [_kind(obj, i) for i, obj in enumerate(objects)]
        placement = device_placement or [self.device_placement] * len(objects)
        result: list[Any] = list(objects)
        if self.distributed_type is DistributedType.DEEPSPEED:
            replaced, self._deepspeed, ds_config = prepare_deepspeed(
                result,
                kinds,
                config=self.config,
                world_size=self.num_processes,
                split_batches=self.split_batches,
                step_scheduler_with_optimizer=self.step_scheduler_with_optimizer,
            )
            for i, obj in replaced.items():
                result[i], kinds[i] = obj, "engine"
            # A DeepSpeed config file may set these; the engine follows it, so must we.
            self.gradients.accumulation_steps = int(ds_config["gradient_accumulation_steps"])
            mode = mixed_precision_of(ds_config, self.config.mixed_precision)
            self.precision = Precision(mode, self.device, engine_scales=True)
            self._models.append(self._deepspeed.engine)
            if self._deepspeed.optimizer is not None:  # for step_was_skipped and checkpoints
                self._optimizers.append(self._deepspeed.optimizer)
            if self._deepspeed.scheduler is not None:
                self._schedulers.append(self._deepspeed.scheduler)
        # Models first (optimizers hold their parameters), schedulers after optimizers.
        for wanted in ("model", "optimizer", "scheduler", "dataloader"):
            for i, (obj, kind) in enumerate(zip(objects, kinds, strict=True)):
                if kind == wanted:
                    result[i] = getattr(self, f"_prepare_{kind}")(obj, placement[i])
        return result[0] if len(result) == 1 else tuple(result)

    def _prepare_model(self, model: torch.nn.Module, placement: bool) -> torch.nn.Module:
        if self.is_main_process:  # for the dashboard's memory estimate
            report_model(sum(p.numel() for p in model.parameters()))
        prepared = model
        if self._xla is not None:  # replicated on the device, or FSDPv2 under SPMD
            prepared, swap = self._xla.prepare_model(model, self.precision, placement, self.config)
            self._new_params |= swap
        elif self.distributed_type is DistributedType.FSDP:
            self._new_params |= models.prepare_sharded_model(
                model, self.state, self.precision, self.config.fsdp, self.config.dynamo_backend
            )
        else:
            prepared = models.prepare_model(
                model,
                self.state,
                self.precision,
                device_placement=placement,
                dynamo_backend=self.config.dynamo_backend,
                ddp_kwargs=self.ddp_kwargs,
            )
        self._models.append(prepared)
        return prepared

    def _prepare_optimizer(self, optimizer: Any, placement: bool) -> AcceleratedOptimizer:
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        sharding.retarget_optimizer(optimizer, self._new_params)
        if self.config.shard_optimizer_state and self.use_distributed:
            original, optimizer = optimizer, sharding.zero1_optimizer(optimizer)
            self._new_optimizers[id(original)] = optimizer
        clip = self._config_clip if self.config.max_grad_norm is not None else None
        hooks = self._xla.optimizer_hooks() if self._xla is not None else {}
        wrapped = AcceleratedOptimizer(
            optimizer, self.gradients, self.precision.scaler, clip, **hooks
        )
        self._optimizers.append(wrapped)
        return wrapped

    def _prepare_scheduler(self, scheduler: Any, placement: bool) -> AcceleratedScheduler:
        inner = scheduler.optimizer
        if id(inner) in self._new_optimizers:  # ZeRO-1 replaced it: the schedule follows
            inner = scheduler.optimizer = self._new_optimizers[id(inner)]
        optimizers = [o for o in self._optimizers if inner in (o, o.optimizer)]
        steps = 1 if self.split_batches else self.num_processes
        wrapped = AcceleratedScheduler(
            scheduler, optimizers, self.gradients, steps, self.step_scheduler_with_optimizer
        )
        self._schedulers.append(wrapped)
        return wrapped

    def _prepare_dataloader(self, loader: DataLoader[Any], placement: bool) -> Any:
        plan = ShardPlan(
            rank=self.process_index,
            world_size=self.num_processes,
            seed=self._shared_seed(),
            even_batches=self.even_batches,
            split_batches=self.split_batches,
        )
        device = self.device if placement else None
        # XLA: batches move in torch_xla's background loader (MpDeviceLoader's engine).
        stream = self._xla.device_stream if self._xla is not None and placement else None
        kind = PreparedIterableLoader if is_iterable_dataset(loader) else PreparedDataLoader
        prepared = kind(loader, plan, None if stream else device, self.gradients, stream)
        self._dataloaders.append(prepared)
        return prepared

    def _shared_seed(self) -> int:
        # Drawn from the global torch RNG (so torch.manual_seed makes it reproducible) on
        # rank 0 and broadcast: every rank must shuffle the same way for disjoint shards.
        seed = torch.randint(0, 2**62, (1,))
        if self._xla is not None:
            return int(self._xla.share(int(seed.item())))
        if self.use_distributed:
            # On the device: a group the user created with nccl alone cannot carry CPU tensors.
            seed = seed.to(self.device)
            dist.broadcast(seed, src=0)
        return int(seed.item())

    # -- the step --------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled for fp16."""
        if self._deepspeed is not None:  # the engine divides, scales, clips and steps
            self._deepspeed.backward(loss, sync_gradients=self.sync_gradients, **kwargs)
            return
        if self.gradients.accumulation_steps > 1:
            loss = loss / self.gradients.accumulation_steps
        if self.precision.scaler is not None:
            loss = self.precision.scaler.scale(loss)
        loss.backward(**kwargs)  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def accumulate(self, *models_: torch.nn.Module) -> Iterator[None]:
        """One micro-step: gradients sync (and the optimizer steps) every k-th call.

        On the other calls the gradient reduction of DDP or FSDP is suspended (unless
        ``sync_each_batch``) and ``step`` /
        ``zero_grad`` of prepared optimizers do nothing. The last batch of a prepared
        dataloader always syncs, so an epoch never ends with gradients left over.
        """
        self.step += 1
        grads = self.gradients
        grads.micro_steps_in_cycle += 1
        grads.sync_gradients = (
            grads.micro_steps_in_cycle >= grads.accumulation_steps or grads.end_of_dataloader
        )
        if grads.sync_gradients:  # the next epoch (or cycle) starts a fresh count
            grads.micro_steps_in_cycle = 0
        with contextlib.ExitStack() as stack:
            if not self.gradients.sync_gradients and not self.config.sync_each_batch:
                for model in models_:
                    stack.enter_context(models.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Suspend the gradient all-reduce of a DDP model (a no-op on one process)."""
        with models.no_sync(model):
            yield

    def autocast(self, enabled: bool = True) -> contextlib.AbstractContextManager[None]:
        """Autocast for the configured precision, for code outside the model's forward."""
        return self.precision.autocast(enabled)

    # -- memory ----------------------------------------------------------------------------
    def free_memory(self, *objects: Any) -> list[None]:
        """Forget everything prepared, collect garbage and empty the CUDA cache.

        Call between two trainings in one process; returns ``None`` for each object passed,
        so ``model, opt = acc.free_memory(model, opt)`` drops the caller's references too.
        """
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self._custom.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return [None for _ in objects]


def _kind(obj: Any, index: int) -> str:
    if isinstance(obj, torch.nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, _SCHEDULER_TYPES):
        return "scheduler"
    if isinstance(obj, DataLoader):
        return "dataloader"
    raise TypeError(
        f"prepare() got {type(obj).__name__} as argument {index}; it prepares torch.nn.Module, "
        "torch.optim.Optimizer, LR schedulers and torch.utils.data.DataLoader. Wrap a "
        "Dataset in a DataLoader first; use other objects directly without prepare()."
    )
