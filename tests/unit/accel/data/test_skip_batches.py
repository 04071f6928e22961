"""skip_first_batches: on plain DataLoaders (Accelerate's results for the same calls), on
prepared loaders (once, in the current epoch), and after load_state, where Accelerate's
documented recipe (``load_state``, then ``skip_first_batches(loader, step)`` for the first
epoch, then the loader itself) must give Accelerate's batches: one skip, not two.

Accelerate's runs here are in this process (no process group), its shared state reset after.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

import nbaccel
from nbaccel import skip_first_batches
from nbaccel.accel.data.skip_batches import SkippingLoader


@pytest.fixture
def accelerate() -> Iterator[Any]:
    module = pytest.importorskip("accelerate")
    environment = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    yield module
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    after = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    assert after == environment  # Accelerate left no variables behind


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(7))

    def __len__(self) -> int:
        return 7


def passes(loader: Any, count: int = 2) -> list[list[list[int]]]:
    return [[batch.tolist() for batch in loader] for _ in range(count)]


@pytest.mark.parametrize(
    "make",
    [
        lambda: DataLoader(list(range(9)), batch_size=2),
        lambda: DataLoader(list(range(9)), batch_size=2, drop_last=True),
        lambda: DataLoader(Stream(), batch_size=2),
    ],
    ids=["map-style", "drop-last", "iterable"],
)
def test_plain_loaders_skip_on_every_pass_as_accelerate(make: Any, accelerate: Any) -> None:
    ours = passes(skip_first_batches(make(), 2))
    theirs = passes(accelerate.skip_first_batches(make(), 2))
    assert ours == theirs
    assert ours[0][0] == [4, 5]
    assert len(skip_first_batches(make(), 2)) == len(make()) - 2


def test_a_sampler_of_batches_keeps_fetching_whole_batches() -> None:
    # batch_size=None with a BatchSampler as sampler: the dataset is indexed by each batch
    # of indices at once (Accelerate's copy would fetch them one by one instead).
    batches = BatchSampler(SequentialSampler(range(6)), 2, False)
    source = DataLoader(torch.arange(6) * 10, sampler=batches, batch_size=None)
    skipped = skip_first_batches(source, 1)
    assert passes(skipped, 1) == [passes(source, 1)[0][1:]] == [[[20, 30], [40, 50]]]


def test_refuses_what_is_not_a_dataloader() -> None:
    with pytest.raises(TypeError, match="takes a torch DataLoader"):
        skip_first_batches([1, 2, 3], 1)
    with pytest.raises(ValueError, match="0 or more"):
        skip_first_batches(DataLoader(range(3)), -1)


def prepared(shuffle: bool = False, items: int = 12) -> tuple[Any, Any]:
    torch.manual_seed(0)
    acc = nbaccel.Accelerator(cpu=True)
    loader = acc.prepare(DataLoader(list(range(items)), batch_size=2, shuffle=shuffle))
    return acc, loader


def test_a_prepared_loader_skips_once_then_is_whole() -> None:
    _, loader = prepared(shuffle=True)
    whole = passes(loader, 3)
    _, loader = prepared(shuffle=True)
    skipping = skip_first_batches(loader, 4)
    assert isinstance(skipping, SkippingLoader) and len(skipping) == 2
    assert passes(skipping, 3) == [whole[0][4:], whole[1], whole[2]]
    assert len(skipping) == 6 and skipping.batch_size == 2  # the loader's own from now on


def test_skipping_after_a_finished_pass_skips_into_the_next_epoch() -> None:
    _, loader = prepared(shuffle=True)
    whole = passes(loader, 2)
    _, loader = prepared(shuffle=True)
    list(loader)
    assert passes(skip_first_batches(loader, 5), 1) == [whole[1][5:]]


def run_and_save(acc: Any, loader: Any, folder: Path, epoch: int, step: int) -> list[Any]:
    """Three epochs; the state saved after ``step`` batches of ``epoch``."""
    seen = []
    for current in range(3):
        batches = []
        for number, batch in enumerate(loader):
            batches.append(batch.tolist())
            if current == epoch and number == step - 1:
                acc.save_state(folder)
        seen.append(batches)
    return seen


def resume_with_accelerates_recipe(acc: Any, loader: Any, folder: Path, epoch: int, step: int):
    acc.load_state(folder)
    seen = []
    for current in range(epoch, 3):
        active = acc_skip(acc, loader, step) if current == epoch else loader
        seen.append([batch.tolist() for batch in active])
    return seen


def acc_skip(acc: Any, loader: Any, step: int) -> Any:
    module = type(acc).__module__
    return (
        acc.skip_first_batches(loader, step)
        if module.startswith("accelerate")
        else skip_first_batches(loader, step)
    )


@pytest.mark.parametrize("epoch", [0, 1])
def test_resume_recipe_gives_accelerates_batches(
    epoch: int, tmp_path: Path, accelerate: Any
) -> None:
    def accelerate_run(mode: str) -> list[Any]:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        acc = accelerate.Accelerator(cpu=True)
        loader = acc.prepare(DataLoader(list(range(12)), batch_size=2))
        folder = tmp_path / "accelerate"
        if mode == "full":
            return run_and_save(acc, loader, folder, epoch, 2)
        return resume_with_accelerates_recipe(acc, loader, folder, epoch, 2)

    their_full, theirs = accelerate_run("full"), accelerate_run("resume")
    acc, loader = prepared()
    ours_full = run_and_save(acc, loader, tmp_path / "nbaccel", epoch, 2)
    acc, loader = prepared()
    ours = resume_with_accelerates_recipe(acc, loader, tmp_path / "nbaccel", epoch, 2)
    assert ours_full == their_full
    assert ours == theirs
    assert ours[0] == [[4, 5], [6, 7], [8, 9], [10, 11]]  # skipped once, not twice


@pytest.mark.parametrize("epoch", [0, 1])
def test_resume_recipe_with_shuffling_continues_the_uninterrupted_run(
    epoch: int, tmp_path: Path
) -> None:
    acc, loader = prepared(shuffle=True)
    full = run_and_save(acc, loader, tmp_path, epoch, 2)
    acc, loader = prepared(shuffle=True)
    resumed = resume_with_accelerates_recipe(acc, loader, tmp_path, epoch, 2)
    assert resumed == [full[epoch][2:], *full[epoch + 1 :]]


def test_load_state_alone_resumes_where_it_was_saved(tmp_path: Path) -> None:
    acc, loader = prepared(shuffle=True)
    full = run_and_save(acc, loader, tmp_path, 0, 3)
    acc, loader = prepared(shuffle=True)
    acc.load_state(tmp_path)
    assert passes(loader, 2) == [full[0][3:], full[1]]
