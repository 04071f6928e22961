"""Bad input from the hardening probe: each fails before any process, folder, pipe or port
exists, with an error naming the field or argument (``nothing_started`` checks the rest)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import nbaccel
from nbaccel.launcher import api, checks


def train(lr: float, epochs: int = 1) -> float:
    return lr * epochs


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"main_process_port": 70000}, nbaccel.ConfigError, "main_process_port must be <= 65535"),
        ({"main_process_port": 0}, nbaccel.ConfigError, "main_process_port must be >= 1"),
        ({"collective_timeout": float("nan")}, nbaccel.ConfigError, "collective_timeout must be"),
        ({"collective_timeout": float("inf")}, nbaccel.ConfigError, "finite number, got inf"),
        ({"rdzv_timeout": float("nan")}, nbaccel.ConfigError, "rdzv_timeout must be a finite"),
        ({"max_grad_norm": float("inf")}, nbaccel.ConfigError, "max_grad_norm must be a finite"),
        ({"config": 42}, nbaccel.ConfigError, "config= got int 42"),
        ({"config": ["num_processes", 2]}, nbaccel.ConfigError, "a mapping of field names"),
        ({"log_ranks": "0,5"}, nbaccel.ConfigError, "names rank 5, but this run has 2"),
        ({"args": ()}, TypeError, "missing a required argument: 'lr'"),
        ({"args": (1.0, 2, 3)}, TypeError, "too many positional arguments"),
        ({"kwargs": {"epoch": 2}}, TypeError, "unexpected keyword argument 'epoch'"),
        (
            {"num_machines": 2, "detach": True},
            nbaccel.ConfigError,
            "num_machines=2 (from argument) joins the machines of a job through torch elastic",
        ),
        ({"main_process_ip": "192.0.2.7"}, nbaccel.ConfigError, "keeps every socket on loopback"),
    ],
)
def test_refused_before_anything_starts(
    nothing_started: Path, kwargs: dict, error: type, fragment: str
) -> None:
    kwargs = {"args": (0.1,), "num_processes": 2, **kwargs}
    with pytest.raises(error) as caught:
        nbaccel.launch(train, runs_dir=str(nothing_started), **kwargs)
    assert fragment in str(caught.value)


def test_machine_rank_refused_and_env_named_as_source(
    nothing_started: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NBACCEL_NUM_MACHINES", "3")
    with pytest.raises(nbaccel.ConfigError, match=r"num_machines=3 \(from env:NBACCEL_NUM_"):
        nbaccel.launch(train, args=(1.0,), runs_dir=str(nothing_started), detach=True)
    monkeypatch.delenv("NBACCEL_NUM_MACHINES")
    for loopback in ("127.0.0.1", "localhost", "::1"):
        checks.check_one_machine(nbaccel.resolve({"main_process_ip": loopback}, env={}))


def test_runs_dir_that_is_a_file(nothing_started: Path, tmp_path: Path) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder")
    for runs_dir in (a_file, a_file / "runs"):
        with pytest.raises(nbaccel.ConfigError, match=r"runs_dir=.*cannot hold this run's folder"):
            nbaccel.launch(train, args=(1.0,), runs_dir=str(runs_dir))
    assert a_file.read_text() == "not a folder"


def test_project_dir_that_is_a_file(nothing_started: Path, tmp_path: Path) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    for project_dir, why in ((a_file, "it is a file"), (a_file / "sub", "is a file, so no")):
        with pytest.raises(nbaccel.ConfigError, match=rf"project_dir=.*{why}"):
            nbaccel.launch(
                train, args=(1.0,), runs_dir=str(nothing_started), project_dir=str(project_dir)
            )


def test_oversubscription_refused_unless_allowed(
    nothing_started: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api, "visible_gpu_count", lambda env: 0)
    monkeypatch.setattr(api, "usable_cpu_cores", lambda: 2)
    with pytest.raises(nbaccel.ConfigError, match="17 CPU processes on 2 core"):
        nbaccel.launch(train, args=(1.0,), num_processes=17, runs_dir=str(nothing_started))
    assert api.plan_world_size(nbaccel.Config(num_processes=16), {}) == 16
    allowed = nbaccel.Config(num_processes=17, allow_oversubscribe=True)
    assert api.plan_world_size(allowed, {}) == 17
    monkeypatch.setattr(api, "visible_gpu_count", lambda env: 2)  # GPUs bound it instead
    with pytest.raises(nbaccel.ConfigError, match="only 2 GPU"):
        api.plan_world_size(nbaccel.Config(num_processes=17), {})


def test_busy_main_process_port_refused(nothing_started: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        with pytest.raises(nbaccel.ConfigError, match=f"main_process_port={port} .*cannot be"):
            nbaccel.launch(
                train, args=(1.0,), main_process_port=port, runs_dir=str(nothing_started)
            )


def test_signature_check_passes_what_binds() -> None:
    checks.check_signature(train, (1.0,), {"epochs": 3})
    checks.check_signature(print, (1, 2, 3), {"sep": "-"})
    checks.check_signature(lambda *a, **k: None, (1,), {"x": 2})
    expected = r"train\(lr, epochs=1\) cannot be called with 0 positional .* keyword\(s\) 'epochs'"
    with pytest.raises(TypeError, match=expected):
        checks.check_signature(train, (), {"epochs": 3})


def test_a_machine_of_a_job_with_more_processes_than_gpus(
    nothing_started: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Accelerate's per-node form counts num_processes per machine: 3 here, over 2 GPUs.
    monkeypatch.setattr(api, "visible_gpu_count", lambda env: 2)
    with pytest.raises(nbaccel.ConfigError) as caught:
        nbaccel.notebook_launcher(train, (0.1,), num_processes=3, num_nodes=2, node_rank=0)
    assert caught.value.field == "num_processes"
    assert "asks for 3 process(es) on this machine, but only 2 GPU(s)" in str(caught.value)
    assert "Use num_processes<=4" in str(caught.value)  # over all machines, as it now means


def test_elastic_clash_names_the_field_that_asked(nothing_started: Path) -> None:
    with pytest.raises(nbaccel.ConfigError) as caught:
        nbaccel.launch(
            train,
            args=(0.1,),
            num_processes=2,
            max_restarts=1,
            detach=True,
            runs_dir=str(nothing_started),
        )
    assert caught.value.field == "max_restarts"
