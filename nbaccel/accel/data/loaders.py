"""Dataloaders as ``prepare`` returns them: sharded across ranks, resumable, on the device.

Which indices each rank takes is ``sharded_sampler``'s: global batch ``j`` goes to rank
``j % world_size``. So one optimizer step over N ranks sees the same samples as one process
with an N-times batch, and a gathered last batch is contiguous, which is what lets
``gather_for_metrics`` drop the padding. With ``even_batches`` every rank takes the same
number of steps (a rank short of a batch would hang the others). An ``IterableDataset`` has
no indices: every rank reads the stream and keeps its share of each round.

The position (epoch, batches consumed) is the loader's state: ``save_state`` stores it, and
after ``load_state`` the next iteration skips the consumed batches by index, without loading
them. Each epoch reshuffles without ``set_epoch``. ``skip_first_batches`` (in
``skip_batches``) starts the current epoch further on, once, through ``start_at``; after
``load_state`` its count replaces the restored position (code written for Accelerate calls
both, and must not skip twice).

On XLA devices a ``device_stream`` (``XlaRuntime.device_stream``) moves the batches in
torch_xla's background loader instead; the position is still counted where the training
loop takes each batch, not where the loader reads ahead.

Accelerate's ``DataLoaderConfiguration`` reaches the loaders as ``prepare`` resolves it:
``non_blocking`` (copies to the device), ``dispatch`` (``dispatch_batches``: rank 0 reads,
see ``dispatch``), and ``before_iteration``, which each pass calls first (the
synchronisation of ``rng_types``, as Accelerate does at the start of every pass).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from nbaccel.accel.data import dispatch
from nbaccel.accel.data.sharded_sampler import ShardedBatchSampler, ShardPlan
from nbaccel.accel.nested.batches import batch_len, send_to_device, split_batch
from nbaccel.accel.optim import GradientState
from nbaccel.accel.tracking.step_timing import StepTimer, disabled_timer

__all__ = [
    "PreparedDataLoader",
    "PreparedIterableLoader",
    "ShardPlan",
    "ShardedBatchSampler",
    "is_iterable_dataset",
    "send_to_device",
]

# (batch, is the last, real samples of the last round) in, the same with batches on the device out
DeviceStream = Callable[[Iterator[tuple[Any, bool, int]]], Iterator[tuple[Any, bool, int]]]


class PreparedDataLoader(DataLoader[Any]):
    """A DataLoader over this rank's shard that moves batches to the device.

    Built from the user's loader with the same dataset, collate function, workers and
    pinning; its own ``generator`` keeps iteration from drawing on the global torch RNG,
    so a resumed run's random stream matches an uninterrupted one.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        plan: ShardPlan,
        device: torch.device | None,
        gradients: GradientState,
        device_stream: DeviceStream | None = None,
        *,
        non_blocking: bool = False,
        dispatch: bool = False,
        before_iteration: Callable[[], None] | None = None,
        timer: StepTimer | None = None,
        at_boundary: Callable[[bool], None] | None = None,
        counts_epochs: bool = False,
    ) -> None:
        self.timer = timer if timer is not None else disabled_timer()  # the step breakdown
        self.at_boundary, self.counts_epochs = at_boundary, counts_epochs
        source: Any = loader.batch_sampler
        if source is None:
            raise TypeError(
                "prepare() got a DataLoader with batch_size=None (it yields single samples). "
                "nbaccel shards batches; give the DataLoader a batch_size."
            )
        self.plan = plan
        self.gradients = gradients
        self.device = device
        self.device_stream = device_stream
        self.non_blocking = non_blocking
        self.dispatch = dispatch
        self.before_iteration = before_iteration
        self.original = loader
        generator = torch.Generator()
        generator.manual_seed(plan.seed)
        super().__init__(
            loader.dataset,
            batch_sampler=ShardedBatchSampler(source, plan),
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            generator=generator,
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
        )
        # Report the user's per-rank batch size, not DataLoader's None for batch_sampler
        # loaders (DataLoader guards these attributes against assignment after __init__).
        per_rank = loader.batch_size
        if per_rank is not None and plan.split_batches:
            per_rank //= plan.world_size
        object.__setattr__(self, "batch_size", per_rank)
        object.__setattr__(self, "drop_last", loader.drop_last)
        if plan.split_batches:
            len(self)  # batch sizes that cannot be split fail here, in prepare()
        self.batches_consumed = 0
        self._started = False
        self._resuming = False
        self._drawn_epoch: int | None = None  # the epoch whose start drew from the RNG

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step over all ranks."""
        return None if self.batch_size is None else self.batch_size * self.plan.world_size

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order for the next iteration (optional: epochs advance by themselves)."""
        self.plan.epoch = epoch
        self._started = False

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.at_boundary is not None:
            self.at_boundary(True)  # a resume is restored before the pass reads its position
        self.timer.begin_data(self)  # the first batch's wait includes starting the pass
        if self.before_iteration is not None:
            self.before_iteration()
        if self._resuming:
            self._resuming = False
        else:
            if self._started:
                self.plan.epoch += 1
            self.batches_consumed = 0
        self._started = True
        if self._drawn_epoch != self.plan.epoch:
            self._draw_as_a_dataloader_does()
            self._drawn_epoch = self.plan.epoch
        self.plan.skip_batches = self.batches_consumed
        total = len(self)
        batches = self._dispatched() if self.dispatch else super().__iter__()
        # last_remainder is read per batch: the sampler sets it when iteration starts.
        numbered = enumerate(batches, start=self.batches_consumed + 1)
        yield from _hand_out(self, ((b, n >= total, self.plan.last_remainder) for n, b in numbered))

    def _draw_as_a_dataloader_does(self) -> None:
        # An epoch of torch's DataLoader draws its workers' base seed from the loader's
        # generator (the global RNG when it has none), and an unseeded RandomSampler then
        # draws its own seed: Accelerate's loaders do, so the same dropout masks and orders
        # follow only if nbaccel's do too. Once per epoch: a pass resumed mid-epoch from a
        # checkpoint drew before it was saved (load_state restores the RNG after the draws).
        torch.empty((), dtype=torch.int64).random_(generator=self.original.generator)
        if self.plan.order == "pass":
            self.plan.seed = int(torch.empty((), dtype=torch.int64).random_().item())

    def _dispatched(self) -> Iterator[Any]:
        """This rank's batches, loaded on rank 0 with this loader's collation and workers."""
        sampler: ShardedBatchSampler = self.batch_sampler  # type: ignore[assignment]
        self.plan.last_remainder = sampler._global_batches()[1]
        rounds = sampler.rounds()[self.plan.skip_batches :]

        def load(batches: list[list[int]]) -> DataLoader[Any]:
            return DataLoader(
                self.dataset,
                batch_sampler=batches,
                num_workers=self.num_workers,
                collate_fn=self.collate_fn,
                pin_memory=self.pin_memory,
                timeout=self.timeout,
                worker_init_fn=self.worker_init_fn,
                multiprocessing_context=self.multiprocessing_context,
                generator=self.generator,
                prefetch_factor=self.prefetch_factor,
            )

        return dispatch.dispatched_indexed(rounds, self.plan.rank, load)

    def state_dict(self) -> dict[str, int]:
        """The position: epoch, batches consumed in it, and the shuffling seed (what
        torchdata's ``StatefulDataLoader`` users call; ``load_state_dict`` resumes)."""
        return {
            "epoch": self.plan.epoch,
            "batches_consumed": self.batches_consumed,
            "seed": self.plan.seed,
        }

    def load_state_dict(self, state: dict[str, int], saved_world_size: int | None = None) -> None:
        """Continue from a saved position at the next iteration.

        Saved by a run with a different number of processes, the position is converted
        through the global batch count (each rank's batch ``k`` is global batch ``k * N + r``).
        """
        self.plan.seed = int(state["seed"])
        self.plan.epoch = int(state["epoch"])
        self.batches_consumed = _converted(state, saved_world_size, self.plan)
        if self.batches_consumed >= len(self):  # saved at the end of an epoch
            self.plan.epoch += 1
            self.batches_consumed = 0
        # Mid-epoch, the epoch's draws happened before the save; at a boundary, not yet.
        self._drawn_epoch = self.plan.epoch if self.batches_consumed else None
        self._resuming = True
        self._started = True

    def start_at(self, batches: int) -> None:
        """Let the next iteration take the current epoch from batch ``batches`` on.

        The current epoch is the restored one after ``load_state`` (whose position
        ``batches`` replaces), else the one the next iteration would start.
        """
        if self._started and not self._resuming:
            self.plan.epoch += 1  # the pass that began is over: the next epoch is current
        self.batches_consumed = batches
        self._resuming = self._started = True


class PreparedIterableLoader:
    """An IterableDataset loader: rank r keeps the user's batches ``j`` with ``j % N == r``.

    Every rank reads the whole stream (an iterable has no indices to split). A last
    incomplete round is completed with that round's first batch so every rank steps equally,
    and ``gather_for_metrics`` drops it again.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        plan: ShardPlan,
        device: torch.device | None,
        gradients: GradientState,
        device_stream: DeviceStream | None = None,
        *,
        non_blocking: bool = False,
        dispatch: bool = False,
        before_iteration: Callable[[], None] | None = None,
        timer: StepTimer | None = None,
        at_boundary: Callable[[bool], None] | None = None,
        counts_epochs: bool = False,
    ) -> None:
        self.timer = timer if timer is not None else disabled_timer()  # the step breakdown
        self.at_boundary, self.counts_epochs = at_boundary, counts_epochs
        self.original = loader
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size
        if self.batch_size is not None and plan.split_batches:
            self.batch_size //= plan.world_size
        self.plan = plan
        self.device = device
        self.device_stream = device_stream
        self.non_blocking = non_blocking
        self.dispatch = dispatch
        self.before_iteration = before_iteration
        self.gradients = gradients
        self.batches_consumed = 0
        self._resuming = False

    def __iter__(self) -> Iterator[Any]:
        if self.at_boundary is not None:
            self.at_boundary(True)
        self.timer.begin_data(self)
        if self.before_iteration is not None:
            self.before_iteration()
        world, rank = self.plan.world_size, self.plan.rank
        # A new pass starts at the beginning; only the pass after load_state skips.
        skip = self.batches_consumed if self._resuming else 0
        self._resuming = False
        self.batches_consumed = skip
        if self.dispatch:  # only rank 0 reads the stream
            read = _stream_rounds(self.original, world, self.plan.split_batches)
            mine = dispatch.dispatched_stream(read if rank == 0 else None, rank, world)
        else:
            rounds = _stream_rounds(self.original, world, self.plan.split_batches)
            mine = ((batches[rank], last, real) for batches, last, real in rounds)
        yield from _hand_out(self, itertools.islice(mine, skip, None))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "batches_consumed": self.batches_consumed, "seed": self.plan.seed}

    def load_state_dict(self, state: dict[str, int], saved_world_size: int | None = None) -> None:
        self.batches_consumed = _converted(state, saved_world_size, self.plan)
        self._resuming = True

    def start_at(self, batches: int) -> None:
        """Let the next pass skip its first ``batches`` batches (they are still read)."""
        self.batches_consumed = batches
        self._resuming = True


def _converted(state: dict[str, int], saved_world_size: int | None, plan: ShardPlan) -> int:
    consumed = int(state["batches_consumed"])
    if saved_world_size is None or plan.split_batches or saved_world_size == plan.world_size:
        return consumed  # with split_batches every rank counts global batches already
    return consumed * saved_world_size // plan.world_size


def _hand_out(
    loader: PreparedDataLoader | PreparedIterableLoader,
    batches: Iterator[tuple[Any, bool, int]],
) -> Iterator[Any]:
    """Yield each (batch, is last, real samples of the last round) on the device, keeping
    the loader's position and the gradient state (end of dataloader, remainder) current,
    and marking the data phase of the step breakdown (from the request to the hand-out)."""
    gradients, timer = loader.gradients, loader.timer
    gradients.end_of_dataloader, gradients.remainder = False, -1
    if loader.device_stream is not None:
        batches = loader.device_stream(batches)
    try:
        for batch, last, remainder in batches:
            loader.batches_consumed += 1
            gradients.end_of_dataloader = last
            gradients.remainder = remainder if last else -1
            if loader.device is not None:
                batch = send_to_device(batch, loader.device, loader.non_blocking)
            timer.end_data(batch)
            yield batch
            # The loop asks for its next batch: the iteration before is over. A last batch
            # ends the pass now, so a save here resumes at the next epoch, counted.
            if last and loader.counts_epochs:
                gradients.completed_epochs += 1
            if loader.at_boundary is not None:
                loader.at_boundary(False)
            timer.begin_data(loader)
    finally:  # exhausted, or the loop left early (break, an exception)
        timer.loop_ended(loader)
    gradients.end_of_dataloader, gradients.remainder = False, -1


def _stream_rounds(
    loader: DataLoader[Any], world: int, split_batches: bool
) -> Iterator[dispatch.StreamRound]:
    """The stream round by round: each rank's batch, whether the round is the last, and the
    last round's real samples. A round is ``world`` batches (rank ``r`` the ``r``-th; a last
    incomplete round completed with its first batch), or with ``split_batches`` one batch
    cut into ``world`` slices."""
    if split_batches:
        rounds: Iterator[tuple[list[Any], int]] = (([batch], -1) for batch in loader)
    else:
        rounds = _rounds(iter(loader), world)
    current = next(rounds, None)
    while current is not None:
        batches, real = current
        current = next(rounds, None)
        last = current is None
        if split_batches:
            size = batch_len(batches[0])
            real = size if last and size % world else -1
            batches = split_batch(batches[0], world, last=last)
        yield batches, last, real


def _rounds(batches: Iterator[Any], world: int) -> Iterator[tuple[list[Any], int]]:
    while True:
        round_ = list(itertools.islice(batches, world))
        if not round_:
            return
        real = sum(batch_len(b) for b in round_)
        padded = round_ + [round_[0]] * (world - len(round_))
        yield padded, (real if len(round_) < world else -1)


def is_iterable_dataset(loader: DataLoader[Any]) -> bool:
    return isinstance(loader.dataset, IterableDataset)
