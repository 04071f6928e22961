"""``Prepared``: what ``Accelerator.prepare`` made, and how it made it.

Models first (optimizers hold their parameters), then optimizers, schedulers and loaders.
The strategy does everything backend-specific (wrapping, sharding, an engine); this part
keeps the bookkeeping that is the same for all: which parameters and optimizers were
replaced, so later optimizers and schedulers follow the replacements, and the lists that
checkpoints, clipping and ``free_memory`` walk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from nbaccel.accel import sharding
from nbaccel.accel.data import (
    PreparedDataLoader,
    PreparedIterableLoader,
    ShardPlan,
    is_iterable_dataset,
)
from nbaccel.accel.optim import AcceleratedOptimizer, AcceleratedScheduler, GradientState
from nbaccel.accel.precision import Precision
from nbaccel.accel.strategies import Strategy
from nbaccel.metrics import report_model

_SCHEDULER_TYPES: tuple[type, ...] = (
    torch.optim.lr_scheduler.LRScheduler,
    torch.optim.lr_scheduler.ReduceLROnPlateau,
)
Loader = PreparedDataLoader | PreparedIterableLoader


class Prepared:
    """The prepared objects of one Accelerator, in the order they were prepared."""

    def __init__(
        self,
        strategy: Strategy,
        precision: Precision,
        gradients: GradientState,
        *,
        split_batches: bool,
        even_batches: bool,
        step_scheduler_with_optimizer: bool,
        ddp_kwargs: dict[str, Any],
        clip: Any = None,
    ) -> None:
        self.strategy = strategy
        self.precision = precision  # DeepSpeed's config may change it at prepare()
        self.gradients = gradients
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.ddp_kwargs = ddp_kwargs
        self.clip = clip  # the config's max_grad_norm, applied in each optimizer step
        self.models: list[torch.nn.Module] = []
        self.optimizers: list[AcceleratedOptimizer] = []
        self.schedulers: list[AcceleratedScheduler] = []
        self.dataloaders: list[Loader] = []
        self.custom: list[Any] = []  # register_for_checkpointing
        # What prepare() replaced, by id of the original: FSDP's sharded parameters and
        # ZeRO-1's optimizer, so later optimizers and schedulers follow the replacements.
        self._new_params: dict[int, torch.nn.Parameter] = {}
        self._new_optimizers: dict[int, torch.optim.Optimizer] = {}

    def prepare(self, objects: tuple[Any, ...], placement: list[bool]) -> list[Any]:
        kinds = [kind_of(obj, i) for i, obj in enumerate(objects)]
        result: list[Any] = list(objects)
        replaced = self.strategy.prepare_engine(
            result,
            kinds,
            split_batches=self.split_batches,
            step_scheduler_with_optimizer=self.step_scheduler_with_optimizer,
        )
        if replaced:  # an engine (DeepSpeed) took the model, optimizer and scheduler
            self._adopt_engine(replaced, result, kinds)
        for wanted in ("model", "optimizer", "scheduler", "dataloader"):
            for i, kind in enumerate(kinds):
                if kind == wanted:
                    result[i] = getattr(self, kind)(objects[i], placement[i])
        return result

    def _adopt_engine(self, replaced: dict[int, Any], result: list[Any], kinds: list[str]) -> None:
        strategy: Any = self.strategy
        for i, obj in replaced.items():
            result[i], kinds[i] = obj, "engine"
        if strategy.accumulation_steps is not None:  # a DeepSpeed config file may set them
            self.gradients.accumulation_steps = strategy.accumulation_steps
        self.precision = strategy.make_precision(
            self.precision.mode, autocast_kwargs=self.precision.autocast_kwargs
        )
        self.models.append(strategy.engine)
        if strategy.run.optimizer is not None:  # for step_was_skipped and checkpoints
            self.optimizers.append(strategy.run.optimizer)
        if strategy.run.scheduler is not None:
            self.schedulers.append(strategy.run.scheduler)

    def model(
        self, model: torch.nn.Module, placement: bool, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        if self.strategy.state.is_main_process:  # for the dashboard's memory estimate
            report_model(sum(p.numel() for p in model.parameters()))
        # Evaluation only: placed, autocast and compiled as on one device; never wrapped.
        strategy = Strategy(self.strategy.state, self.strategy.config) if evaluation_mode else None
        prepared, swap = (strategy or self.strategy).prepare_model(
            model, self.precision, device_placement=placement, ddp_kwargs=self.ddp_kwargs
        )
        self._new_params |= swap
        self.models.append(prepared)
        return prepared

    def optimizer(self, optimizer: Any, placement: bool) -> AcceleratedOptimizer:
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        sharding.retarget_optimizer(optimizer, self._new_params)
        replacement = self.strategy.prepare_optimizer(optimizer)
        if replacement is not optimizer:  # ZeRO-1: schedulers must follow the new one
            self._new_optimizers[id(optimizer)] = replacement
        wrapped = AcceleratedOptimizer(
            replacement,
            self.gradients,
            self.precision.scaler,
            self.clip,
            **self.strategy.optimizer_hooks(),
        )
        self.optimizers.append(wrapped)
        return wrapped

    def scheduler(self, scheduler: Any, placement: bool) -> AcceleratedScheduler:
        inner = scheduler.optimizer
        if id(inner) in self._new_optimizers:  # ZeRO-1 replaced it: the schedule follows
            inner = scheduler.optimizer = self._new_optimizers[id(inner)]
        optimizers = [o for o in self.optimizers if inner in (o, o.optimizer)]
        steps = 1 if self.split_batches else self.strategy.state.world_size
        wrapped = AcceleratedScheduler(
            scheduler, optimizers, self.gradients, steps, self.step_scheduler_with_optimizer
        )
        self.schedulers.append(wrapped)
        return wrapped

    def dataloader(self, loader: DataLoader[Any], placement: bool) -> Loader:
        state = self.strategy.state
        plan = ShardPlan(
            rank=state.rank,
            world_size=state.world_size,
            seed=self._shared_seed(),
            even_batches=self.even_batches,
            split_batches=self.split_batches,
        )
        device = state.device if placement else None
        # XLA: batches move in torch_xla's background loader (MpDeviceLoader's engine).
        stream = self.strategy.device_stream() if placement else None
        kind = PreparedIterableLoader if is_iterable_dataset(loader) else PreparedDataLoader
        prepared = kind(loader, plan, None if stream else device, self.gradients, stream)
        self.dataloaders.append(prepared)
        return prepared

    def _shared_seed(self) -> int:
        # Drawn from the global torch RNG (so torch.manual_seed makes it reproducible) on
        # rank 0 and shared: every rank must shuffle the same way for disjoint shards.
        return self.strategy.share(int(torch.randint(0, 2**62, (1,)).item()))

    def forget(self) -> None:
        """Drop every reference to what was prepared (``free_memory``)."""
        for prepared in (self.models, self.optimizers, self.schedulers, self.dataloaders):
            prepared.clear()
        self.custom.clear()
        self._new_params.clear()
        self._new_optimizers.clear()


def kind_of(obj: Any, index: int) -> str:
    """Which of prepare()'s four kinds ``obj`` is; TypeError naming what is accepted."""
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
