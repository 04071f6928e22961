"""``Prepared``: what ``Accelerator.prepare`` made, and how it made it.

Models first (optimizers hold their parameters), then optimizers, schedulers and loaders.
The strategy does everything backend-specific (wrapping, sharding, an engine); this part
keeps the bookkeeping that is the same for all: which parameters and optimizers were
replaced, so later optimizers and schedulers follow the replacements, and the lists that
checkpoints, clipping and ``free_memory`` walk.

Dataloaders follow the Accelerator's ``DataLoaderConfiguration`` and ``rng_types``
(``self.strategy.options``). The shuffling seed: ``data_seed`` when given; with
``use_seedable_sampler`` and no ``data_seed``, rank 0's ``torch.initial_seed()`` (the seed
``set_seed`` set), which makes each epoch's order Accelerate's ``SeedableRandomSampler``
order (``seed + epoch``); otherwise, over several processes, one draw from the global torch
RNG on rank 0 seeds a generator whose draws go on across epochs (Accelerate's default), and
on one process each epoch draws its seed as it starts (an untouched DataLoader's order).
Loaders that do not shuffle draw nothing. Each way is the same on every rank and after a
resume (the carried generator is replayed, the per-epoch seed is saved).
``use_stateful_dataloader`` is accepted: prepared loaders always save their position
(``state_dict``/``load_state_dict``, as torchdata's ``StatefulDataLoader``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from nbaccel.accel.data import rng_sync
from nbaccel.accel.data.loaders import (
    PreparedDataLoader,
    PreparedIterableLoader,
    ShardPlan,
    is_iterable_dataset,
)
from nbaccel.accel.optim import AcceleratedOptimizer, AcceleratedScheduler, GradientState
from nbaccel.accel.precision import Precision
from nbaccel.accel.state import DistributedType
from nbaccel.accel.strategies import Strategy, sharding
from nbaccel.config.deepspeed.placeholders import DummyOptim, DummyScheduler
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
        gradients.sync_with_dataloader = strategy.options.sync_with_dataloader
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
        # The Accelerator's AutoSave.boundary, called by prepared loaders between batches.
        self.boundary: Callable[[bool], None] | None = None

    def _at_boundary(self, starting: bool) -> None:
        if self.boundary is not None:
            self.boundary(starting)

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
        strategy = (
            Strategy(self.strategy.state, self.strategy.config, self.strategy.options)
            if evaluation_mode
            else None
        )
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
            timer=self.strategy.step_timer,
        )
        wrapped.counts_steps = not self.optimizers
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
        settings = self.strategy.options.dataloader
        seed, order = self._seed(loader)
        plan = ShardPlan(
            rank=state.rank,
            world_size=state.world_size,
            seed=seed,
            even_batches=self.even_batches,
            split_batches=self.split_batches,
            order=order,
        )
        device = state.device if placement else None
        # XLA: batches move in torch_xla's background loader (MpDeviceLoader's engine).
        stream = self.strategy.device_stream() if placement else None
        kind = PreparedIterableLoader if is_iterable_dataset(loader) else PreparedDataLoader
        prepared = kind(
            loader,
            plan,
            None if stream else device,
            self.gradients,
            stream,
            non_blocking=settings.non_blocking,
            dispatch=self._dispatches(bool(settings.dispatch_batches)),
            before_iteration=self._rng_synchronisation(),
            timer=self.strategy.step_timer,
            at_boundary=self._at_boundary,
            counts_epochs=not self.dataloaders,  # the first prepared loader is the training one
        )
        self.dataloaders.append(prepared)
        return prepared

    def _seed(self, loader: DataLoader[Any]) -> tuple[int, str]:
        """The shuffling seed, the same on every rank, and how epochs follow from it
        (``ShardPlan.order``), as Accelerate 1.15's ``prepare_data_loader`` does."""
        settings = self.strategy.options.dataloader
        if settings.data_seed is not None:
            return int(settings.data_seed), "epoch"
        if settings.use_seedable_sampler:
            return _unsigned(self.strategy.share(_signed(torch.initial_seed()))), "epoch"
        sampler = getattr(loader, "sampler", None)
        if not isinstance(sampler, RandomSampler):
            return 0, "epoch"  # no shuffling: the global RNG is left alone, as Accelerate does
        if self.strategy.state.world_size == 1:
            return 0, "pass"  # drawn as each epoch starts, as an untouched DataLoader does
        # One draw from the global torch RNG (what Accelerate seeds the sampler's generator
        # with), rank 0's shared: every rank must shuffle alike for disjoint shards.
        if sampler.generator is not None:
            drawn = int(torch.empty((), dtype=torch.int64).random_(generator=sampler.generator))
        else:
            drawn = int(torch.empty((), dtype=torch.int64).random_().item())
        return self.strategy.share(drawn), "carry"

    def _dispatches(self, wanted: bool) -> bool:
        state = self.strategy.state
        if wanted and state.distributed_type is DistributedType.XLA:
            raise NotImplementedError(
                "dispatch_batches=True sends batches from rank 0 as pickled objects over the "
                "default process group, which torch_xla's replicas do not carry. Leave "
                "dispatch_batches unset on TPUs: each replica reads its own shard."
            )
        return wanted and state.use_distributed  # one process reads everything anyway

    def _rng_synchronisation(self) -> Callable[[], None] | None:
        """What a pass over a prepared loader calls first: ``rng_types``' synchronisation."""
        chosen = rng_sync.rngs_to_synchronize(
            self.strategy.options.rng_types, self.strategy.state.device
        )
        if not chosen or not self.strategy.state.use_distributed:
            return None
        return functools.partial(rng_sync.synchronize_rngs, chosen, self.strategy)

    def forget(self) -> None:
        """Drop every reference to what was prepared (``free_memory``)."""
        for prepared in (self.models, self.optimizers, self.schedulers, self.dataloaders):
            prepared.clear()
        self.custom.clear()
        self._new_params.clear()
        self._new_optimizers.clear()


def kind_of(obj: Any, index: int) -> str:
    """Which of prepare()'s four kinds ``obj`` is; TypeError naming what is accepted."""
    if isinstance(obj, (DummyOptim, DummyScheduler)):
        raise NotImplementedError(
            f"prepare() got a {type(obj).__name__}: the placeholder for an optimizer or "
            "scheduler that a DeepSpeed config defines. nbaccel does not build those from the "
            "config yet; create the torch optimizer (and scheduler) yourself and prepare them."
        )
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


def _signed(seed: int) -> int:
    """A 64-bit seed as the signed integer a tensor can carry; ``_unsigned`` undoes it.

    >>> _unsigned(_signed(2**64 - 1)), _unsigned(_signed(42))
    (18446744073709551615, 42)
    """
    return seed - 2**64 if seed >= 2**63 else seed


def _unsigned(value: int) -> int:
    return value + 2**64 if value < 0 else value
