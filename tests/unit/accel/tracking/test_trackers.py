"""Experiment trackers: each writes what was logged (read back from its own files), names and
missing libraries fail before anything starts, and wandb/mlflow stay offline and local.

wandb and mlflow tests run only where those libraries are installed.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import socket
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from nbaccel.accel.tracking import trackers
from nbaccel.accel.tracking.trackers import available_trackers, start_trackers

CONFIG: dict[str, Any] = {
    "lr": 0.1,
    "optim": {"name": "adamw", "betas": (0.9, 0.99)},
    "data_dir": Path("/data"),  # not JSON: stored as its text
}
PLAIN_CONFIG = {"lr": 0.1, "optim": {"name": "adamw", "betas": [0.9, 0.99]}, "data_dir": "/data"}


def hide_modules(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make ``import name`` fail (and find_spec miss it) for this test only."""
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def skip_unless_installed(module: str) -> None:
    """Skip without importing: the tracker must be the first to import it, after its env setup."""
    if not importlib.util.find_spec(module):
        pytest.skip(f"{module} is not installed")


def unset_env(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Unset variables so the tracker's own defaults apply; whatever it sets is undone after."""
    for name in names:
        monkeypatch.setenv(name, "")  # records the original, so teardown restores it exactly
        monkeypatch.delenv(name)


def test_csv_long_format_takes_new_metrics_mid_run(tmp_path: Path) -> None:
    (tracker,) = start_trackers("CSV", "proj", tmp_path, config=CONFIG)  # bare str, any case
    tracker.log({"loss": 0.5}, step=0)
    tracker.log({"loss": 0.25, "acc": 0.75}, step=1)  # a metric first seen mid-run
    tracker.finish()
    tracker.finish()  # idempotent
    with pytest.raises(RuntimeError, match="already finished"):
        tracker.log({"loss": 0.1}, step=2)

    # A second run in the same folder appends rows and does not repeat the header.
    (again,) = start_trackers(["csv"], "proj", tmp_path)
    again.log({"loss": 0.125}, step=2)
    again.finish()

    with (tmp_path / "proj" / "metrics.csv").open(newline="") as file:
        rows = list(csv.reader(file))
    assert rows == [
        ["step", "name", "value"],
        ["0", "loss", "0.5"],
        ["1", "loss", "0.25"],
        ["1", "acc", "0.75"],
        ["2", "loss", "0.125"],
    ]
    assert json.loads((tmp_path / "proj" / "config.json").read_text()) == PLAIN_CONFIG


def test_jsonl_one_object_per_call(tmp_path: Path) -> None:
    (tracker,) = start_trackers(["jsonl"], "proj", tmp_path, config=CONFIG)
    tracker.log({"loss": 0.5}, step=0)
    tracker.log({"loss": 0.25, "acc": 0.75}, step=5)
    with pytest.raises(ValueError, match="rename the metric"):
        tracker.log({"step": 1.0}, step=6)
    tracker.finish()

    lines = (tmp_path / "proj" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [{k: v for k, v in r.items() if k != "time"} for r in records] == [
        {"step": 0, "loss": 0.5},
        {"step": 5, "loss": 0.25, "acc": 0.75},
    ]
    assert records[0]["time"] <= records[1]["time"]
    assert json.loads((tmp_path / "proj" / "config.json").read_text()) == PLAIN_CONFIG


def tfrecords(path: Path) -> Iterator[bytes]:
    """The records of a TFRecord file (TensorBoard's event format), checksums verified."""
    from tensorboardX.record_writer import masked_crc32c

    data, pos = path.read_bytes(), 0
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        body = data[pos + 12 : pos + 12 + length]
        assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked_crc32c(header)
        assert struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])[0] == (
            masked_crc32c(body)
        )
        pos += 16 + length
        yield body


def read_events(log_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, str]]:
    """Scalars as tag -> [(step, value)] and text summaries as tag -> text."""
    if importlib.util.find_spec("tensorboard"):  # what TensorBoard itself shows, where installed
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(log_dir))
        acc.Reload()
        tags = acc.Tags()
        scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags["scalars"]}
        texts = {tag: acc.Tensors(tag)[0].tensor_proto.string_val[0] for tag in tags["tensors"]}
        return scalars, {tag: text.decode() for tag, text in texts.items()}
    from tensorboardX.proto.event_pb2 import Event

    (path,) = log_dir.glob("events.out.tfevents.*")
    scalars, texts = {}, {}
    for event in (Event.FromString(record) for record in tfrecords(path)):
        for value in event.summary.value:
            if value.HasField("simple_value"):
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
            elif value.tensor.string_val:
                texts[value.tag] = value.tensor.string_val[0].decode()
    return scalars, texts


def check_tensorboard(tmp_path: Path) -> str:
    """Log, read the events back; returns the module of the writer that wrote them."""
    (tracker,) = start_trackers(["tensorboard"], "proj", tmp_path, config=CONFIG)
    writer = type(tracker._live()).__module__
    tracker.log({"loss": 0.5}, step=0)
    tracker.log({"loss": 0.25, "acc": 0.75}, step=10)
    tracker.finish()
    tracker.finish()

    scalars, texts = read_events(tmp_path / "proj")
    assert scalars == {"loss": [(0, 0.5), (10, 0.25)], "acc": [(10, 0.75)]}
    shown = texts.get("config") or texts["config/text_summary"]  # torch's writer renames the tag
    assert json.loads(shown) == PLAIN_CONFIG  # indented JSON: a Markdown code block
    return writer


def test_tensorboard_scalars_and_config_read_back(tmp_path: Path) -> None:
    if "tensorboard" not in available_trackers():
        pytest.skip("neither tensorboardX nor tensorboard is installed")
    assert check_tensorboard(tmp_path).startswith("tensorboardX")  # the first choice


def test_tensorboard_falls_back_to_torch_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's writer needs the full tensorboard package (in the dev extra and CI's lock).
    pytest.importorskip("tensorboard")
    hide_modules(monkeypatch, "tensorboardX")
    assert check_tensorboard(tmp_path).startswith("torch.utils.tensorboard")


def test_all_starts_every_available_tracker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hide_modules(monkeypatch, "wandb", "mlflow")  # they have their own tests below
    started = start_trackers(["all", "csv"], "proj", tmp_path, config={"lr": 0.1})
    names = [tracker.name for tracker in started]
    assert names == list(available_trackers())
    assert {"csv", "jsonl"} <= set(names) and not {"wandb", "mlflow"} & set(names)
    for tracker in started:
        tracker.log({"loss": 0.5}, step=3)
        tracker.finish()
    assert (tmp_path / "proj" / "metrics.csv").read_text().splitlines()[-1] == "3,loss,0.5"
    assert json.loads((tmp_path / "proj" / "metrics.jsonl").read_text())["loss"] == 0.5


@pytest.mark.parametrize(
    ("names", "init_kwargs", "hint"),
    [
        (["csv", "tensorbord"], None, "Unknown tracker 'tensorbord'. Did you mean 'tensorboard'?"),
        (["csv"], {"wandbb": {}}, "Unknown init_kwargs key 'wandbb'. Did you mean 'wandb'?"),
    ],
)
def test_unknown_names_suggest_the_valid_one(
    tmp_path: Path, names: list[str], init_kwargs: dict[str, Any] | None, hint: str
) -> None:
    with pytest.raises(ValueError, match="Valid trackers: tensorboard, csv, jsonl") as info:
        start_trackers(names, "proj", tmp_path, init_kwargs=init_kwargs)
    assert hint in str(info.value)
    assert not (tmp_path / "proj").exists()  # csv was checked, never started


def test_missing_library_names_the_package_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hide_modules(monkeypatch, "tensorboardX", "tensorboard", "wandb")
    assert "tensorboard" not in available_trackers() and "wandb" not in available_trackers()
    with pytest.raises(ImportError) as info:
        start_trackers(["csv", "tensorboard", "wandb"], "proj", tmp_path)
    message = str(info.value)
    assert "pip install tensorboardX" in message and "nbaccel[trackers]" in message
    assert "pip install wandb" in message
    assert not (tmp_path / "proj").exists()


def test_a_tracker_failing_to_start_finishes_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[trackers.Tracker] = []

    def record_csv(*args: Any) -> trackers.Tracker:
        made.append(trackers.CSVTracker(*args))
        return made[-1]

    def broken(*args: Any) -> trackers.Tracker:
        raise RuntimeError("disk full")

    monkeypatch.setitem(trackers._FACTORIES, "csv", record_csv)
    monkeypatch.setitem(trackers._FACTORIES, "jsonl", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        start_trackers(["csv", "jsonl"], "proj", tmp_path)
    (csv_tracker,) = made
    with pytest.raises(RuntimeError, match="already finished"):
        csv_tracker.log({"loss": 0.5}, step=0)


def no_network(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError(f"tracker tried to reach the network: {args}")


def wandb_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "wandb" in p.name()]


def test_wandb_offline_and_no_service_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    skip_unless_installed("wandb")
    unset_env(monkeypatch, "WANDB_MODE", "WANDB_ERROR_REPORTING", "WANDB_API_KEY")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # not the user's ~
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    # Python-side lookups fail loudly; wandb-core (Go) is kept off by WANDB_MODE=offline.
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    assert not wandb_children()

    (tracker,) = start_trackers(
        ["wandb"], "proj", tmp_path, config=CONFIG, init_kwargs={"wandb": {"name": "r1"}}
    )
    assert os.environ["WANDB_MODE"] == "offline"
    tracker.log({"loss": 0.5}, step=0)
    tracker.log({"loss": 0.25}, step=1)
    service = wandb_children()
    assert service, "wandb-core should run while the run is open"
    tracker.finish()
    tracker.finish()

    _, alive = psutil.wait_procs(service, timeout=10)
    assert not alive, f"wandb processes left after finish(): {alive}"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("wandb")]
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()  # records are protobufs holding keys and JSON values as text
    assert b"loss" in data and b"0.25" in data and b"adamw" in data


def test_mlflow_local_store_params_and_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    skip_unless_installed("mlflow")
    unset_env(
        monkeypatch, "MLFLOW_TRACKING_URI", "MLFLOW_DISABLE_TELEMETRY", "MLFLOW_ALLOW_FILE_STORE"
    )
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)

    (tracker,) = start_trackers(
        ["mlflow"], "proj", tmp_path, config=CONFIG, init_kwargs={"mlflow": {"run_name": "r1"}}
    )
    tracker.log({"loss": 0.5, "acc": 0.75}, step=0)
    tracker.log({"loss": 0.25}, step=4)
    tracker.finish()
    tracker.finish()

    import mlflow

    assert isinstance(tracker, trackers.MLflowTracker)
    uri = str(tracker.where)
    assert str(tmp_path.resolve()) in uri  # the store lies under logging_dir, not the cwd
    database = all(importlib.util.find_spec(m) for m in ("sqlalchemy", "alembic"))
    assert uri.startswith("sqlite:///" if database else "file://")  # skinny: no database
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    assert run.data.params == {
        "lr": "0.1",
        "optim.name": "adamw",
        "optim.betas": "[0.9, 0.99]",
        "data_dir": "/data",
    }
    history = client.get_metric_history(tracker.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.5), (4, 0.25)]
