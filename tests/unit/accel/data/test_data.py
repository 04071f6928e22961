"""Prepared dataloaders and checkpoints in this process.

World sizes 2 and 3 are checked by building one ShardPlan per rank: the sampler and the
iterable loader are pure functions of (plan, source), so this is what each rank would see.
"""

from __future__ import annotations

import collections
import json
import pickle
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from nbaccel import Accelerator
from nbaccel.accel.data.loaders import (
    PreparedIterableLoader,
    ShardedBatchSampler,
    ShardPlan,
    send_to_device,
)
from nbaccel.accel.optim import GradientState


def ranks(
    n: int, batch: int, world: int, *, shuffle: bool = True, drop_last: bool = False, **plan: Any
) -> list[ShardedBatchSampler]:
    sampler = RandomSampler(range(n)) if shuffle else range(n)
    return [
        ShardedBatchSampler(
            BatchSampler(sampler, batch, drop_last),  # type: ignore[arg-type]
            ShardPlan(rank=r, world_size=world, seed=11, **plan),
        )
        for r in range(world)
    ]


def gathered(shards: list[ShardedBatchSampler]) -> list[int]:
    """What gather_for_metrics returns over an epoch: round by round, padding dropped."""
    per_rank = [list(s) for s in shards]
    out: list[int] = []
    for j in range(len(per_rank[0])):
        round_ = [i for batches in per_rank for i in batches[j]]
        last = j == len(per_rank[0]) - 1 and shards[0].plan.last_remainder >= 0
        out += round_[: shards[0].plan.last_remainder] if last else round_
    return out


# -- sharding (world sizes 2 and 3) -----------------------------------------------------------
@pytest.mark.parametrize(("world", "n", "batch"), [(2, 12, 3), (3, 12, 2), (2, 11, 2), (3, 10, 4)])
def test_ranks_take_global_batches_round_robin(world: int, n: int, batch: int) -> None:
    shards = ranks(n, batch, world)
    every, remainder = shards[0]._global_batches()
    per_rank = [list(s) for s in shards]
    for r in range(world):
        assert per_rank[r] == every[r::world]  # rank r takes global batch j with j % N == r
        assert len(shards[r]) == len(per_rank[r]) == len(per_rank[0])  # even_batches
        assert all(len(b) == batch for b in per_rank[r])  # the last batch is completed
    flat = [i for b in every for i in b]
    assert set(flat) == set(range(n))  # the union covers the dataset
    if n % (world * batch) == 0:
        assert len(flat) == n  # nothing padded: the shards are disjoint
    assert remainder == n - (len(every) // world - 1) * world * batch  # real, last round
    assert sorted(gathered(shards)) == list(range(n))  # metrics see every sample once


def test_each_epoch_is_a_new_permutation_and_the_seed_fixes_it() -> None:
    orders = []
    for epoch in (0, 1, 0):
        shards = ranks(12, 3, 2, epoch=epoch)
        orders.append(gathered(shards))
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(12))
    assert orders[0] != orders[1] and orders[0] == orders[2]
    other_seed = ShardedBatchSampler(
        BatchSampler(RandomSampler(range(12)), 3, False), ShardPlan(rank=0, world_size=1, seed=12)
    )
    assert [i for b in other_seed for i in b] != orders[0]


def test_drop_last_keeps_whole_rounds_of_full_batches() -> None:
    two = ranks(10, 4, 2, drop_last=True)
    assert [list(s) for s in two] == [[b] for b in two[0]._global_batches()[0]]
    assert all(len(s) == 1 and s.plan.last_remainder == -1 for s in two)
    assert [list(s) for s in ranks(10, 4, 3, drop_last=True)] == [[], [], []]


def test_len_matches_iteration_without_even_batches() -> None:
    shards = ranks(10, 2, 2, even_batches=False)  # 5 batches: rank 0 gets 3, rank 1 gets 2
    assert [len(list(s)) for s in shards] == [3, 2]
    assert [len(s) for s in shards] == [3, 2]


def test_split_batches_cuts_each_global_batch_across_ranks() -> None:
    shards = ranks(10, 4, 2, shuffle=False, split_batches=True)
    per_rank = [list(s) for s in shards]
    assert per_rank[0] == [[0, 1], [4, 5], [8]] and per_rank[1] == [[2, 3], [6, 7], [9]]
    assert [len(s) for s in shards] == [3, 3]


def test_split_batches_does_not_repeat_samples_mid_epoch() -> None:
    shards = ranks(9, 3, 2, shuffle=False, split_batches=True)
    try:
        first_batch = [i for s in shards for i in next(iter(s))]
    except ValueError as error:  # refusing such a batch size, as Accelerate does, is a fix too
        assert "multiple" in str(error)
        return
    assert sorted(first_batch) == [0, 1, 2]


def test_custom_batch_sampler_batches_are_dealt_round_robin() -> None:
    custom = [[5, 1], [0, 2], [3, 4], [7, 6]]
    shards = [ShardedBatchSampler(custom, ShardPlan(rank=r, world_size=2, seed=0)) for r in (0, 1)]
    assert [list(s) for s in shards] == [[[5, 1], [3, 4]], [[0, 2], [7, 6]]]


def test_custom_variable_size_batches_are_kept_on_several_ranks() -> None:
    custom = [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9], [10]]  # e.g. a token-budget sampler
    shards = [ShardedBatchSampler(custom, ShardPlan(rank=r, world_size=2, seed=0)) for r in (0, 1)]
    assert [next(iter(s)) for s in shards] == [[0, 1, 2], [3, 4, 5, 6, 7]]


# -- the prepared loader at world size 1 ------------------------------------------------------
def test_prepared_loader_reshuffles_each_epoch_without_set_epoch() -> None:
    torch.manual_seed(5)
    loader = Accelerator().prepare(DataLoader(torch.arange(12), batch_size=4, shuffle=True))
    epochs = [[i for b in loader for i in b.tolist()] for _ in range(2)]
    after = torch.get_rng_state()
    # On one process: the batches and the global RNG's draws of an untouched DataLoader
    # (what Accelerate leaves it), so dropout after each epoch's start is the same too.
    torch.manual_seed(5)
    plain = DataLoader(torch.arange(12), batch_size=4, shuffle=True)
    assert [[i for b in plain for i in b.tolist()] for _ in range(2)] == epochs
    assert torch.equal(torch.get_rng_state(), after)
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(12)) and epochs[0] != epochs[1]
    torch.manual_seed(5)
    again = Accelerator().prepare(DataLoader(torch.arange(12), batch_size=4, shuffle=True))
    assert [i for b in again for i in b.tolist()] == epochs[0]


def test_gather_for_metrics_over_an_uneven_epoch_counts_every_sample_once() -> None:
    acc = Accelerator()
    loader = acc.prepare(DataLoader(torch.arange(10), batch_size=4, shuffle=True))
    seen = [i for batch in loader for i in acc.gather_for_metrics(batch).tolist()]
    assert sorted(seen) == list(range(10))
    assert not acc.gradient_state.end_of_dataloader  # reset after the epoch


def test_world_size_1_yields_the_users_batches_unpadded() -> None:
    acc = Accelerator()
    loader = acc.prepare(DataLoader(torch.arange(10), batch_size=4))
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    custom = [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9]]
    loader = acc.prepare(DataLoader(torch.arange(10), batch_sampler=custom))
    assert [b.tolist() for b in loader] == custom


def test_random_sampler_with_num_samples_draws_from_the_whole_dataset() -> None:
    data = torch.arange(10)
    sampler = RandomSampler(data, replacement=True, num_samples=20)
    loader = Accelerator().prepare(DataLoader(data, batch_size=5, sampler=sampler))
    assert sum(len(b) for b in loader) == 20  # today: IndexError (index 10..19)


def test_loader_position_resumes_mid_epoch_and_at_the_end() -> None:
    def fresh() -> Any:
        return Accelerator().prepare(DataLoader(torch.arange(12), batch_size=2, shuffle=True))

    torch.manual_seed(0)
    loader = fresh()
    epoch0 = []
    for i, batch in enumerate(loader):
        epoch0.append(batch.tolist())
        if i == 2:
            middle, middle_rng = loader.state_dict(), torch.get_rng_state()
    end, end_rng = loader.state_dict(), torch.get_rng_state()
    epoch1 = [b.tolist() for b in loader]
    assert middle["batches_consumed"] == 3 and end["epoch"] == 0
    torch.manual_seed(1)
    resumed = fresh()  # another seed: the state's seed must win
    resumed.load_state_dict(middle)
    torch.set_rng_state(middle_rng)  # as load_state restores it
    assert [b.tolist() for b in resumed] == epoch0[3:]
    assert [b.tolist() for b in resumed] == epoch1  # then the next epoch, complete
    at_end = fresh()
    at_end.load_state_dict(end)
    torch.set_rng_state(end_rng)
    assert [b.tolist() for b in at_end] == epoch1


class Stream(IterableDataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(self.n))


def iterable_rank(rank: int, n: int = 10, world: int = 2) -> tuple[list[Any], list[Any]]:
    """(batches, (end_of_dataloader, remainder) at each batch) for one rank."""
    gradients = GradientState()
    plan = ShardPlan(rank=rank, world_size=world, seed=0)
    loader = PreparedIterableLoader(DataLoader(Stream(n), batch_size=2), plan, None, gradients)
    batches, flags = [], []
    for batch in loader:
        batches.append(batch.tolist())
        flags.append((gradients.end_of_dataloader, gradients.remainder))
    return batches, flags


def test_iterable_dataset_rank_r_keeps_batches_j_mod_n_and_pads_the_last_round() -> None:
    (b0, f0), (b1, f1) = iterable_rank(0), iterable_rank(1)
    assert b0 == [[0, 1], [4, 5], [8, 9]]
    assert b1 == [[2, 3], [6, 7], [8, 9]]  # the incomplete last round repeats its first batch
    assert f0 == f1 == [(False, -1), (False, -1), (True, 2)]  # 2 real samples in that round
    even, flags = iterable_rank(0, n=8)
    assert even == [[0, 1], [4, 5]] and flags[-1] == (True, -1)
    loader = Accelerator().prepare(DataLoader(Stream(5), batch_size=2))
    assert isinstance(loader, PreparedIterableLoader)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]


def test_iterable_loader_can_be_iterated_again() -> None:
    loader = Accelerator().prepare(DataLoader(Stream(6), batch_size=2))
    assert [b.tolist() for b in loader] == [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]


def test_iterable_loader_position_counts_skipped_batches() -> None:
    loader = Accelerator().prepare(DataLoader(Stream(10), batch_size=2))
    loader.load_state_dict({"epoch": 0, "batches_consumed": 2, "seed": 0})
    first = next(iter(loader))
    assert first.tolist() == [4, 5] and loader.state_dict()["batches_consumed"] == 3


def test_send_to_device_walks_nested_structures() -> None:
    pair = collections.namedtuple("pair", ["x", "y"])

    class Movable:
        def to(self, device: torch.device) -> str:
            return f"moved to {device}"

    data = {"a": [torch.ones(1), (torch.zeros(2), "keep")], "p": pair(torch.ones(1), 3)}
    data["m"] = Movable()  # type: ignore[assignment]
    out = send_to_device(data, torch.device("meta"))
    assert out["a"][0].device.type == out["a"][1][0].device.type == "meta"
    assert isinstance(out["a"][1], tuple) and out["a"][1][1] == "keep"
    assert type(out["p"]) is pair and out["p"].x.device.type == "meta" and out["p"].y == 3
    assert out["m"] == "moved to meta" and data["a"][0].device.type == "cpu"


# -- checkpoints ----------------------------------------------------------------------------
def setup(optimizers: int = 1) -> tuple[Accelerator, torch.nn.Module, list[Any], Any, Any]:
    acc = Accelerator()
    model = torch.nn.Linear(3, 1)
    opts = [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) for _ in range(optimizers)]
    sched = torch.optim.lr_scheduler.StepLR(opts[0], step_size=1, gamma=0.5)
    loader = DataLoader(torch.arange(36.0).reshape(12, 3), batch_size=2, shuffle=True)
    model, *rest = acc.prepare(model, *opts, sched, loader)
    return acc, model, rest[:optimizers], rest[-2], rest[-1]


def train(acc: Accelerator, model: torch.nn.Module, opt: Any, sched: Any, batches: Any) -> None:
    for batch in batches:
        with acc.accumulate(model):
            acc.backward(model(batch).pow(2).mean())
            opt.step()
            sched.step()
            opt.zero_grad()


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_save_state_writes_one_complete_state(tmp_path: Path) -> None:
    acc, *_ = setup()
    first = acc.save_state(tmp_path)
    assert (tmp_path / "LATEST").read_text().strip() == first.name
    names = {p.name for p in first.iterdir()}
    assert {"meta.json", "model_0.pt", "optimizer_0.pt", "scheduler_0.pt"} <= names
    assert "random_states_0.pt" in names
    second = acc.save_state(tmp_path)
    assert second != first and (tmp_path / "LATEST").read_text().strip() == second.name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", second.name]


def test_load_state_restores_everything(tmp_path: Path) -> None:
    acc, model, (opt,), sched, loader = setup()
    it = iter(loader)
    train(acc, model, opt, sched, [next(it) for _ in range(2)])
    acc.save_state(tmp_path)
    expected = ({k: v.clone() for k, v in model.state_dict().items()}, sched.get_last_lr())
    momentum = opt.state[model.weight]["momentum_buffer"].clone()
    rest, after = [b.clone() for b in it], draws()
    train(acc, model, opt, sched, rest)  # move everything on, then come back

    acc2, model2, (opt2,), sched2, loader2 = setup()
    acc2.load_state(tmp_path)
    assert draws() == after  # python, numpy and torch RNGs continue as after the save
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[0][k])
    assert sched2.get_last_lr() == expected[1] and acc2.step == 2
    assert torch.equal(opt2.state[model2.weight]["momentum_buffer"], momentum)
    remaining = list(loader2)
    assert len(remaining) == len(rest) and all(map(torch.equal, remaining, rest))


def accelerate_folder(root: Path) -> None:
    root.mkdir()
    (root / "model.safetensors").write_bytes(b"")


def partial_only(root: Path) -> None:
    (root / ".partial-x").mkdir(parents=True)


def latest_without_folder(root: Path) -> None:
    root.mkdir()
    (root / "LATEST").write_text("state-gone\n")


def two_optimizers(root: Path) -> None:
    setup(optimizers=2)[0].save_state(root)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda root: None, FileNotFoundError, "no checkpoint folder"),
        (partial_only, ValueError, "save that never finished"),
        (accelerate_folder, ValueError, "Hugging Face Accelerate checkpoint"),
        (two_optimizers, ValueError, "optimizers: saved 2, prepared now 1"),
        (latest_without_folder, ValueError, "names state-gone, which is missing"),
    ],
)
def test_load_state_errors_change_nothing(
    tmp_path: Path, make: Any, error: type[Exception], match: str
) -> None:
    make(tmp_path / "ckpt")
    acc, model, *_ = setup()
    acc.step = 5
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match):
        acc.load_state(tmp_path / "ckpt")
    assert acc.step == 5
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class Counter:
    def __init__(self, value: Any = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def test_registered_objects_are_checkpointed(tmp_path: Path) -> None:
    acc, *_ = setup()
    counter = Counter(7)
    acc.register_for_checkpointing(counter)
    acc.save_state(tmp_path)
    counter.value = 99
    acc.load_state(tmp_path)
    assert counter.value == 7
    meta = json.loads(next(tmp_path.glob("state-*/meta.json")).read_text())
    assert meta["counts"]["custom"] == 1
    with pytest.raises(TypeError, match="object has no state_dict"):
        acc.register_for_checkpointing(object())


def test_checkpoints_load_with_weights_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    acc, model, *_ = setup()
    acc.register_for_checkpointing(Counter(Counter()))  # an arbitrary pickled object
    acc.save_state(tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        acc.load_state(tmp_path)
    assert not torch.equal(model.weight, before["weight"])  # untouched: still the +1
    calls: list[dict[str, Any]] = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw) or real_load(*a, **kw))
    acc2, *_ = setup()
    acc2.save_state(tmp_path / "plain")
    acc2.load_state(tmp_path / "plain")
    assert calls and all(kw.get("weights_only") is True for kw in calls)
