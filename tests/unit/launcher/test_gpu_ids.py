"""``gpu_ids`` in the planning of a launch: which GPUs the workers see (their
``CUDA_VISIBLE_DEVICES``), how many processes start by default, and every bad value refused
before anything starts. No process is started: the GPU count is faked where it is read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import nbaccel
from nbaccel.config.schema import Config
from nbaccel.context import ProcessContext
from nbaccel.errors import ConfigError
from nbaccel.hardware.devices import GpuChoice, choose_gpus
from nbaccel.launcher import api
from nbaccel.launcher.local.start import worker_env
from nbaccel.launcher.planned import Planned
from nbaccel.launcher.remote.hosts_launch import local_worker_env


def train() -> str:
    return os.environ["CUDA_VISIBLE_DEVICES"]


# ----- choosing: the indices count among the GPUs the kernel sees, as CUDA counts --------------
@pytest.mark.parametrize(
    ("gpu_ids", "kernel", "visible", "chosen"),
    [
        ("all", None, 4, GpuChoice(4, None)),
        ("2,0", None, 4, GpuChoice(2, "2,0")),
        ("0,2", "4,5,6", 3, GpuChoice(2, "4,6")),
        ("1", "GPU-aaaa,MIG-bbbb", 2, GpuChoice(1, "MIG-bbbb")),
        ("1,0", "3,2,-1,7", 2, GpuChoice(2, "2,3")),  # CUDA ignores entries from "-1" on
        ("1", None, None, GpuChoice(0, "1")),  # CPU processes: no GPU counted, still narrowed
        ("all", "3", None, GpuChoice(0, None)),
    ],
)
def test_the_chosen_gpus(
    gpu_ids: str, kernel: str | None, visible: int | None, chosen: Any
) -> None:
    env = {} if kernel is None else {"CUDA_VISIBLE_DEVICES": kernel}
    assert choose_gpus(gpu_ids, env, visible=visible) == chosen


@pytest.mark.parametrize(
    ("gpu_ids", "kernel", "visible", "fragment"),
    [
        ("2", None, 2, "names GPU 2, but 2 GPU(s) are visible here (indices 0-1)."),
        ("0,3", "4,5,6", 3, "(indices 0-2, counted among CUDA_VISIBLE_DEVICES=4,5,6)"),
        ("0", None, 0, "picks GPUs, but no GPU is visible here (CUDA_VISIBLE_DEVICES=unset)"),
        ("3", "4,5", None, "names GPU 3, but 2 GPU(s) are visible here"),  # CPU run: known
        ("0", "", None, "but 0 GPU(s) are visible here (none, counted among"),
    ],
)
def test_ids_beyond_the_visible_gpus_are_refused(
    gpu_ids: str, kernel: str | None, visible: int | None, fragment: str
) -> None:
    env = {} if kernel is None else {"CUDA_VISIBLE_DEVICES": kernel}
    with pytest.raises(ConfigError) as caught:
        choose_gpus(gpu_ids, env, visible=visible, source="file:x.yaml")
    assert fragment in str(caught.value) and "(from file:x.yaml)" in str(caught.value)
    assert caught.value.field == "gpu_ids"


# ----- planning a launch ----------------------------------------------------------------------
class Stop(Exception):
    def __init__(self, planned: Planned) -> None:
        self.planned = planned


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Fakes the GPUs the kernel sees; returns a function planning a launch (not started)."""

    def stop(plan: Planned, *, show: Any) -> Any:
        raise Stop(plan)

    monkeypatch.setattr(api, "start_plan", stop)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def plan(count: int, runs_dir: Path, **options: Any) -> Planned:
        monkeypatch.setattr(api, "visible_gpu_count", lambda env: count)
        with pytest.raises(Stop) as stopped:
            nbaccel.launch(train, runs_dir=str(runs_dir), dashboard=False, **options)
        return stopped.value.planned

    return plan


def test_the_workers_see_only_the_chosen_gpus_and_their_number_is_the_default(
    gpus: Any, tmp_path: Path
) -> None:
    planned = gpus(4, tmp_path, gpu_ids="3,1")
    assert (planned.world_size, planned.gpus) == (2, 2)  # default: one process per id
    assert planned.env["CUDA_VISIBLE_DEVICES"] == "3,1"
    for rank in range(2):  # each worker's env: rank r uses cuda:r, the r-th id
        context = ProcessContext(rank, rank, 2, 2, 0, "127.0.0.1", 40123, planned.run_id)
        env = worker_env(context, planned.resolved.config, planned.env, on_cpu=False)
        assert env["CUDA_VISIBLE_DEVICES"] == "3,1" and env["LOCAL_RANK"] == str(rank)
        assert "ACCELERATE_USE_CPU" not in env
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # the kernel's own env is untouched


def test_the_kernels_cuda_visible_devices_keeps_working(
    gpus: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert gpus(3, tmp_path).env["CUDA_VISIBLE_DEVICES"] == "4,5,6"  # all: the kernel's
    assert gpus(3, tmp_path).world_size == 3
    planned = gpus(3, tmp_path, gpu_ids="2,0")
    assert (planned.env["CUDA_VISIBLE_DEVICES"], planned.world_size) == ("6,4", 2)
    with pytest.raises(ConfigError, match=r"names GPU 3, but 3 GPU\(s\) are visible"):
        gpus(3, tmp_path, gpu_ids="3")


def test_fewer_processes_than_ids_use_the_first_ones(gpus: Any, tmp_path: Path) -> None:
    planned = gpus(4, tmp_path, gpu_ids="2,3", num_processes=1)
    assert (planned.world_size, planned.env["CUDA_VISIBLE_DEVICES"]) == (1, "2,3")


@pytest.mark.parametrize(
    ("count", "options", "fragment"),
    [
        (4, {"gpu_ids": "0,1", "num_processes": 3}, "but gpu_ids='0,1' names 2 GPU(s), one for"),
        (2, {"gpu_ids": "0,2"}, "names GPU 2, but 2 GPU(s) are visible here"),
        (0, {"gpu_ids": "0"}, "picks GPUs, but no GPU is visible here"),
        (4, {"gpu_ids": "1,x"}, "holds 'x', which is not a GPU index"),
        (4, {"gpu_ids": "1,1"}, "names GPU 1 twice"),
    ],
)
def test_bad_values_fail_before_anything_starts(
    gpus: Any, nothing_started: Path, count: int, options: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        gpus(count, nothing_started, **options)
    assert fragment in str(caught.value)


def test_cpu_processes_count_no_gpu_but_still_see_only_those_named(
    gpus: Any, tmp_path: Path
) -> None:
    planned = gpus(4, tmp_path, gpu_ids="1", use_cpu=True)
    assert (planned.world_size, planned.gpus) == (1, 0)  # a CPU run's default: one process
    assert planned.env["CUDA_VISIBLE_DEVICES"] == "1"


def test_restarts_and_machines_of_a_job_narrow_their_workers_too(gpus: Any, tmp_path: Path) -> None:
    planned = gpus(4, tmp_path, gpu_ids="2,3", max_restarts=1)  # an agent here
    assert planned.placement is not None and planned.world_size == 2
    assert local_worker_env(planned.resolved.config, planned)["CUDA_VISIBLE_DEVICES"] == "2,3"
    job = gpus(4, tmp_path, gpu_ids="1", num_machines=2, main_process_port=29531)
    assert (job.world_size, job.env["CUDA_VISIBLE_DEVICES"]) == (2, "1")  # one per machine
    with pytest.raises(ConfigError, match="gpu_ids='1' names 1 GPU"):
        gpus(4, tmp_path, gpu_ids="1", num_machines=2, num_processes=4)


def test_the_panel_and_plan_world_size_follow_the_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "visible_gpu_count", lambda env: 4)
    assert api.plan_world_size(Config(gpu_ids="0,2,3"), {}) == 3
    assert api.plan_world_size(Config(gpu_ids="1,0"), {}, visible=2) == 2  # counted already
    with pytest.raises(ConfigError, match="names GPU 3"):
        api.plan_world_size(Config(gpu_ids="0,2,3"), {}, visible=3)
