"""Dataloaders as ``prepare`` returns them: sharded across ranks, resumable, on the device.

The dataset's index order for an epoch (a permutation seeded by ``seed + epoch`` when the
user's loader shuffled, the user's sampler order otherwise) is cut into global batches;
global batch ``j`` goes to rank ``j % world_size``. So one optimizer step over N ranks sees
the same samples as one process with an N-times batch, and a gathered last batch is
contiguous, which is what lets ``gather_for_metrics`` drop the padding. With
``even_batches`` the last batches are completed with samples from the epoch's start so that
every rank takes the same number of steps (a rank short of a batch would hang the others).

The position (epoch, batches consumed) is the loader's state: ``save_state`` stores it, and
after ``load_state`` the next iteration skips the consumed batches by index, without loading
them. Each epoch reshuffles without ``set_epoch``. ``skip_first_batches`` (in
``skip_batches``) starts the current epoch further on, once, through ``start_at``; after
``load_state`` its count replaces the restored position (code written for Accelerate calls
both, and must not skip twice).

On XLA devices a ``device_stream`` (``XlaRuntime.device_stream``) moves the batches in
torch_xla's background loader instead; the position is still counted where the training
loop takes each batch, not where the loader reads ahead.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

from nbaccel.accel.collectives import tree_map
from nbaccel.accel.optim import GradientState

# (batch, is the last, real samples of the last round) in, the same with batches on the device out
DeviceStream = Callable[[Iterator[tuple[Any, bool, int]]], Iterator[tuple[Any, bool, int]]]


@dataclass
class ShardPlan:
    """How one rank takes its share of each epoch."""

    rank: int
    world_size: int
    seed: int
    even_batches: bool = True
    split_batches: bool = False
    epoch: int = 0
    skip_batches: int = 0
    last_remainder: int = field(default=-1)


class ShardedBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches of dataset indices for ``plan.epoch``.

    >>> plan = ShardPlan(rank=1, world_size=2, seed=0)
    >>> list(ShardedBatchSampler(BatchSampler(range(10), 2, False), plan))
    [[2, 3], [6, 7], [0, 1]]
    """

    def __init__(self, source: BatchSampler | Sequence[list[int]], plan: ShardPlan) -> None:
        self.source = source
        self.plan = plan
        self._cached: tuple[tuple[int, int], tuple[list[list[int]], int]] | None = None

    def _global_batches(self) -> tuple[list[list[int]], int]:
        """Every rank's batches in order, padded; and the real samples in the last round."""
        key = (self.plan.seed, self.plan.epoch)
        if self._cached is None or self._cached[0] != key:  # len() and iter() share one plan
            self._cached = (key, self._plan_epoch())
        return self._cached[1]

    def _plan_epoch(self) -> tuple[list[list[int]], int]:
        plan = self.plan
        source = self.source
        if isinstance(source, BatchSampler) and isinstance(source.sampler, RandomSampler):
            order = _shuffled(source.sampler, plan.seed + plan.epoch)
            size = source.batch_size
            batches = [order[i : i + size] for i in range(0, len(order), size)]
            if source.drop_last and batches and len(batches[-1]) < size:
                batches.pop()
        else:
            if hasattr(source, "sampler") and hasattr(source.sampler, "set_epoch"):
                source.sampler.set_epoch(plan.epoch)
            batches = [list(b) for b in source]
        drop_last = bool(getattr(source, "drop_last", False))
        if plan.split_batches:
            return _split(batches, plan, drop_last)
        return _round_robin(batches, plan, drop_last)

    def __iter__(self) -> Iterator[list[int]]:
        batches, self.plan.last_remainder = self._global_batches()
        step = self.plan.world_size
        mine = batches[self.plan.rank :: step] if not self.plan.split_batches else batches
        yield from mine[self.plan.skip_batches :]

    def __len__(self) -> int:
        batches = self._global_batches()[0]
        if self.plan.split_batches:
            return len(batches)
        return len(range(self.plan.rank, len(batches), self.plan.world_size))


def _shuffled(sampler: RandomSampler, seed: int) -> list[int]:
    """The user's RandomSampler's draw, seeded so that every rank draws the same order."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    if not sampler.replacement and sampler._num_samples is None:
        return torch.randperm(len(sampler.data_source), generator=generator).tolist()
    same_kind = RandomSampler(
        sampler.data_source,
        replacement=sampler.replacement,
        num_samples=sampler._num_samples,
        generator=generator,
    )
    return list(same_kind)


def _round_robin(
    batches: list[list[int]], plan: ShardPlan, drop_last: bool
) -> tuple[list[list[int]], int]:
    """Global batches for rank-by-rank dealing, the last round completed; its real samples."""
    world = plan.world_size
    if world == 1:  # one process: the user's batches as they are, no padding to even out
        return batches, -1
    if drop_last:
        return batches[: len(batches) // world * world], -1
    if not plan.even_batches or not batches:
        return batches, -1
    # The user's batches stay as they are. A short last batch is completed with samples
    # from the epoch's start, then the last round with the epoch's first batches, so that
    # the duplicates sit at the end of the gathered last round.
    out = [list(b) for b in batches]
    full = len(out[0])
    if len(out[-1]) < full:
        flat = itertools.cycle(i for b in batches for i in b)
        out[-1] += list(itertools.islice(flat, full - len(out[-1])))
    filler = 0
    while len(out) % world:
        out.append(list(out[filler]))
        filler += 1
    last_round = len(out) - world
    return out, sum(len(b) for b in batches[last_round:])


def _split(
    batches: list[list[int]], plan: ShardPlan, drop_last: bool
) -> tuple[list[list[int]], int]:
    """Each rank's slice of every batch (``split_batches=True``)."""
    world = plan.world_size
    out: list[list[int]] = []
    remainder = -1
    for number, batch in enumerate(batches):
        if len(batch) % world:
            if number < len(batches) - 1:
                raise ValueError(
                    f"split_batches=True splits each batch over the {world} processes, but a "
                    f"batch has {len(batch)} samples, not a multiple of {world}. Use a batch "
                    f"size that is a multiple of {world}, or split_batches=False."
                )
            if drop_last:
                continue
            remainder = len(batch)  # the last batch: completed with its own first samples
            batch = (batch * world)[: math.ceil(len(batch) / world) * world]
        chunk = len(batch) // world
        out.append(batch[plan.rank * chunk : (plan.rank + 1) * chunk])
    return out, remainder


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
    ) -> None:
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
        if self._resuming:
            self._resuming = False
        else:
            if self._started:
                self.plan.epoch += 1
            self.batches_consumed = 0
        self._started = True
        self.plan.skip_batches = self.batches_consumed
        total = len(self)
        batches = super().__iter__()
        # last_remainder is read per batch: the sampler sets it when iteration starts.
        numbered = enumerate(batches, start=self.batches_consumed + 1)
        yield from _hand_out(self, ((b, n >= total, self.plan.last_remainder) for n, b in numbered))

    def state_dict(self) -> dict[str, int]:
        """The position: epoch, batches consumed in it, and the shuffling seed."""
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
    ) -> None:
        self.original = loader
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size
        self.plan = plan
        self.device = device
        self.device_stream = device_stream
        self.gradients = gradients
        self.batches_consumed = 0
        self._resuming = False

    def __iter__(self) -> Iterator[Any]:
        world, rank = self.plan.world_size, self.plan.rank
        # A new pass starts at the beginning; only the pass after load_state skips.
        skip = self.batches_consumed if self._resuming else 0
        self._resuming = False
        self.batches_consumed = skip
        yield from _hand_out(self, itertools.islice(_mine(self.original, world, rank), skip, None))

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
    the loader's position and the gradient state (end of dataloader, remainder) current."""
    gradients = loader.gradients
    gradients.end_of_dataloader, gradients.remainder = False, -1
    if loader.device_stream is not None:
        batches = loader.device_stream(batches)
    for batch, last, remainder in batches:
        loader.batches_consumed += 1
        gradients.end_of_dataloader = last
        gradients.remainder = remainder if last else -1
        yield batch if loader.device is None else send_to_device(batch, loader.device)
    gradients.end_of_dataloader, gradients.remainder = False, -1


def _mine(loader: DataLoader[Any], world: int, rank: int) -> Iterator[tuple[Any, bool, int]]:
    """This rank's batch of each round, whether it is the last, the last round's real size."""
    rounds = _rounds(iter(loader), world)
    current = next(rounds, None)
    while current is not None:
        batches, real = current
        current = next(rounds, None)
        yield batches[rank], current is None, real


def _rounds(batches: Iterator[Any], world: int) -> Iterator[tuple[list[Any], int]]:
    while True:
        round_ = list(itertools.islice(batches, world))
        if not round_:
            return
        real = sum(_batch_len(b) for b in round_)
        padded = round_ + [round_[0]] * (world - len(round_))
        yield padded, (real if len(round_) < world else -1)


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, dict):
        return _batch_len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return _batch_len(batch[0])
    return 1


def send_to_device(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in nested lists, tuples, namedtuples and dicts to ``device``.

    >>> send_to_device({"x": [torch.ones(1)]}, torch.device("cpu"))["x"][0].device
    device(type='cpu')
    """

    def other(leaf: Any) -> Any:  # e.g. transformers' BatchEncoding has its own .to()
        return leaf.to(device) if callable(getattr(leaf, "to", None)) else leaf

    return tree_map(lambda t: t.to(device, non_blocking=non_blocking), data, other)


def is_iterable_dataset(loader: DataLoader[Any]) -> bool:
    return isinstance(loader.dataset, IterableDataset)
