"""set_seed and the module-level collectives in one process, where Accelerate's functions are
the reference (its results for the same calls); two real ranks are in
tests/multiprocess/test_partial_state_and_utils.py."""

from __future__ import annotations

import random
from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import nbaccel.utils
from nbaccel.utils import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
    set_seed,
    synchronize_rng_states,
)


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_set_seed_reproduces_every_generator_as_accelerate_does() -> None:
    accelerate_utils = pytest.importorskip("accelerate.utils")
    set_seed(11)
    ours = draws()
    accelerate_utils.set_seed(11)
    assert draws() == ours
    set_seed(11, device_specific=True)  # rank 0 of one process: the seed itself
    assert draws() == ours
    set_seed(12)
    assert draws() != ours


@pytest.fixture
def restore_determinism() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def test_deterministic_turns_on_deterministic_algorithms(restore_determinism: None) -> None:
    torch.use_deterministic_algorithms(False)
    set_seed(0, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()


def test_synchronize_rng_states_checks_its_arguments() -> None:
    synchronize_rng_states(["torch", "generator"], torch.Generator())  # one process: no-op
    with pytest.raises(ValueError, match="needs the generator"):
        synchronize_rng_states(["generator"])
    with pytest.raises(ValueError, match="not one of"):
        synchronize_rng_states(["numpy"])


CASES: list[tuple[str, Any]] = [
    ("gather", torch.tensor(2.0)),
    ("gather", {"a": [torch.ones(2)], "b": (torch.zeros(1),)}),
    ("gather_object", {"not": "a list"}),
    ("gather_object", [1, "two"]),
    ("broadcast", [torch.arange(3)]),
    ("pad_across_processes", torch.ones(2, 3)),
    ("reduce", torch.tensor([1.0, 3.0])),
]


@pytest.mark.parametrize(("name", "data"), CASES)
def test_one_process_results_equal_accelerates(name: str, data: Any) -> None:
    accelerate_utils = pytest.importorskip("accelerate.utils")
    ours = getattr(nbaccel.utils, name)(data)
    theirs = getattr(accelerate_utils, name)(data)
    assert repr(ours) == repr(theirs)


@pytest.mark.parametrize("reduction", ["mean", "sum", "max", "none"])
def test_reduce_copies_and_applies_the_reduction(reduction: str) -> None:
    tensor = torch.tensor([1.0, 2.0])
    out = reduce(tensor, reduction, scale=2.0)
    assert out.tolist() == [2.0, 4.0] and out is not tensor
    with pytest.raises(ValueError, match="'mean', 'sum', 'max', 'none'"):
        reduce(tensor, "min")


def test_one_process_identities() -> None:
    tensor = torch.ones(2)
    assert gather(tensor) is tensor and broadcast(tensor) is tensor
    items = [1, 2]
    assert broadcast_object_list(items) is items and items == [1, 2]
    assert gather_object(7) == 7
    assert pad_across_processes(tensor) is tensor


def test_send_to_device_keeps_structure_and_skips_keys() -> None:
    Pair = namedtuple("Pair", "x y")
    meta = torch.empty(1, device="meta")
    batch = {"pair": Pair(torch.ones(1), [torch.zeros(1)]), "mask": meta, "n": 3}
    moved = send_to_device(batch, "meta", skip_keys=["mask"])
    assert type(moved["pair"]) is Pair and moved["pair"].x.is_meta and moved["pair"].y[0].is_meta
    assert moved["mask"] is meta and moved["n"] == 3

    class OwnTo:  # e.g. a tokenizer's BatchEncoding: moved by its own .to(), no non_blocking
        def to(self, device: Any) -> str:
            return f"moved to {device}"

    assert send_to_device(OwnTo(), "cpu", non_blocking=True) == "moved to cpu"


def test_every_name_in_all_resolves_and_dir_lists_them() -> None:
    for name in nbaccel.utils.__all__:
        assert getattr(nbaccel.utils, name) is not None, name
    assert dir(nbaccel.utils) == sorted(nbaccel.utils.__all__)
    assert set(nbaccel.utils.__all__) == set(nbaccel.utils._DEFINED_IN)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        nbaccel.utils.nothing  # noqa: B018
