"""Accelerate's positional form: ``notebook_launcher(fn, args, 2, "bf16")`` means what it
means in ``accelerate.notebook_launcher`` (its parameters, in its order), and goes through
the same mapping onto the config, with the same errors, as the keywords."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

import nbaccel
from nbaccel.config.accelerate.launcher_keywords import POSITIONAL
from nbaccel.launcher import api
from nbaccel.launcher.planned import Planned

accelerate = pytest.importorskip("accelerate")


def train(scale: int = 1) -> int:
    return scale


def parameters(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.mark.parametrize("launcher", [nbaccel.notebook_launcher, nbaccel.launch])
def test_the_launchers_take_accelerates_parameters_in_its_order(launcher: Any) -> None:
    theirs = parameters(accelerate.notebook_launcher)
    assert parameters(launcher)[: len(theirs)] == theirs
    assert theirs[3:] == list(POSITIONAL)
    # Everything after them is keyword-only: no positional slot that Accelerate lacks.
    extra = inspect.signature(launcher).parameters[parameters(launcher)[len(theirs)]]
    assert extra.kind is inspect.Parameter.KEYWORD_ONLY


def test_debug_launcher_takes_accelerates_parameters_in_its_order() -> None:
    assert parameters(nbaccel.debug_launcher) == parameters(accelerate.debug_launcher)


class Stop(Exception):
    """Raised instead of starting workers, with what would have started."""

    def __init__(self, planned: Planned) -> None:
        self.planned = planned


def planned(monkeypatch: pytest.MonkeyPatch, launcher: Any, *args: Any, **kwargs: Any) -> Planned:
    """The checked plan of a launch, stopped before any process starts."""

    def stop(plan: Planned, *, show: Any) -> Any:
        raise Stop(plan)

    monkeypatch.setattr(api, "start_plan", stop)
    with pytest.raises(Stop) as stopped:
        launcher(*args, dashboard=False, **kwargs)
    return stopped.value.planned


# A value for each of Accelerate's parameters after num_processes, and what it sets.
ONE_MACHINE = {
    "mixed_precision": ("bf16", "mixed_precision", "bf16"),
    "use_port": ("29511", "main_process_port", 29511),
    "master_addr": ("localhost", "main_process_ip", "localhost"),
    "node_rank": (0, "machine_rank", 0),
    "num_nodes": (1, "num_machines", 1),
    "max_restarts": (0, "max_restarts", 0),
}


@pytest.mark.parametrize("launcher", [nbaccel.notebook_launcher, nbaccel.launch])
@pytest.mark.parametrize("name", list(ONE_MACHINE))
def test_each_positional_argument_lands_where_accelerate_puts_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, launcher: Any, name: str
) -> None:
    value, field, expected = ONE_MACHINE[name]
    position = POSITIONAL.index(name)
    before = [None] * position  # the parameters before it, not given
    plan = planned(monkeypatch, launcher, train, (3,), 2, *before, value, runs_dir=str(tmp_path))
    assert getattr(plan.resolved.config, field) == expected
    assert plan.resolved.sources[field] == "argument"
    assert plan.world_size == 2


def test_mixed_precision_from_the_fourth_and_use_port_from_the_fifth(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    plan = planned(
        monkeypatch, nbaccel.notebook_launcher, train, (3,), 2, "bf16", "29512",
        runs_dir=str(tmp_path),
    )  # fmt: skip
    config = plan.resolved.config
    assert (config.mixed_precision, config.main_process_port) == ("bf16", 29512)
    assert config.num_processes == 2


def test_the_per_node_form_positionally_counts_processes_per_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, Any] = {}

    def start(*args: Any, show: Any, keep: Any = None) -> Any:
        seen["num_processes"], seen["overrides"] = args[2], args[5]
        raise Stop(None)  # type: ignore[arg-type]

    monkeypatch.setattr("nbaccel.launching.start", start)
    with pytest.raises(Stop):
        nbaccel.notebook_launcher(train, (), 2, "no", "29400", "10.0.0.1", 1, 2, "static")
    assert seen["overrides"] == {
        "mixed_precision": "no",
        "use_port": "29400",
        "master_addr": "10.0.0.1",
        "node_rank": 1,
        "num_nodes": 2,
        "rdzv_backend": "static",
    }


def test_values_left_out_keep_the_files_and_envs_values(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Accelerate's defaults ("no", port "29500") are not applied when the argument is absent.
    monkeypatch.setenv("NBACCEL_MIXED_PRECISION", "fp16")
    plan = planned(monkeypatch, nbaccel.launch, train, (), 2, runs_dir=str(tmp_path))
    assert plan.resolved.config.mixed_precision == "fp16"
    assert plan.resolved.config.main_process_port is None


@pytest.mark.parametrize(
    ("position", "value", "fragment"),
    [
        (POSITIONAL.index("mixed_precision"), "fp64", "mixed_precision='fp64' is not one of"),
        (POSITIONAL.index("use_port"), "http", "main_process_port must be int"),
        (POSITIONAL.index("rdzv_backend"), "etcd", "rdzv_backend='etcd' is not available"),
        (POSITIONAL.index("rdzv_id"), "job7", "rdzv_id='job7': nbaccel names each run"),
        (POSITIONAL.index("log_line_prefix_template"), "${rank}", "labels each rank's lines"),
    ],
)
def test_positional_values_get_the_keywords_errors(
    nothing_started: Path, position: int, value: Any, fragment: str
) -> None:
    before = [None] * position
    with pytest.raises(nbaccel.ConfigError) as caught:
        nbaccel.notebook_launcher(
            train, (1,), 2, *before, value, runs_dir=str(nothing_started), dashboard=False
        )
    assert fragment in str(caught.value)


def test_too_many_positional_arguments_is_a_clear_type_error(nothing_started: Path) -> None:
    everything = [None] * len(POSITIONAL)
    with pytest.raises(TypeError, match="takes from 1 to 15 positional arguments but 16"):
        nbaccel.notebook_launcher(train, (), 2, *everything, "one too many")
    with pytest.raises(TypeError, match="multiple values for argument 'mixed_precision'"):
        nbaccel.launch(train, (), 2, "bf16", mixed_precision="fp16")  # type: ignore[misc]


def test_debug_launcher_takes_its_count_positionally(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: dict[str, Any] = {}

    def start(*args: Any, show: Any, keep: Any = None) -> Any:
        seen["num_processes"], seen["overrides"] = args[2], args[5]
        raise Stop(None)  # type: ignore[arg-type]

    monkeypatch.setattr("nbaccel.launching.start", start)
    with pytest.raises(Stop):
        nbaccel.debug_launcher(train, (1,), 3)
    assert seen == {"num_processes": 3, "overrides": {"use_cpu": True, "mixed_precision": "no"}}
