"""The strategies chosen from the config, and the facade members that only delegate to them
(one process; the multi-rank behaviour is in tests/multiprocess/test_strategies.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nbaccel.accel import Accelerator, strategies
from nbaccel.accel.state import DistributedType, ProcessState
from nbaccel.config.schema import Config


def state(kind: DistributedType, world: int = 2) -> ProcessState:
    return ProcessState(0, 0, world, world, torch.device("cpu"), kind, "")


@pytest.mark.parametrize(
    ("kind", "options", "expected"),
    [
        (DistributedType.NO, {}, strategies.Strategy),
        (DistributedType.MULTI_CPU, {}, strategies.DataParallel),
        (DistributedType.MULTI_GPU, {}, strategies.DataParallel),
        (DistributedType.MULTI_CPU, {"shard_optimizer_state": True}, strategies.ZeroOne),
        (DistributedType.FSDP, {"strategy": "fsdp"}, strategies.FullySharded),
        (DistributedType.DEEPSPEED, {"strategy": "deepspeed"}, strategies.DeepSpeed),
    ],
)
def test_one_strategy_class_per_backend(
    kind: DistributedType, options: dict[str, Any], expected: type
) -> None:
    chosen = strategies.strategy_for(state(kind), Config().replace(**options))
    assert type(chosen) is expected


def test_layout_follows_the_backend_and_fsdp_keeps_its_own_on_one_process() -> None:
    assert strategies.Strategy(state(DistributedType.NO, 1), Config()).checkpoint_layout == "plain"
    fsdp = Config().replace(strategy="fsdp")
    one = strategies.Strategy(state(DistributedType.NO, 1), fsdp)
    assert one.checkpoint_layout == "sharded"  # loads onto N ranks later
    deepspeed = strategies.DeepSpeed(state(DistributedType.DEEPSPEED), Config())
    assert deepspeed.checkpoint_layout == "deepspeed"
    with pytest.raises(RuntimeError, match=r"call accelerator.prepare\(model, optimizer"):
        deepspeed.backward(torch.ones(()), accumulation_steps=1, scaler=None, sync_gradients=True)


def test_get_state_dict_is_the_unwrapped_models_plain_tensors() -> None:
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(torch.nn.Linear(3, 2))
    weights = acc.get_state_dict(model)
    assert set(weights) == {"weight", "bias"}
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in weights.values())
    assert torch.equal(weights["weight"], model.weight.detach())


def test_evaluation_mode_places_and_autocasts_without_wrapping() -> None:
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare_model(torch.nn.Linear(3, 2), evaluation_mode=True)
    assert type(model) is torch.nn.Linear
    assert model(torch.ones(1, 3)).dtype == torch.float32  # outputs leave autocast in fp32


def test_a_save_hook_that_pops_weights_leaves_that_model_out(tmp_path: Path) -> None:
    acc = Accelerator()
    kept, own = acc.prepare(torch.nn.Linear(2, 2), torch.nn.Linear(2, 3))
    seen: list[Any] = []

    def save_own_way(models: list[Any], weights: list[Any], output_dir: str) -> None:
        seen.append((len(models), len(weights), output_dir))
        weights.pop(1)  # saved elsewhere, as diffusers does with save_pretrained

    handle = acc.register_save_state_pre_hook(save_own_way)
    acc.save_state(tmp_path / "ckpt")
    assert seen == [(2, 2, str(tmp_path / "ckpt"))]
    handle.remove()
    acc.save_state(tmp_path / "again")
    assert len(seen) == 1  # removed

    with torch.no_grad():
        kept.weight.zero_()
        own.weight.fill_(7.0)
    acc.register_load_state_pre_hook(lambda models, input_dir: models.pop(1))
    acc.load_state(tmp_path / "ckpt")
    assert not torch.all(kept.weight == 0)  # restored
    assert torch.all(own.weight == 7.0)  # the hook took it out: untouched


def test_a_trigger_set_on_this_process_is_seen_once() -> None:
    acc = Accelerator()
    assert acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True
    assert acc.check_trigger() is False  # reset by the check


def test_save_model_writes_accelerates_files_one_or_sharded(tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file

    acc = Accelerator()
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)))
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    acc.save_model(model, tmp_path / "one")
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["model.safetensors"]
    acc.save_model(model, tmp_path / "bin", safe_serialization=False)
    assert torch.load(tmp_path / "bin" / "pytorch_model.bin").keys() == expected.keys()
    acc.save_model(model, tmp_path / "shards", max_shard_size="10KB")  # 16.6 KB of weights
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    loaded: dict[str, torch.Tensor] = {}
    for name in files:
        loaded |= load_file(str(tmp_path / "shards" / name))
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in expected.values())
    with pytest.raises(ValueError, match="not a size"):
        acc.save_model(model, tmp_path / "bad", max_shard_size="ten gigs")


def test_deepspeeds_config_placeholders_are_refused_by_name() -> None:
    from nbaccel.utils import DummyOptim

    model = torch.nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match="DummyOptim: the placeholder"):
        Accelerator().prepare(model, DummyOptim(model.parameters()))
