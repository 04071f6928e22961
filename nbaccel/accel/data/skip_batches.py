"""``skip_first_batches``: a loader that starts further on, to resume in the middle of an epoch.

Split from ``data`` to keep modules small. How it meets ``load_state``, measured against
Hugging Face Accelerate 1.15 (one process, its documented recipe: ``load_state(dir)``, then
``skip_first_batches(loader, step)`` for the first epoch, then the loader itself): Accelerate's
``load_state`` does not restore a loader's position (unless ``use_stateful_dataloader``), so
the recipe's skip is the only one. nbaccel's ``load_state`` does restore it, so here the skip
count replaces the restored position rather than adding to it: the same batches as Accelerate
for loaders that do not shuffle, and, for shuffling ones, the uninterrupted run's batches.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, Sampler

from nbaccel.accel.data.loaders import PreparedDataLoader, PreparedIterableLoader

__all__ = ["SkippingLoader", "skip_first_batches"]


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """A loader that skips the first ``num_batches`` batches (to resume mid-epoch).

    For a loader ``prepare`` returned, the result's first pass is the current epoch from
    batch ``num_batches`` on (skipped by index, nothing loaded); its later passes are the
    loader's own, so the next epoch is whole. After ``load_state`` the restored epoch is the
    current one and ``num_batches`` replaces the restored position: Accelerate's recipe,
    ``load_state`` then ``skip_first_batches(loader, step)``, skips once, not twice. Without
    it, ``load_state`` alone already resumes where the checkpoint was saved.

    Any other DataLoader gets what Accelerate gives: a new DataLoader over the same dataset
    and options that skips its first ``num_batches`` batches on every pass.

    >>> loader = skip_first_batches(DataLoader(range(6), batch_size=2), 2)
    >>> [batch.tolist() for batch in loader]
    [[4, 5]]
    """
    if num_batches < 0:
        raise ValueError(f"skip_first_batches(num_batches={num_batches}): must be 0 or more.")
    if isinstance(dataloader, (PreparedDataLoader, PreparedIterableLoader)):
        return SkippingLoader(dataloader, num_batches)
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"skip_first_batches takes a torch DataLoader (or one prepare() returned), not "
            f"{type(dataloader).__name__}. Wrap the data in a DataLoader, or skip with "
            "itertools.islice(iterable, num_batches, None)."
        )
    options = _loader_options(dataloader)
    if isinstance(dataloader.dataset, IterableDataset):  # no indices: read and drop
        return _DroppingDataLoader(
            dataloader.dataset,
            num_batches,
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            **options,
        )
    if dataloader.batch_sampler is None:  # batch_size=None: its sampler yields the batches
        skipping = _SkipFirst(dataloader.sampler, num_batches)
        return DataLoader(dataloader.dataset, batch_size=None, sampler=skipping, **options)
    skipping = _SkipFirst(dataloader.batch_sampler, num_batches)
    return DataLoader(dataloader.dataset, batch_sampler=skipping, **options)


class SkippingLoader:
    """A prepared loader whose next pass starts ``num_batches`` into the current epoch;
    every other attribute is the loader's."""

    def __init__(self, loader: PreparedDataLoader | PreparedIterableLoader, num_batches: int):
        self.loader = loader
        self.num_batches = num_batches
        self._skipped = False

    def __iter__(self) -> Iterator[Any]:
        if not self._skipped:
            self._skipped = True
            self.loader.start_at(self.num_batches)
        return iter(self.loader)

    def __len__(self) -> int:
        total = len(self.loader)  # type: ignore[arg-type]
        return total if self._skipped else max(total - self.num_batches, 0)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copy, unpickling): no endless lookup
            raise AttributeError(name)
        return getattr(self.loader, name)


class _SkipFirst(Sampler[Any]):
    """``source``'s items (indices or batches of them) without the first ``count``."""

    def __init__(self, source: Iterable[Any], count: int) -> None:
        self.source = source
        self.count = count

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.source), self.count, None)

    def __len__(self) -> int:
        return max(len(self.source) - self.count, 0)  # type: ignore[arg-type]


class _DroppingDataLoader(DataLoader[Any]):
    """A DataLoader over an IterableDataset that drops its first ``count`` batches."""

    def __init__(self, dataset: Any, count: int, **options: Any) -> None:
        super().__init__(dataset, **options)
        self.skip_batches = count

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return itertools.islice(super().__iter__(), self.skip_batches, None)

    def __len__(self) -> int:
        return max(super().__len__() - self.skip_batches, 0)


def _loader_options(loader: DataLoader[Any]) -> dict[str, Any]:
    """How ``loader`` loads (workers, collation, pinning, ...), to build a copy with."""
    names = (
        "num_workers",
        "collate_fn",
        "pin_memory",
        "timeout",
        "worker_init_fn",
        "multiprocessing_context",
        "generator",
        "prefetch_factor",
        "persistent_workers",
        "pin_memory_device",
        "in_order",
    )
    return {name: getattr(loader, name) for name in names if hasattr(loader, name)}
