"""``save_state()`` with ``ProjectConfiguration(automatic_checkpoint_naming=True)``: the folder
is decided by rank 0 and shared, so the ranks cannot race on it.

The race (seen in one of two identical 2-rank runs): rank 0 creates ``checkpoint_<n>`` as soon
as it starts saving, and a slower rank that checked on its own found it and refused. Here
that rank's view is made deterministically: rank 1, whose ``share`` hands it rank 0's
decision, runs after rank 0 already created the folder. The same with real processes is in
tests/multiprocess/test_accel_checkpoint.py.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from nbaccel import Accelerator
from nbaccel.accel.checkpointing import Checkpoints
from nbaccel.accel.optim import GradientState
from nbaccel.config.accelerate.configs import ProjectConfiguration


def checkpoints_of_rank(
    rank: int, project: ProjectConfiguration, rank0_decides: int | None = None
) -> tuple[Checkpoints, list[int]]:
    """Checkpoints for ``rank`` of two; ``share`` records what this rank offered and returns
    ``rank0_decides`` (rank 0's value; None: this rank's own)."""
    offered: list[int] = []

    def share(value: int) -> int:
        offered.append(value)
        return value if rank0_decides is None else rank0_decides

    state = types.SimpleNamespace(is_main_process=rank == 0, rank=rank, world_size=2)
    prepared: Any = types.SimpleNamespace(strategy=types.SimpleNamespace(state=state, share=share))
    return Checkpoints(prepared, GradientState(), project), offered


def project(tmp_path: Path, **settings: Any) -> ProjectConfiguration:
    return ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, **settings
    )


def test_a_rank_that_finds_rank_0s_new_folder_saves_into_it(tmp_path: Path) -> None:
    rank0, _ = checkpoints_of_rank(0, project(tmp_path))
    folder = rank0._next_automatic_folder()
    folder.mkdir(parents=True)  # rank 0 has started saving: its folder exists
    rank1, offered = checkpoints_of_rank(1, project(tmp_path), rank0_decides=0)
    assert rank1._next_automatic_folder() == folder == tmp_path / "checkpoints" / "checkpoint_0"
    assert len(offered) == 1  # it took rank 0's decision, through one collective
    assert rank0.project.iteration == rank1.project.iteration == 1


def test_a_folder_that_exists_before_the_save_is_refused_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "checkpoint_0").mkdir(parents=True)
    rank0, offered = checkpoints_of_rank(0, project(tmp_path))
    with pytest.raises(ValueError, match="checkpoint_0 already exists"):
        rank0._next_automatic_folder()
    # Rank 0 shared its refusal: the others raise the same instead of waiting in the save.
    rank1, _ = checkpoints_of_rank(1, project(tmp_path), rank0_decides=offered[0])
    with pytest.raises(ValueError, match="checkpoint_0 already exists"):
        rank1._next_automatic_folder()


def test_only_rank_0_prunes_past_total_limit(tmp_path: Path) -> None:
    for n in range(3):
        (tmp_path / "checkpoints" / f"checkpoint_{n}").mkdir(parents=True)
    rank1, _ = checkpoints_of_rank(1, project(tmp_path, total_limit=2, iteration=3), 3)
    rank1._next_automatic_folder()
    assert len(list((tmp_path / "checkpoints").iterdir())) == 3  # rank 1 removed nothing
    rank0, _ = checkpoints_of_rank(0, project(tmp_path, total_limit=2, iteration=3))
    assert rank0._next_automatic_folder().name == "checkpoint_3"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_2"]


def test_one_process_numbers_its_saves_and_keeps_total_limit(tmp_path: Path) -> None:
    acc = Accelerator(project_config=project(tmp_path, total_limit=2))
    saved = [acc.save_state() for _ in range(3)]
    assert [p.parent.name for p in saved] == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["checkpoint_1", "checkpoint_2"]
