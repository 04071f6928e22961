"""The command line's own entry: ``python -m nbaccel``, and how many processes the demo runs."""

from __future__ import annotations

import importlib
import subprocess
import sys
from typing import Any

import pytest

import nbaccel

cli_main = importlib.import_module("nbaccel.cli.main")


def test_python_dash_m_nbaccel_is_the_command_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nbaccel", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: nbaccel ")
    assert "demo" in result.stdout and "launch" in result.stdout


def test_python_dash_m_nbaccel_reports_bad_input_as_the_script_does() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nbaccel", "nonsense"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "invalid choice: 'nonsense'" in result.stderr


def demo(monkeypatch: pytest.MonkeyPatch, gpus: int, *argv: str) -> dict[str, Any]:
    """Run ``nbaccel demo`` with ``gpus`` visible and the launch replaced: what it asked."""
    asked: dict[str, Any] = {}

    def launcher(function: Any, **kwargs: Any) -> dict[str, int]:
        asked.update(kwargs)
        return {"world_size": kwargs["num_processes"] or gpus}

    monkeypatch.setattr("nbaccel.hardware.devices.visible_gpu_count", lambda env: gpus)
    monkeypatch.setattr(nbaccel, "notebook_launcher", launcher, raising=False)
    assert cli_main.main(["demo", *argv]) == 0
    return asked


def test_the_demo_says_it_runs_two_cpu_processes_where_a_launch_would_run_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked = demo(monkeypatch, 0)
    assert asked["num_processes"] == 2 and asked["use_cpu"] is True
    first = capsys.readouterr().out.splitlines()[0]
    assert "2 CPU processes (no GPU is visible; a launch would run 1;" in first


def test_the_demo_takes_the_launch_default_on_gpus_and_a_count_when_given(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # One GPU: one process (it asked for 2 before, which the launch refuses on one GPU).
    assert demo(monkeypatch, 1)["num_processes"] is None
    assert "one process per GPU" in capsys.readouterr().out
    assert demo(monkeypatch, 0, "--num_processes", "3")["num_processes"] == 3
    assert "3 CPU processes;" in capsys.readouterr().out
