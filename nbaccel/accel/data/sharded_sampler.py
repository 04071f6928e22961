"""Which dataset indices each rank takes in an epoch: ``ShardPlan`` and ``ShardedBatchSampler``.

Split from ``data`` (the prepared loaders) to keep modules small. The dataset's index order
for an epoch (a permutation seeded by ``seed + epoch`` when the user's loader shuffled, the
user's sampler order otherwise) is cut into global batches; global batch ``j`` goes to rank
``j % world_size``, or with ``split_batches`` every batch is cut into one slice per rank.
With ``even_batches`` the last batches are completed with samples from the epoch's start so
that every rank takes the same number of steps. The plan is a pure function of the
``ShardPlan`` and the user's sampler, so every rank computes every rank's share alike
(``rounds``: what ``dispatch_batches`` sends).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler

__all__ = ["ShardPlan", "ShardedBatchSampler"]

# An epoch's global batches, and the real samples in its last round (-1: none padded).
_EpochPlan = tuple[list[list[int]], int]


@dataclass
class ShardPlan:
    """How one rank takes its share of each epoch."""

    rank: int
    world_size: int
    seed: int
    even_batches: bool = True
    # How each epoch's order follows from the seed (the user's loader shuffles):
    #   "epoch": a generator seeded ``seed + epoch`` (Accelerate's SeedableRandomSampler);
    #   "carry": one generator seeded ``seed`` whose draws go on from epoch to epoch
    #            (Accelerate's default over several processes; replayed to resume);
    #   "pass":  ``seed`` is drawn anew from the global RNG as each epoch starts (what an
    #            untouched DataLoader does; Accelerate's one-process case).
    order: str = "epoch"
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
        self._cached: tuple[tuple[int, int, bool, bool, str], _EpochPlan] | None = None

    def _global_batches(self) -> _EpochPlan:
        """Every rank's batches in order, padded (with ``split_batches``: the whole batches,
        each a multiple of the world size); and the real samples in the last round."""
        plan = self.plan
        # len() and iter() share one plan; join_uneven_inputs may change even_batches between.
        key = (plan.seed, plan.epoch, plan.even_batches, plan.split_batches, plan.order)
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, self._plan_epoch())
        return self._cached[1]

    def rank_batches(self) -> list[list[int]]:
        """This rank's batches of the epoch, from the first."""
        batches = self._global_batches()[0]
        rank, world = self.plan.rank, self.plan.world_size
        if self.plan.split_batches:
            return [_slice(batch, rank, world) for batch in batches]
        return batches[rank::world]

    def rounds(self) -> list[list[list[int] | None]]:
        """The epoch round by round: each rank's batch, None where a rank has none left
        (``even_batches=False``); what ``dispatch_batches`` sends."""
        batches = self._global_batches()[0]
        world = self.plan.world_size
        if self.plan.split_batches:
            return [[_slice(batch, r, world) for r in range(world)] for batch in batches]
        padded: list[list[int] | None] = [*batches]
        padded += [None] * (-len(batches) % world)
        return [padded[i : i + world] for i in range(0, len(padded), world)]

    def _plan_epoch(self) -> tuple[list[list[int]], int]:
        plan = self.plan
        source = self.source
        if isinstance(source, BatchSampler) and isinstance(source.sampler, RandomSampler):
            if plan.order == "carry":
                order = _shuffled(source.sampler, plan.seed, draws=plan.epoch + 1)
            elif plan.order == "pass":
                order = _shuffled(source.sampler, plan.seed)
            else:
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
        self.plan.last_remainder = self._global_batches()[1]
        yield from self.rank_batches()[self.plan.skip_batches :]

    def __len__(self) -> int:
        batches = self._global_batches()[0]
        if self.plan.split_batches:
            return len(batches)
        return len(range(self.plan.rank, len(batches), self.plan.world_size))


def _shuffled(sampler: RandomSampler, seed: int, draws: int = 1) -> list[int]:
    """The user's RandomSampler's order from a generator seeded ``seed``: its ``draws``-th
    pass (torch's own sampler drains the generator as a real epoch does, so the later passes
    equal a loader that kept one generator across epochs)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    same_kind = RandomSampler(
        sampler.data_source,
        replacement=sampler.replacement,
        num_samples=sampler._num_samples,
        generator=generator,
    )
    order: list[int] = []
    for _ in range(draws):
        order = list(same_kind)
    return order


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
    """Whole batches, each a multiple of the world size, for ranks to slice
    (``split_batches=True``)."""
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
        out.append(batch)
    return out, remainder


def _slice(batch: list[int], rank: int, world: int) -> list[int]:
    chunk = len(batch) // world
    return batch[rank * chunk : (rank + 1) * chunk]
