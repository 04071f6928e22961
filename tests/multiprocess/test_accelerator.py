"""The Accelerator on 2 real CPU/gloo processes launched by nbaccel: parity, sharding, sync.

Tolerances: SGD on float32, the same samples per optimizer step; the only differences are
the order of floating-point sums (all-reduce vs one batch), so parameters agree to 1e-6.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import nbaccel

pytestmark = pytest.mark.timeout(240)

TOLERANCE = 1e-6


def train_regression(
    batch: int, steps: int, accumulation: int = 1, mixed_precision: str = "no"
) -> dict[str, Any]:
    """Train a small MLP; return its parameters, the sample ids each step saw, and facts."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel.utils import DataLoaderConfiguration

    torch.manual_seed(0)
    # A seedable order is the same for any number of processes (the default order, as in
    # Accelerate, draws its seed differently on one process than on several).
    acc = nbaccel.Accelerator(
        gradient_accumulation_steps=accumulation,
        mixed_precision=mixed_precision,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(96, 6, generator=data), torch.randn(96, 1, generator=data)
    dataset = TensorDataset(torch.arange(96), x, y)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(dataset, batch_size=batch, shuffle=True)
    loader, model, optimizer = acc.prepare(loader, model, optimizer)
    seen: list[list[int]] = []
    for micro_step, (ids, xb, yb) in enumerate(loader):
        if micro_step == steps:
            break
        seen.append(ids.tolist())
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    params = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
    return {
        "params": params,
        "seen": seen,
        "type": acc.distributed_type.value,
        "ddp": type(model).__name__,
    }


def max_difference(a: list[Any], b: list[Any]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_two_ranks_on_half_batches_equal_one_process_on_the_full_batch(runs_dir: str) -> None:
    one = nbaccel.notebook_launcher(
        train_regression, args=(16, 5), num_processes=1, runs_dir=runs_dir
    )
    run = nbaccel.launch(train_regression, args=(8, 5), num_processes=2, runs_dir=runs_dir)
    two = run.results(timeout=120)
    assert one["type"] == "NO" and one["ddp"] == "Sequential"
    assert two[0]["type"] == "MULTI_CPU" and two[0]["ddp"] == "DistributedDataParallel"
    assert max_difference(one["params"], two[0]["params"]) < TOLERANCE
    assert max_difference(two[0]["params"], two[1]["params"]) == 0.0  # replicas stay equal
    for step in range(5):
        # Each step: rank 0 takes the first half of the single process's batch, rank 1 the
        # second half: distinct slices, together the same samples.
        assert two[0]["seen"][step] == one["seen"][step][:8]
        assert two[1]["seen"][step] == one["seen"][step][8:]


def test_accumulating_k_micro_batches_equals_one_k_times_batch(runs_dir: str) -> None:
    full = nbaccel.notebook_launcher(
        train_regression, args=(16, 3), num_processes=1, runs_dir=runs_dir
    )
    accumulated = nbaccel.notebook_launcher(
        train_regression, args=(4, 12, 4), num_processes=1, runs_dir=runs_dir
    )
    both = nbaccel.notebook_launcher(
        train_regression, args=(2, 12, 4), num_processes=2, runs_dir=runs_dir
    )
    assert max_difference(full["params"], accumulated["params"]) < TOLERANCE
    assert max_difference(full["params"], both["params"]) < TOLERANCE


def count_all_reduces(accumulation: int, micro_steps: int) -> list[int]:
    """Run micro-steps under accumulate(); return the micro-steps on which DDP all-reduced."""
    import torch
    import torch.distributed as dist

    acc = nbaccel.Accelerator(gradient_accumulation_steps=accumulation)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    current = {"step": -1}
    reduced: list[int] = []

    def counting_hook(state: object, bucket: Any) -> Any:
        reduced.append(current["step"])
        tensor = bucket.buffer() / dist.get_world_size()
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])

    counting_hook.__annotations__.clear()  # DDP rejects string annotations on the hook
    model.register_comm_hook(None, counting_hook)
    for step in range(micro_steps):
        current["step"] = step
        with acc.accumulate(model):
            acc.backward(model(torch.ones(3, 4)).sum())
            optimizer.step()
            optimizer.zero_grad()
    return reduced


def test_gradients_are_all_reduced_only_on_the_steps_that_sync(runs_dir: str) -> None:
    reduced = nbaccel.notebook_launcher(
        count_all_reduces, args=(4, 8), num_processes=2, runs_dir=runs_dir
    )
    assert reduced == [3, 7]  # one bucket, reduced on micro-steps 4 and 8 only
    every_step = nbaccel.notebook_launcher(
        count_all_reduces, args=(1, 3), num_processes=2, runs_dir=runs_dir
    )
    assert every_step == [0, 1, 2]


def epochs_of_ids(size: int, batch: int, epochs: int) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(3)
    acc = nbaccel.Accelerator()
    loader = acc.prepare(
        DataLoader(TensorDataset(torch.arange(size)), batch_size=batch, shuffle=True)
    )
    local: list[list[int]] = []
    gathered: list[list[int]] = []
    as_objects: list[list[int]] = []
    for _ in range(epochs):  # no set_epoch: the prepared loader advances by itself
        mine, everyone, objects = [], [], []
        for (ids,) in loader:
            mine += ids.tolist()
            everyone += acc.gather_for_metrics(ids).tolist()
            objects += acc.gather_for_metrics(ids.tolist(), use_gather_object=True)
        local.append(mine)
        gathered.append(everyone)
        as_objects.append(objects)
    return {"local": local, "gathered": gathered, "objects": as_objects, "batches": len(loader)}


def test_shards_are_distinct_reshuffled_each_epoch_and_metrics_drop_padding(
    runs_dir: str,
) -> None:
    run = nbaccel.launch(epochs_of_ids, args=(11, 2, 2), num_processes=2, runs_dir=runs_dir)
    result = run.results(timeout=120)
    r0, r1 = result[0], result[1]
    assert r0["batches"] == r1["batches"] == 3  # 11 samples, 2 per batch, 2 ranks: padded
    for epoch in range(2):
        assert len(r0["local"][epoch]) == len(r1["local"][epoch]) == 6  # 12 = 11 + 1 repeat
        # Every sample once, the padding dropped; ranks see the same gathered order.
        assert sorted(r0["gathered"][epoch]) == list(range(11))
        assert r0["gathered"][epoch] == r1["gathered"][epoch]
        assert r0["objects"][epoch] == r0["gathered"][epoch]  # the object path drops them too
        # Real samples are split: no id is on both ranks except the padding repeats.
        assert len(set(r0["local"][epoch]) | set(r1["local"][epoch])) == 11
    assert r0["gathered"][0] != r0["gathered"][1]  # a new order each epoch


def collectives_and_helpers(shared: str) -> dict[str, Any]:
    import torch

    acc = nbaccel.Accelerator()
    rank = acc.process_index
    ragged = torch.full((rank + 1, 2), float(rank))
    padded = acc.pad_across_processes(ragged, dim=0, pad_index=-1)
    marker = Path(shared) / "downloaded"
    with acc.main_process_first():
        found_first = marker.exists()  # rank 0 "downloads"; the others must find it done
        if rank == 0:
            marker.write_text("done")
    acc.print(f"printed by rank {rank}")
    on_main = acc.on_main_process(lambda: "main")()
    return {
        "gather": acc.gather(torch.tensor([rank, rank * 10])).tolist(),
        "gather_scalar": acc.gather(torch.tensor(rank)).tolist(),
        "gather_nested": acc.gather({"a": torch.tensor([rank])})["a"].tolist(),
        "sum": acc.reduce(torch.tensor([1.0, float(rank)])).tolist(),
        "mean": acc.reduce(torch.tensor([float(rank)]), "mean").tolist(),
        "padded": acc.gather(padded).tolist(),
        "objects": acc.gather_for_metrics([f"r{rank}"]),
        "on_main": on_main,
        "found_first": found_first,
    }


def test_collectives_across_two_ranks(runs_dir: str) -> None:
    run = nbaccel.launch(
        collectives_and_helpers, args=(runs_dir,), num_processes=2, runs_dir=runs_dir
    )
    results = run.results(timeout=120)
    r0, r1 = results[0], results[1]
    assert r0["gather"] == r1["gather"] == [0, 0, 1, 10]
    assert r0["gather_scalar"] == [0, 1]
    assert r0["gather_nested"] == [0, 1]
    assert r0["sum"] == [2.0, 1.0] and r0["mean"] == [0.5]
    assert r0["padded"] == [[0.0, 0.0], [-1.0, -1.0], [1.0, 1.0], [1.0, 1.0]]
    assert r0["objects"] == ["r0", "r1"]
    assert (r0["on_main"], r1["on_main"]) == ("main", None)
    assert (r0["found_first"], r1["found_first"]) == (False, True)  # main_process_first
    assert "printed by rank 0" in run.logs(0)
    assert "printed by rank" not in run.logs(1)


def settings_seen(explicit: dict[str, Any]) -> dict[str, Any]:
    acc = nbaccel.Accelerator(**explicit)
    return {
        "mixed_precision": acc.mixed_precision,
        "accumulation": acc.gradient_accumulation_steps,
        "scaler": acc.scaler is not None,
    }


def test_launch_settings_reach_the_accelerator_and_explicit_arguments_win(
    runs_dir: str,
) -> None:
    seen = nbaccel.notebook_launcher(
        settings_seen,
        args=({},),
        num_processes=2,
        runs_dir=runs_dir,
        mixed_precision="fp16",
        gradient_accumulation_steps=4,
    )
    assert seen == {"mixed_precision": "fp16", "accumulation": 4, "scaler": True}
    overridden = nbaccel.notebook_launcher(
        settings_seen,
        args=({"mixed_precision": "bf16"},),
        num_processes=1,
        runs_dir=runs_dir,
        mixed_precision="fp16",
        gradient_accumulation_steps=4,
    )
    assert overridden == {"mixed_precision": "bf16", "accumulation": 4, "scaler": False}


def log_to_trackers(project: str) -> str:
    import torch

    acc = nbaccel.Accelerator()  # log_with comes from the launch
    acc.init_trackers(project, config={"lr": 0.1, "layers": [4, 1]})
    for step in range(3):
        acc.log({"loss": torch.tensor(1.0 / (step + 1)), "rank": acc.process_index}, step=step)
    acc.end_training()
    return str(acc.project_dir)


def test_log_feeds_run_metrics_and_the_trackers_from_the_main_process(runs_dir: str) -> None:
    import csv
    import json

    run = nbaccel.launch(
        log_to_trackers,
        args=("exp",),
        num_processes=2,
        runs_dir=runs_dir,
        log_with=("csv", "jsonl", "tensorboard"),
    )
    project_dir = Path(run.result(timeout=120))
    assert project_dir == run.run_dir  # trackers default to the run's folder
    expected = [{"loss": 1.0 / (s + 1), "rank": 0.0, "step": s} for s in range(3)]
    got = [{k: m[k] for k in ("loss", "rank", "step")} for m in run.metrics]
    assert got == [pytest.approx(e, rel=1e-6) for e in expected]
    lines = (project_dir / "exp" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["loss"] for line in lines] == pytest.approx([1.0, 0.5, 1.0 / 3])
    with open(project_dir / "exp" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["step"], r["name"]) for r in rows} >= {("2", "loss"), ("0", "rank")}
    assert json.loads((project_dir / "exp" / "config.json").read_text())["lr"] == 0.1
    assert list((project_dir / "exp").glob("**/events.out.tfevents.*"))
