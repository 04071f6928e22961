"""`nbaccel launch` on several machines: what torch elastic is asked to start on this one.

torch's ``elastic_launch`` is replaced by a recorder, so no process starts: the test reads
the ``LaunchConfig`` it would have been given.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nbaccel.cli import main

torch_launcher = pytest.importorskip("torch.distributed.launcher.api")


@pytest.fixture
def launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Runs in a fresh folder and HOME; collects every LaunchConfig elastic would get."""
    for var in list(os.environ):
        if var.startswith(("NBACCEL_", "ACCELERATE_")):
            monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hello')\n")
    configs: list[Any] = []

    def record(config: Any, entrypoint: str) -> Callable[..., None]:
        configs.append(config)
        return lambda *args: None

    monkeypatch.setattr(torch_launcher, "elastic_launch", record)
    return configs


COMMON = ["launch", "--use_cpu", "true", "--num_machines", "2", "--main_process_port", "29999"]


def test_num_processes_is_the_total_over_the_machines(launched: list[Any]) -> None:
    assert main([*COMMON, "--num_processes", "4", "train.py"]) == 0
    [config] = launched
    assert (config.nproc_per_node, config.min_nodes, config.max_nodes) == (2, 2, 2)


@pytest.mark.parametrize("spelling", ["--nproc_per_node", "--nproc-per-node"])
def test_nproc_per_node_is_this_machines_share(launched: list[Any], spelling: str) -> None:
    assert main([*COMMON, spelling, "2", "train.py"]) == 0
    [config] = launched
    assert config.nproc_per_node == 2  # 4 processes in all


def test_unset_num_processes_is_one_per_machine_on_cpu(launched: list[Any]) -> None:
    assert main([*COMMON, "train.py"]) == 0
    assert launched[0].nproc_per_node == 1


def test_a_total_that_does_not_split_starts_nothing(
    launched: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*COMMON, "--num_processes", "3", "train.py"]) == 2
    assert launched == [] and not (tmp_path / "nbaccel_runs").exists()
    assert "num_processes=3 cannot be split evenly over num_machines=2" in capsys.readouterr().err


def test_max_restarts_reaches_torch_elastic(launched: list[Any]) -> None:
    assert main([*COMMON, "--num_processes", "4", "--max_restarts", "2", "train.py"]) == 0
    assert launched[0].max_restarts == 2
    assert main([*COMMON, "--num_processes", "4", "train.py"]) == 0
    assert launched[1].max_restarts == 0  # the default: a failure ends the job
