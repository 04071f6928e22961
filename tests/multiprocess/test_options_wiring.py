"""Options that need two real ranks, launched through nbaccel (CPU, gloo).

``join_uneven_inputs`` with really uneven ranks, ``rng_types`` synchronised from rank 0,
``dispatch_batches`` (rank 0 reads, every rank gets what sharding would give it) and
``InitProcessGroupKwargs``' timeout applied to the group the launch created.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

import nbaccel

pytestmark = pytest.mark.timeout(240)


def join_with_uneven_ranks() -> dict[str, Any]:
    """DDP on 10 samples, batch 4, even_batches=False inside join: rank 0 takes 2 steps."""
    from torch.utils.data import TensorDataset

    acc = nbaccel.Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.arange(10.0).repeat(3, 1).T / 10, torch.arange(10.0)[:, None])
    loader = DataLoader(data, batch_size=4)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    steps = 0
    with acc.join_uneven_inputs([model], even_batches=False):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    weights = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
    return {"steps": steps, "weights": weights, "even_after": loader.plan.even_batches}


def expected_join_weights() -> list[torch.Tensor]:
    """What DDP's Join computes: each step averages over both ranks, a joined rank adding
    zeros (the gradient is divided by the initial world size, 2)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(10.0).repeat(3, 1).T / 10
    y = torch.arange(10.0)[:, None]
    steps = [[slice(0, 4), slice(4, 8)], [slice(8, 10)]]  # rank 1 has joined in step 2
    for batches in steps:
        optimizer.zero_grad()
        for part in batches:
            (torch.nn.functional.mse_loss(model(x[part]), y[part]) / 2).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def test_join_uneven_inputs_finishes_uneven_ranks_with_equal_parameters(runs_dir: str) -> None:
    run = nbaccel.launch(join_with_uneven_ranks, num_processes=2, runs_dir=runs_dir)
    results = run.results(timeout=180)
    assert results[0]["steps"] == 2 and results[1]["steps"] == 1  # uneven, nothing hung
    expected = expected_join_weights()
    for rank in (0, 1):
        for got, want in zip(results[rank]["weights"], expected, strict=True):
            assert torch.allclose(got, want, atol=1e-6)
        assert results[rank]["even_after"] is True  # the override ends with the block


class Recorded(Dataset[int]):
    """Map-style data that records which process read each item."""

    def __init__(self, size: int) -> None:
        self.size, self.reads = size, 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        self.reads += 1
        return index


class RecordedStream(IterableDataset[int]):
    def __init__(self, size: int) -> None:
        self.size, self.passes = size, 0

    def __iter__(self) -> Iterator[int]:
        self.passes += 1
        yield from range(self.size)


def batches_of(loader: Any) -> list[list[int]]:
    return [batch.tolist() for epoch in range(2) for batch in loader]


def options_on_two_ranks() -> dict[str, Any]:
    from torch.distributed import distributed_c10d

    from nbaccel.utils import DataLoaderConfiguration, InitProcessGroupKwargs

    found: dict[str, Any] = {}
    # rng_types: ranks seeded apart; each pass starts from rank 0's torch generator.
    for name, rng_types in (("synced", ["torch"]), ("default", None)):
        acc = nbaccel.Accelerator(rng_types=rng_types)
        loader = acc.prepare(DataLoader(range(8), batch_size=2))
        torch.manual_seed(100 + acc.process_index)
        draws = []
        for _ in range(2):
            for _batch in loader:
                draws.append(torch.rand(2).tolist())
                torch.manual_seed(200 + acc.process_index)  # apart again before the next pass
        found[name] = draws
    # dispatch_batches: the batches sharding gives, read on rank 0 only.
    settings: list[dict[str, Any]] = [{}, {"split_batches": True}, {"even_batches": False}]
    for number, extra in enumerate(settings):
        sharded, dispatched = [], []
        reads = []
        for dispatch in (False, True):
            config = DataLoaderConfiguration(dispatch_batches=dispatch, data_seed=3, **extra)
            acc = nbaccel.Accelerator(dataloader_config=config)
            data = Recorded(10)
            loader = acc.prepare(DataLoader(data, batch_size=4, shuffle=True))
            (dispatched if dispatch else sharded).extend(batches_of(loader))
            reads.append(data.reads)
        found[f"map{number}"] = {"sharded": sharded, "dispatched": dispatched, "reads": reads}
    for split in (False, True):
        streams, passes = [], []
        for dispatch in (False, True):
            config = DataLoaderConfiguration(dispatch_batches=dispatch, split_batches=split)
            acc = nbaccel.Accelerator(dataloader_config=config)
            stream = RecordedStream(11)
            streams.append(batches_of(acc.prepare(DataLoader(stream, batch_size=4))))
            passes.append(stream.passes)
        found[f"stream_split{split}"] = {"batches": streams, "passes": passes}
    # InitProcessGroupKwargs' timeout on the group the launch created.
    nbaccel.Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=_seconds(77))])
    group = distributed_c10d._get_default_group()
    found["timeout"] = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    return found


def _seconds(value: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=value)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    runs = str(tmp_path_factory.mktemp("runs"))
    results: dict[int, dict[str, Any]] = nbaccel.launch(
        options_on_two_ranks, num_processes=2, runs_dir=runs
    ).results(timeout=200)
    return results


def test_rng_types_torch_starts_every_pass_from_rank_0s_generator(
    two_ranks: dict[int, dict[str, Any]],
) -> None:
    synced = [two_ranks[rank]["synced"] for rank in (0, 1)]
    first_of_each_pass = [[draws[0], draws[2]] for draws in synced]  # 2 batches a pass
    assert first_of_each_pass[0] == first_of_each_pass[1]
    default = [two_ranks[rank]["default"] for rank in (0, 1)]
    assert default[0][0] != default[1][0]  # without it, the ranks' seeds show


@pytest.mark.parametrize("number", [0, 1, 2])
def test_dispatched_batches_are_the_sharded_ones_read_on_rank_0(
    two_ranks: dict[int, dict[str, Any]], number: int
) -> None:
    for rank in (0, 1):
        case = two_ranks[rank][f"map{number}"]
        assert case["dispatched"] == case["sharded"] and case["sharded"]
    reads = [two_ranks[rank][f"map{number}"]["reads"] for rank in (0, 1)]  # [sharded, dispatched]
    assert reads[0][0] > 0 and reads[1][0] > 0  # sharded: each rank reads its share
    assert reads[0][1] >= 20 and reads[1][1] == 0  # dispatched: rank 0 reads both epochs


@pytest.mark.parametrize("split", [False, True])
def test_a_dispatched_stream_is_read_by_rank_0_only(
    two_ranks: dict[int, dict[str, Any]], split: bool
) -> None:
    both = [two_ranks[rank][f"stream_split{split}"] for rank in (0, 1)]
    for rank in (0, 1):
        sharded, dispatched = both[rank]["batches"]
        assert dispatched == sharded
    assert both[0]["passes"] == [2, 2] and both[1]["passes"] == [2, 0]
    # Rank r's share of 11 samples in batches of 4, two epochs; the last round is completed
    # with its own first batch (or, split, the last batch with its own first sample).
    rank0, rank1 = (both[rank]["batches"][1] for rank in (0, 1))
    if split:
        assert rank0 == [[0, 1], [4, 5], [8, 9]] * 2 and rank1 == [[2, 3], [6, 7], [10, 8]] * 2
    else:
        assert rank0 == [[0, 1, 2, 3], [8, 9, 10]] * 2 and rank1 == [[4, 5, 6, 7], [8, 9, 10]] * 2


def test_the_handlers_timeout_reaches_the_launchs_group(
    two_ranks: dict[int, dict[str, Any]],
) -> None:
    assert two_ranks[0]["timeout"] == two_ranks[1]["timeout"] == 77
