"""Background saves: a rank that never writes its part leaves LATEST where it was; the
snapshot is a copy, so training on at once does not change what is written."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from nbaccel.accel.checkpoints import checkpoint
from nbaccel.accel.checkpoints.background_save import BackgroundWrite, take_snapshot


def stateful(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> checkpoint.Stateful:
    return checkpoint.Stateful(
        models=[model],
        optimizers=[optimizer],
        schedulers=[],
        dataloaders=[],
        scaler=None,
        custom=[],
    )


def test_the_snapshot_is_written_as_taken_while_training_goes_on(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    snap = take_snapshot(
        stateful(model, optimizer), rank=0, world_size=1, progress={"completed_steps": 5}
    )
    with torch.no_grad():
        model.weight.add_(1.0)  # the next step changes the parameters in place
    write = BackgroundWrite(
        tmp_path, "000000005-x", snap, rank=0, world_size=1, keep=2, deadline=time.monotonic() + 30
    )
    assert write.join(30) and write.error is None and write.published
    state = checkpoint.find_checkpoint(tmp_path)
    assert state.name == "state-000000005-x"
    saved = torch.load(state / "model_0.pt", weights_only=True)
    assert torch.equal(saved["weight"], before)
    assert json.loads((state / "meta.json").read_text())["progress"]["completed_steps"] == 5
    assert not list(state.glob("done-*"))


def test_a_rank_that_never_writes_its_part_leaves_latest_on_the_previous_state(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    objects = stateful(model, optimizer)

    def save(name: str, world: int, deadline: float) -> BackgroundWrite:
        snap = take_snapshot(objects, rank=0, world_size=world, progress={"completed_steps": 1})
        return BackgroundWrite(
            tmp_path, name, snap, rank=0, world_size=world, keep=2, deadline=deadline
        )

    first = save("000000001-x", 1, time.monotonic() + 30)
    assert first.join(30) and first.published
    # Two ranks, but rank 1's part never comes: rank 0 gives up at the deadline.
    second = save("000000002-x", 2, time.monotonic() + 0.3)
    assert second.join(30)
    assert isinstance(second.error, TimeoutError) and "ranks [1]" in str(second.error)
    assert (tmp_path / "LATEST").read_text().strip() == "state-000000001-x"
    assert checkpoint.find_checkpoint(tmp_path).name == "state-000000001-x"


def test_keep_leaves_the_newest_states(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    objects = stateful(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(1, 5):
        snap = take_snapshot(objects, rank=0, world_size=1, progress={"completed_steps": step})
        write = BackgroundWrite(
            tmp_path,
            f"{step:09d}-x",
            snap,
            rank=0,
            world_size=1,
            keep=2,
            deadline=time.monotonic() + 30,
        )
        assert write.join(30) and write.published
    assert sorted(p.name for p in tmp_path.glob("state-*")) == [
        "state-000000003-x",
        "state-000000004-x",
    ]
