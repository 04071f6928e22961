"""Kept workers without processes: what a keep_workers launch refuses before anything
starts, how map's shards are cut and put back in order, and load_into's sources."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import nbaccel
from nbaccel.errors import ConfigError
from nbaccel.interactive.model_loading import load_into
from nbaccel.launcher import api
from nbaccel.launcher.interactive.after_training import in_dataset_order
from nbaccel.launcher.interactive.model_ops import rank_batches
from nbaccel.launcher.interactive.on_rank import serve_kept
from nbaccel.launcher.planned import Keeper
from nbaccel.ui.kept_panel import memory_text

KEEPER = Keeper(serve=serve_kept, make=lambda run, end: None)


def train() -> None:
    """Never run: the launches below are refused first."""


@pytest.mark.parametrize(
    ("option", "field"),
    [
        ({"detach": True}, "detach"),
        ({"max_restarts": 1}, "max_restarts"),
    ],
)
def test_what_kept_workers_cannot_serve_is_refused_before_anything_starts(
    option: dict[str, Any], field: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[socket.socket] = []
    real = socket.socket

    def counting(*args: Any, **kwargs: Any) -> socket.socket:
        made = real(*args, **kwargs)
        opened.append(made)
        return made

    monkeypatch.setattr(socket, "socket", counting)
    overrides = {"keep_workers": True, "use_cpu": True, "runs_dir": str(tmp_path), **option}
    with pytest.raises(ConfigError, match=f"{field}=.*keep_workers=True") as refused:
        api.plan(train, (), 2, None, None, overrides, KEEPER)
    assert refused.value.field == field
    assert not opened  # no listener was made for workers that will never come
    assert not any(tmp_path.iterdir())  # no run folder either


def test_a_launch_with_nobody_to_keep_the_workers_for_is_refused(tmp_path: Path) -> None:
    overrides = {"keep_workers": True, "use_cpu": True, "runs_dir": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"nbaccel\.launch or nbaccel\.notebook_launcher"):
        api.plan(train, (), 2, None, None, overrides)


def test_a_kept_launch_plans_its_listener_and_sends_the_ranks_where_it_is(tmp_path: Path) -> None:
    overrides = {"keep_workers": True, "use_cpu": True, "runs_dir": str(tmp_path)}
    planned = api.plan(train, (), 2, None, None, overrides, KEEPER)
    try:
        assert planned.keep is not None
        assert planned.keep.listener.getsockname() == planned.keep.address.encode()
    finally:
        assert planned.keep is not None
        planned.keep.listener.close()
        planned.payload.close()


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("size", [0, 1, 5, 64, 1001])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_map_shards_run_as_many_batches_each_and_come_back_in_order(
    world: int, size: int, batch: int
) -> None:
    shards = [rank_batches(size, batch, rank, world) for rank in range(world)]
    assert len({len(shard) for shard in shards}) <= 1  # every rank runs as many batches
    shares = [
        {
            "sizes": [len(b) for b in shard],
            "rows": [i for b in shard for i in b],
            "dataset_size": size,
        }
        for shard in shards
    ]
    if size == 0:
        assert all(not shard for shard in shards)
        return
    assert in_dataset_order(shares) == list(range(size))


def test_map_puts_tuples_and_dicts_back_leaf_by_leaf() -> None:
    shares = [
        {"sizes": [2, 1], "rows": ({"a": torch.tensor([0, 1, 4])}, [0, 1, 4]), "dataset_size": 5},
        {"sizes": [2, 1], "rows": ({"a": torch.tensor([2, 3, 0])}, [2, 3, 0]), "dataset_size": 5},
    ]
    joined, rows = in_dataset_order(shares)
    assert joined["a"].tolist() == [0, 1, 2, 3, 4] and rows == [0, 1, 2, 3, 4]


def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return dict(torch.nn.Linear(3, 2).state_dict())


def test_load_into_reads_files_folders_shards_and_wrapper_prefixes(tmp_path: Path) -> None:
    state = weights()
    save_file(state, tmp_path / "model.safetensors")
    torch.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "ddp.bin")
    shards = tmp_path / "sharded"
    shards.mkdir()
    save_file({"weight": state["weight"]}, shards / "model-00001-of-00002.safetensors")
    save_file({"bias": state["bias"]}, shards / "model-00002-of-00002.safetensors")
    index = {
        "weight": "model-00001-of-00002.safetensors",
        "bias": "model-00002-of-00002.safetensors",
    }
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    for source in (tmp_path, tmp_path / "model.safetensors", tmp_path / "ddp.bin", shards):
        model = torch.nn.Linear(3, 2)
        report = load_into(model, source)
        assert not report.missing_keys and not report.unexpected_keys, source
        assert torch.equal(model.weight, state["weight"]), source


def test_load_into_says_what_did_not_match_or_raises_when_strict(
    capsys: pytest.CaptureFixture[str],
) -> None:
    partial = {"weight": weights()["weight"], "extra.scale": torch.ones(1)}
    report = load_into(torch.nn.Linear(3, 2), partial)
    assert report.missing_keys == ["bias"] and report.unexpected_keys == ["extra.scale"]
    said = capsys.readouterr().out
    assert "1 of the model's keys had no weights" in said and "'extra.scale'" in said
    with pytest.raises(RuntimeError, match="Missing key"):
        load_into(torch.nn.Linear(3, 2), partial, strict=True)
    with pytest.raises(TypeError, match="state dict, a run or workers"):
        load_into(torch.nn.Linear(3, 2), 42)
    with pytest.raises(FileNotFoundError, match=r"none of model\.safetensors"):
        load_into(torch.nn.Linear(3, 2), Path("/"))


def test_assign_makes_the_sources_tensors_the_parameters() -> None:
    state = weights()
    model = torch.nn.Linear(3, 2)
    nbaccel.load_into(model, state, assign=True)
    assert model.weight.data_ptr() == state["weight"].data_ptr()


def test_the_kept_panel_counts_shared_pages_once() -> None:
    memory = {0: {"rss": 4 << 30, "pss": 3 << 30, "cuda_allocated": 1 << 30}, 1: {"rss": 1 << 30}}
    assert memory_text(memory) == "rank 0: 3.00 GiB RAM, 1.00 GiB GPU · rank 1: 1.00 GiB RAM"
