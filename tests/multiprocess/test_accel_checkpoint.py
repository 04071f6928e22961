"""save_state / load_state across real runs: exact resume, and a rank killed mid-save."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

import nbaccel

pytestmark = pytest.mark.timeout(240)


def train_resumable(checkpoint: str, steps: int, mode: str) -> list[Any]:
    """``fresh``: train ``steps``; ``save``: then save; ``resume``: load, then train ``steps``.

    Dropout (torch RNG), numpy and python noise in the loss, shuffled uneven data, fp16 with
    its loss scaler, momentum and a schedule: everything a resume has to restore.
    """
    import random

    import numpy as np
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    acc = nbaccel.Accelerator(gradient_accumulation_steps=2, mixed_precision="fp16")
    data = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(44, 8, generator=data), torch.randn(44, 1, generator=data))
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8)
    loader = DataLoader(dataset, batch_size=4, shuffle=True)
    model, optimizer, schedule, loader = acc.prepare(model, optimizer, schedule, loader)
    if mode == "resume":
        acc.load_state(checkpoint)
    target = acc.step + steps
    while acc.step < target:
        for x, y in loader:
            noise = 1e-3 * (float(np.random.rand()) + random.random())
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y) + noise
                acc.backward(loss)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
            acc.log({"loss": loss, "lr": schedule.get_last_lr()[0]}, step=acc.step)
            if acc.step == target:
                break
    if mode == "save":
        acc.save_state(checkpoint)
    # FSDP's parameters are shards (DTensors): gather them whole (every rank takes part).
    params = acc.unwrap_model(model).parameters()
    return [getattr(p, "full_tensor", p.detach)().detach().clone() for p in params]


STRATEGIES = {
    "ddp": {},
    "zero1": {"shard_optimizer_state": True},  # consolidated optimizer state, loaded by all
    # Sharded: each rank writes its shards through torch.distributed.checkpoint.
    "fsdp-sharded": {
        "strategy": "fsdp",
        "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
        "fsdp_min_num_params": 100,
    },
    "fsdp-full": {"strategy": "fsdp", "fsdp_state_dict_type": "FULL_STATE_DICT"},
}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_equals_the_uninterrupted_run(tmp_path: Path, runs_dir: str, strategy: str) -> None:
    checkpoint = str(tmp_path / "ckpt")
    settings = {"num_processes": 2, "runs_dir": runs_dir, **STRATEGIES[strategy]}
    straight = nbaccel.launch(train_resumable, args=(checkpoint, 20, "fresh"), **settings)
    first = nbaccel.launch(train_resumable, args=(checkpoint, 10, "save"), **settings)
    first.wait(timeout=120)
    second = nbaccel.launch(train_resumable, args=(checkpoint, 10, "resume"), **settings)
    expected = straight.result(timeout=120)
    resumed = second.result(timeout=120)
    for a, b in zip(expected, resumed, strict=True):
        assert bool((a == b).all()), "parameters differ after resume"
    assert [m["step"] for m in second.metrics] == list(range(11, 21))
    assert second.metrics == straight.metrics[10:]  # identical losses and learning rates
    assert first.metrics == straight.metrics[:10]
    if strategy == "fsdp-sharded":  # one file of shards per rank, plus DCP's metadata
        (state,) = Path(checkpoint).glob("state-*")
        assert sorted(f.name for f in (state / "sharded").iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
        ]


def save_twice_dying_in_the_second(checkpoint: str, victim: int, file_prefix: str) -> None:
    """Save at step 3, then kill ``victim`` while it writes ``file_prefix*`` in the next save."""
    import os

    import torch

    import nbaccel.accel.checkpoints.checkpoint as ckpt

    torch.manual_seed(0)
    acc = nbaccel.Accelerator()
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)

    def train(steps: int) -> None:
        for _ in range(steps):
            with acc.accumulate(model):
                acc.backward(model(torch.ones(2, 4)).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()

    train(3)
    acc.save_state(checkpoint)
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), f"{checkpoint}-expected.pt")
    train(3)
    real_save = torch.save

    def save_or_die(obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if acc.process_index == victim and Path(path).name.startswith(file_prefix):
            with open(path, "wb") as half:  # a torn file, as a crash mid-write leaves
                half.write(b"PK\x03\x04 torn")
            os.kill(os.getpid(), signal.SIGKILL)
        real_save(obj, path, *args, **kwargs)

    ckpt.torch.save = save_or_die  # type: ignore[assignment]
    acc.save_state(checkpoint)


def load_and_report(checkpoint: str) -> dict[str, Any]:
    import torch

    acc = nbaccel.Accelerator()
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    acc.load_state(checkpoint)
    acc.save_state(checkpoint)  # a later save cleans up what the killed one left
    return {"step": acc.step, "state": acc.unwrap_model(model).state_dict()}


@pytest.mark.parametrize(("victim", "file_prefix"), [(0, "optimizer"), (1, "random_states")])
def test_a_rank_killed_during_save_leaves_the_previous_checkpoint_whole(
    tmp_path: Path, runs_dir: str, victim: int, file_prefix: str
) -> None:
    import torch

    checkpoint = tmp_path / "ckpt"
    run = nbaccel.launch(
        save_twice_dying_in_the_second,
        args=(str(checkpoint), victim, file_prefix),
        num_processes=2,
        runs_dir=runs_dir,
    )
    with pytest.raises(nbaccel.WorkerError) as failure:
        run.result(timeout=120)
    assert failure.value.rank == victim and failure.value.signal_name == "SIGKILL"
    assert list(checkpoint.glob(".partial-*")), "the kill should have hit the second save"
    restored = nbaccel.notebook_launcher(
        load_and_report, args=(str(checkpoint),), num_processes=2, runs_dir=runs_dir
    )
    assert restored["step"] == 3
    expected = torch.load(f"{checkpoint}-expected.pt", weights_only=True)
    for name, tensor in expected.items():
        assert bool((restored["state"][name] == tensor).all())
    assert not list(checkpoint.glob(".partial-*"))
    assert len(list(checkpoint.glob("state-*"))) == 1


def save_numbered_with_rank_1_late(project_dir: str, saves: int) -> list[str]:
    """``save()`` ``saves`` times with automatic naming; rank 1 starts each one only after
    rank 0 has started it (rank 0 writes a marker, then calls save_state at once)."""
    import time

    import torch

    from nbaccel.utils import ProjectConfiguration

    project = ProjectConfiguration(
        project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=2
    )
    acc = nbaccel.Accelerator(project_config=project)
    model = acc.prepare(torch.nn.Linear(2, 1))
    acc.backward(model(torch.ones(1, 2)).sum())
    saved = []
    for i in range(saves):
        marker = Path(project_dir) / f"rank0-saving-{i}"
        if acc.process_index == 0:
            marker.touch()
        else:
            deadline = time.monotonic() + 60
            while not marker.exists():  # rank 0 is in save_state by now, or about to be
                assert time.monotonic() < deadline, "rank 0 never started saving"
                time.sleep(0.001)
        saved.append(acc.save_state().parent.name)
    return saved


def test_ranks_agree_on_the_automatic_checkpoint_folder(tmp_path: Path, runs_dir: str) -> None:
    # Before the folder was decided by rank 0 alone, rank 1 found the checkpoint_<n> rank 0
    # had just created and refused: "[rank 1] save_state: ... checkpoint_0 already exists".
    run = nbaccel.launch(
        save_numbered_with_rank_1_late,
        args=(str(tmp_path), 4),
        num_processes=2,
        runs_dir=runs_dir,
        dashboard="text",
    )
    run.wait(timeout=180)
    names = [f"checkpoint_{n}" for n in range(4)]
    assert run.results() == {0: names, 1: names}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == names[2:]
