"""``dispatch_batches=True``: rank 0 reads every batch and sends each rank its own.

For data only rank 0 can read, or a stream that cannot be read N times. Each rank gets
exactly the batches sharding would have given it (round by round: rank ``r`` takes the
``r``-th batch of each round, or the ``r``-th slice of each batch with ``split_batches``),
so the numbers do not change; only where loading happens does. Batches travel with
``scatter_object_list`` (pickled, over the default group), one round at a time.

Map-style datasets: every rank still computes the epoch's plan (indices only, cheap), so
each knows its own length and last batch; rank 0 loads the rounds' batches with the
loader's collate function and workers. Iterable datasets: only rank 0 sees the stream, so
it sends each batch with whether it is the last and the last round's real size, and a
round of ``None`` when the stream ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch.distributed as dist

# An iterable's round: each rank's batch, whether the round is the last, its real samples.
StreamRound = tuple[list[Any], bool, int]


def scatter_from_main(items: Sequence[Any] | None, rank: int) -> Any:
    """Rank 0's ``items[r]`` on each rank ``r`` (``items`` is read on rank 0 only)."""
    received: list[Any] = [None]
    sent = list(items) if rank == 0 and items is not None else None
    dist.scatter_object_list(received, sent, src=0)
    return received[0]


def dispatched_indexed(
    rounds: Sequence[Sequence[list[int] | None]],
    rank: int,
    load: Callable[[list[list[int]]], Iterable[Any]],
) -> Iterator[Any]:
    """This rank's batches of ``rounds`` (each round: every rank's index batch, or None
    where a rank has none), loaded on rank 0 by ``load(index_batches)`` and scattered."""
    wanted = [batch for round_ in rounds for batch in round_ if batch is not None]
    loaded = iter(load(wanted)) if rank == 0 else iter(())
    for round_ in rounds:
        items = [None if b is None else next(loaded) for b in round_] if rank == 0 else None
        mine = scatter_from_main(items, rank)
        if round_[rank] is not None:
            yield mine


def dispatched_stream(
    rounds: Iterator[StreamRound] | None, rank: int, world: int
) -> Iterator[tuple[Any, bool, int]]:
    """This rank's (batch, is last, real samples of the last round), read on rank 0 from
    ``rounds`` (None elsewhere) and scattered round by round until the stream ends."""
    while True:
        items: list[Any] | None = None
        if rank == 0:
            assert rounds is not None  # the caller reads the stream on rank 0
            current = next(rounds, None)
            if current is None:
                items = [None] * world
            else:
                batches, last, real = current
                items = [(batch, last, real) for batch in batches]
        mine = scatter_from_main(items, rank)
        if mine is None:
            return
        yield mine
