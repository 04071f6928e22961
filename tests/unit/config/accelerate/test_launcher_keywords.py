"""Accelerate's notebook_launcher keywords: mapped onto the schema, or refused by name."""

from __future__ import annotations

import inspect
import math
import socket
from pathlib import Path
from typing import Any

import pytest

import nbaccel
from nbaccel.config.accelerate.launcher_keywords import (
    ACCELERATE_KEYWORDS,
    from_accelerate_keywords,
    processes_in_total,
)
from nbaccel.config.schema import options

accelerate = pytest.importorskip("accelerate")


def accelerate_defaults() -> dict[str, Any]:
    """Every keyword of accelerate.notebook_launcher past num_processes, at its default."""
    signature = inspect.signature(accelerate.notebook_launcher)
    skipped = ("function", "args", "num_processes")
    return {name: p.default for name, p in signature.parameters.items() if name not in skipped}


def test_every_accelerate_keyword_is_known() -> None:
    fields = {opt.name for opt in options()}
    unknown = [k for k in accelerate_defaults() if k not in fields and k not in ACCELERATE_KEYWORDS]
    assert unknown == []


def test_accelerates_defaults_mean_one_machine_on_its_port() -> None:
    mapped = from_accelerate_keywords(accelerate_defaults())
    assert mapped == {
        "mixed_precision": "no",
        "main_process_port": 29500,
        "main_process_ip": "127.0.0.1",
        "machine_rank": 0,
        "num_machines": 1,
        "max_restarts": 0,
    }
    config = nbaccel.resolve(mapped, env={}).config
    assert (config.main_process_port, config.num_machines) == (29500, 1)


def test_max_restarts_is_the_schema_field_with_its_source() -> None:
    mapped = from_accelerate_keywords({"max_restarts": 2})
    assert mapped == {"max_restarts": 2}
    resolved = nbaccel.resolve(mapped, env={})
    assert resolved.config.max_restarts == 2
    assert resolved.sources["max_restarts"] == "argument"
    assert nbaccel.resolve({}, env={"NBACCEL_MAX_RESTARTS": "3"}).config.max_restarts == 3
    with pytest.raises(nbaccel.ConfigError, match="max_restarts"):
        nbaccel.resolve({"max_restarts": -1}, env={})


def test_renamed_keywords_show_their_source() -> None:
    resolved = nbaccel.resolve(from_accelerate_keywords({"use_port": "29511"}), env={})
    assert resolved.config.main_process_port == 29511
    assert resolved.sources["main_process_port"] == "argument"


@pytest.mark.parametrize(
    ("given", "fragment"),
    [
        ({"rdzv_backend": "etcd"}, "rdzv_backend='etcd' is not available"),
        ({"rdzv_endpoint": "node1"}, "rdzv_endpoint='node1' is not 'host:port'"),
        ({"rdzv_endpoint": "node1:29400", "use_port": "29400"}, "Both rdzv_endpoint= and use_port"),
        ({"num_nodes": 2, "rdzv_backend": "c10d"}, "lets torch elastic order the machines"),
        ({"rdzv_conf": {"timeout": 9}}, "rdzv_conf={'timeout': 9} is not available"),
        ({"rdzv_id": "job7"}, "rdzv_id='job7': nbaccel names each run itself"),
        ({"log_line_prefix_template": "${rank}"}, "nbaccel labels each rank's lines"),
        ({"monitor_interval": 0}, "monitor_interval must be a finite number > 0"),
        ({"monitor_interval": math.nan}, "monitor_interval must be a finite number > 0"),
        ({"monitor_interval": "fast"}, "monitor_interval must be a number"),
        ({"use_port": "29511", "main_process_port": 29512}, "Both use_port="),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(given: dict[str, Any], fragment: str) -> None:
    with pytest.raises(nbaccel.ConfigError) as caught:
        from_accelerate_keywords(given)
    assert fragment in str(caught.value)
    assert caught.value.field in given


def test_elastic_values_nbaccel_already_meets_are_accepted() -> None:
    given = {"rdzv_backend": "c10d", "monitor_interval": 5.0, "rdzv_conf": {}}
    assert from_accelerate_keywords(given) == {}


def test_accelerates_per_node_form_maps_onto_the_schema() -> None:
    given = {"num_nodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "use_port": "29400"}
    mapped = from_accelerate_keywords({**given, "rdzv_backend": "static", "rdzv_id": "none"})
    assert mapped == {
        "num_machines": 2,
        "machine_rank": 1,
        "main_process_ip": "10.0.0.1",
        "main_process_port": 29400,
    }
    # Accelerate's notebook_launcher counts num_processes per node (its nproc_per_node).
    assert processes_in_total(2, given) == 4
    assert processes_in_total(2, {"num_machines": 2}) == 2  # nbaccel's field: a total
    endpoint = from_accelerate_keywords({"num_nodes": 2, "rdzv_endpoint": "10.0.0.1:29400"})
    assert endpoint == {
        "num_machines": 2,
        "main_process_ip": "10.0.0.1",
        "main_process_port": 29400,
    }


def train(scale: int) -> int:
    return scale


@pytest.mark.parametrize(
    ("given", "fragment"),
    [
        ({"num_nodes": 2, "node_rank": 1, "rdzv_backend": "c10d"}, "static rendezvous"),
        ({"num_nodes": 2, "node_rank": 2}, "machine_rank=2 but num_machines=2"),
        ({"master_addr": "192.0.2.7"}, "keeps every socket on loopback"),
        ({"use_port": "http"}, "main_process_port must be int"),
        ({"max_restarts": -1}, "max_restarts"),
    ],
)
def test_launch_refuses_before_anything_starts(
    nothing_started: Path, given: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(nbaccel.ConfigError) as caught:
        nbaccel.notebook_launcher(
            train, (1,), 2, runs_dir=str(nothing_started), dashboard=False, **given
        )
    assert fragment in str(caught.value)


def test_a_busy_use_port_is_explained(nothing_started: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(nbaccel.ConfigError, match=f"main_process_port={port} "):
            nbaccel.notebook_launcher(
                train, (1,), 2, use_port=str(port), runs_dir=str(nothing_started)
            )
