"""Bad input fails before any process, folder, pipe or port exists (no worker is started)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import nbaccel
from nbaccel.config.schema import Config
from nbaccel.context import ProcessContext
from nbaccel.launcher import api
from nbaccel.launcher.local import start


def train(x: int = 0) -> int:
    return x


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"num_processes": 0}, nbaccel.ConfigError, "num_processes must be >= 1, got 0"),
        ({"num_processes": -1}, nbaccel.ConfigError, "num_processes must be >= 1"),
        ({"num_processes": 1.5}, nbaccel.ConfigError, "must be int or None, got 1.5"),
        ({"num_processes": "2"}, nbaccel.ConfigError, "must be int or None, got '2'"),
        ({"mixed_precision": "fp64"}, nbaccel.ConfigError, "'no', 'fp16', 'bf16'"),
        ({"mixed_precison": "bf16"}, nbaccel.ConfigError, "Did you mean 'mixed_precision'"),
        ({"args": 5}, TypeError, "args must be a tuple or list"),
        ({"args": "ab"}, TypeError, "args=(value,)"),
        ({"kwargs": [1]}, TypeError, "kwargs must be a mapping"),
        ({"dashboard": "fancy"}, nbaccel.ConfigError, "dashboard='fancy'"),
        ({"args": (threading.Lock(),)}, nbaccel.SerializationError, r"args[0] (a lock)"),
    ],
)
def test_bad_input(nothing_started: Path, kwargs: dict, error: type, fragment: str) -> None:
    with pytest.raises(error) as caught:
        nbaccel.notebook_launcher(train, runs_dir=str(nothing_started), **kwargs)
    assert fragment in str(caught.value)


def test_not_callable(nothing_started: Path) -> None:
    with pytest.raises(TypeError, match="Pass the function itself"):
        nbaccel.launch(train(), runs_dir=str(nothing_started))  # type: ignore[arg-type]


def test_more_processes_than_gpus(nothing_started: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "visible_gpu_count", lambda env: 2)
    with pytest.raises(nbaccel.ConfigError, match="only 2 GPU"):
        nbaccel.launch(train, num_processes=4, runs_dir=str(nothing_started))
    assert api.plan_world_size(Config(num_processes=4, use_cpu=True), {}) == 4
    assert api.plan_world_size(Config(), {}) == 2


def test_cpu_default_is_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "visible_gpu_count", lambda env: 0)
    assert api.plan_world_size(Config(), {}) == 1
    assert api.plan_world_size(Config(num_processes=3), {}) == 3


def test_worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "visible_gpu_count", lambda env: 0)
    before = dict(os.environ)
    context = ProcessContext(1, 1, 2, 2, 0, "127.0.0.1", 40123, "r")
    base = {"PATH": "/bin", "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    env = start.worker_env(
        context, Config(mixed_precision="bf16", gradient_accumulation_steps=4), base, on_cpu=True
    )
    assert env["RANK"] == "1" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["NODE_RANK"] == "0"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "40123"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4"
    assert env["ACCELERATE_USE_CPU"] == "true"
    assert env["MPLBACKEND"] == "Agg" and env["PATH"] == "/bin"
    assert int(env["OMP_NUM_THREADS"]) >= 1
    assert base == {"PATH": "/bin", "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    assert dict(os.environ) == before


@pytest.mark.parametrize(
    ("config", "gpus", "installed", "fragment"),
    [
        (Config(strategy="deepspeed"), 1, set(), "needs the deepspeed package"),
        (Config(strategy="deepspeed"), 0, {"deepspeed"}, "none is visible"),
    ],
)
def test_settings_this_machine_cannot_honour(
    config: Config, gpus: int, installed: set, fragment: str
) -> None:
    with pytest.raises(nbaccel.ConfigError, match=fragment):
        api.check_environment(config, gpus, installed.__contains__)
    api.check_environment(config, gpus or 1, {"deepspeed"}.__contains__)


def test_xla_without_torch_xla_fails_before_start(nothing_started: Path) -> None:
    if api._installed("torch_xla"):
        pytest.skip("torch_xla is installed here")
    with pytest.raises(nbaccel.ConfigError, match="needs torch_xla"):
        nbaccel.launch(train, strategy="xla", runs_dir=str(nothing_started))
