"""strategy='fsdp' on XLA: SPMD with FSDPv2 over 4 CPU XLA devices in one process, compared
with the same loop in plain PyTorch on CPU (FACTS.md: they agree to 5 decimals)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.xla.conftest import run_scenario

SCENARIO = r"""
import json, tempfile, warnings
from pathlib import Path
import torch
import torch_xla, torch_xla.runtime as xr
from torch.utils.data import DataLoader, TensorDataset
import nbaccel
from nbaccel.accel import Accelerator

def spec(tensor):
    return torch_xla._XLAC._get_xla_sharding_spec(tensor)

def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

def dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(80, 8, generator=g), torch.randn(80, 4, generator=g))

def weights(model):
    return [p.detach().cpu().flatten().tolist() for p in model.parameters()]

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # FSDPv2's backward hook warns about inputs without grad
    acc = Accelerator(config=nbaccel.Config(strategy="fsdp"))
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt, loader = acc.prepare(model, opt, DataLoader(dataset(), batch_size=16))
    losses, input_specs = [], set()
    for step, (x, y) in enumerate(loader):
        if step == 6:
            break
        input_specs.add(spec(x))
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss); opt.step(); opt.zero_grad()
        losses.append(loss.item())
    inner = acc.unwrap_model(model)
    param_specs = {name: spec(p) for name, p in inner.named_parameters()}
    directory = Path(tempfile.mkdtemp())
    acc.save_model(model, directory / "export")
    acc.save_state(directory / "ckpt")
    before = weights(inner)
    with torch.no_grad():
        for p in inner.parameters():
            p.zero_()
    acc.load_state(directory / "ckpt")

reference = make_model()
ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
ref_losses = []
for x, y in list(DataLoader(dataset(), batch_size=16))[:6]:
    loss = torch.nn.functional.mse_loss(reference(x), y)
    loss.backward(); ref_opt.step(); ref_opt.zero_grad()
    ref_losses.append(loss.item())

from safetensors.torch import load_file
exported = load_file(directory / "export" / "model.safetensors")
print(json.dumps({
    "spmd": xr.is_spmd(),
    "devices": xr.global_runtime_device_count(),
    "type": [acc.distributed_type.value, acc.num_processes, type(model).__name__],
    "param_specs": param_specs,
    "input_specs": sorted(input_specs),
    "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
    "weight_diff": max(abs(a - b) for u, v in zip(weights(inner), weights(reference))
                       for a, b in zip(u, v)),
    "export": {k: list(v.shape) for k, v in exported.items()},
    "reloaded_diff": max(abs(a - b) for u, v in zip(before, weights(inner)) for a, b in zip(u, v)),
    "reloaded_specs": {name: spec(p) for name, p in inner.named_parameters()},
}))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("spmd")
    result: dict[str, Any] = run_scenario(SCENARIO, tmp, devices=4)
    return result


def test_fsdp_runs_fsdpv2_under_spmd_in_one_process(results: dict[str, Any]) -> None:
    assert results["spmd"] and results["devices"] == 4
    assert results["type"] == ["XLA", 1, "SpmdFullyShardedDataParallel"]


def test_parameters_and_batches_are_sharded_over_the_four_devices(
    results: dict[str, Any],
) -> None:
    # FSDPv2 shards each parameter's largest dimension along 'fsdp' (4 devices, mesh (4, 1)).
    assert results["param_specs"] == {
        "0.weight": "{devices=[4,1]0,1,2,3}",
        "0.bias": "{devices=[4]0,1,2,3}",
        "2.weight": "{devices=[1,4]0,1,2,3}",
        "2.bias": "{devices=[4]0,1,2,3}",
    }
    assert results["input_specs"] == ["{devices=[4,1]0,1,2,3}"]  # the global batch, split


def test_losses_and_weights_match_plain_cpu(results: dict[str, Any]) -> None:
    assert results["loss_diff"] < 1e-5 and results["weight_diff"] < 1e-5, results


def test_checkpoints_hold_whole_tensors_and_load_back_sharded(results: dict[str, Any]) -> None:
    assert results["export"] == {
        "0.weight": [32, 8],
        "0.bias": [32],
        "2.weight": [4, 32],
        "2.bias": [4],
    }
    assert results["reloaded_diff"] == 0.0
    assert results["reloaded_specs"] == results["param_specs"]
