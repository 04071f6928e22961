"""What a launch resumes from, settled in the kernel before any process: the newest complete
checkpoint of the local root and its durable copy; errors for an explicit place without one."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nbaccel.config.resolve import Resolved
from nbaccel.config.schema import Config
from nbaccel.durable.staging import checkpoint_places
from nbaccel.errors import ConfigError
from nbaccel.launcher.long_runs.settle import settle


def train() -> None:
    """A training function: its name names the default checkpoint folder."""


def resolved(**values: object) -> Resolved:
    return Resolved(Config.replace(Config(), **values), {})


def write_state(root: Path, steps: int, saved_at: float) -> None:
    name = f"state-{steps:09d}-x"
    (root / name).mkdir(parents=True)
    meta = {
        "format": 1,
        "world_size": 2,
        "progress": {"completed_steps": steps},
        "saved_at": saved_at,
    }
    (root / name / "meta.json").write_text(json.dumps(meta))
    (root / "LATEST").write_text(name + "\n")


def test_the_default_place_is_per_function_and_resume_auto_finds_it(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    fresh, notes = settle(resolved(runs_dir=str(runs), resume="auto"), train)
    assert fresh.config.checkpoint.dir == str(runs / "checkpoints" / "train")
    assert fresh.config.resume == "never" and "no complete checkpoint" in notes[0]
    write_state(runs / "checkpoints" / "train", 1200, time.time() - 720)
    again, notes = settle(resolved(runs_dir=str(runs), resume="auto"), train)
    assert again.config.resume == str(runs / "checkpoints" / "train")
    assert notes == [
        f"resuming at step 1,200 from {runs}/checkpoints/train/state-000001200-x (saved 12 min ago)"
    ]


def test_resume_auto_takes_the_durable_copy_when_it_is_further_along(tmp_path: Path) -> None:
    runs, durable = tmp_path / "runs", tmp_path / "drive" / "ckpt"
    local, target = checkpoint_places(str(durable), runs)
    assert target == str(durable)
    write_state(local, 100, time.time())
    write_state(durable, 300, time.time())
    settled, notes = settle(
        resolved(runs_dir=str(runs), checkpoint_dir=str(durable), resume="auto"), train
    )
    assert settled.config.resume == str(durable) and "step 300" in notes[0]


def test_an_explicit_resume_without_a_checkpoint_is_refused_before_anything(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        settle(resolved(runs_dir=str(tmp_path), resume=str(tmp_path / "none")), train)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "LATEST").write_text("../../etc\n")
    with pytest.raises(ConfigError, match="resume="):
        settle(resolved(runs_dir=str(tmp_path), resume=str(tmp_path / "bad")), train)
