"""The Accelerator on one CPU XLA device, compared with the same loop in plain PyTorch on CPU.

One interpreter runs every check (importing torch_xla costs seconds per process) and prints
their results as JSON; each test below asserts on its part.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.xla.conftest import run_scenario

SCENARIO = r"""
import collections, json, tempfile
from pathlib import Path
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
import nbaccel
from nbaccel.accel import Accelerator
from nbaccel.errors import ConfigError
from nbaccel.metrics import log_metrics

out = {}

def dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))

def make_model(dropout=0.0):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 1)
    )

def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

def weights(model):
    return [p.detach().cpu().flatten().tolist() for p in model.parameters()]

def max_diff(a, b):
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))

def reference(batch_size, steps):
    model = make_model()
    opt = make_optimizer(model)
    losses = []
    for x, y in list(DataLoader(dataset(), batch_size=batch_size))[:steps]:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward(); opt.step(); opt.zero_grad()
        losses.append(loss.item())
    return losses, weights(model)

# fp16 is refused before anything touches the device.
try:
    Accelerator(mixed_precision="fp16")
    out["fp16"] = "accepted"
except ConfigError as error:
    out["fp16"] = str(error)

# (a) plain training: losses and weights against the CPU loop.
acc = Accelerator()
out["type"] = [acc.distributed_type.value, str(acc.device), acc.num_processes]
model = make_model()
opt = make_optimizer(model)  # built before prepare: must follow the moved parameters
model, opt, loader = acc.prepare(model, opt, DataLoader(dataset(), batch_size=8))
losses, devices = [], set()
for step, (x, y) in enumerate(loader):
    if step == 6:
        break  # leaves torch_xla's loader mid-epoch: its threads must end
    devices.add(x.device.type)
    loss = torch.nn.functional.mse_loss(model(x), y)
    acc.backward(loss); opt.step(); opt.zero_grad()
    losses.append(loss.item())
ref_losses, ref_weights = reference(8, 6)
out["plain"] = {
    "devices": sorted(devices),
    "param_device": next(model.parameters()).device.type,
    "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
    "weight_diff": max_diff(weights(model), ref_weights),
    "epoch_batches": sum(1 for _ in loader),  # a new epoch after the early break
}

# (b) gradient accumulation over 2 micro-batches of 4 = one batch of 8.
acc = Accelerator(gradient_accumulation_steps=2)
model = make_model()
model, opt, loader = acc.prepare(model, make_optimizer(model), DataLoader(dataset(), batch_size=4))
for step, (x, y) in enumerate(loader):
    if step == 12:
        break
    with acc.accumulate(model):
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step(); opt.zero_grad()
out["accumulate"] = {"weight_diff": max_diff(weights(model), reference(8, 6)[1])}

# (c) bf16 autocast: bf16 inside the forward, fp32 parameters, outputs and gradients.
acc = Accelerator(mixed_precision="bf16")
model = make_model()
inner_dtypes = []
model[0].register_forward_hook(lambda module, args, output: inner_dtypes.append(str(output.dtype)))
model, opt = acc.prepare(model, make_optimizer(model))
x, y = torch.randn(8, 8, device=acc.device), torch.randn(8, 1, device=acc.device)
prediction = model(x)
loss = torch.nn.functional.mse_loss(prediction, y)
acc.backward(loss)
grad_dtype = str(next(model.parameters()).grad.dtype)
opt.step(); opt.zero_grad()
with acc.autocast():
    matmul = str((x @ x.T).dtype)
out["bf16"] = {
    "inner": inner_dtypes, "output": str(prediction.dtype), "autocast": matmul,
    "params": sorted({str(p.dtype) for p in model.parameters()}), "grad": grad_dtype,
    "loss": loss.item(),
}

# (d) collectives with one process: the same values back, gathered 0-d tensors 1-d.
t = torch.tensor([1.0, 2.0], device=acc.device)
acc.wait_for_everyone()
out["collectives"] = {
    "gather": acc.gather(t).cpu().tolist(),
    "gather_scalar": acc.gather(torch.tensor(3.0, device=acc.device)).cpu().tolist(),
    "gather_device": acc.gather(t).device.type,
    "reduce_sum": acc.reduce(t, "sum").cpu().tolist(),
    "reduce_mean": acc.reduce({"a": t}, "mean")["a"].cpu().tolist(),
    "metrics": acc.gather_for_metrics((t, t * 2))[1].cpu().tolist(),
    "objects": acc.gather_for_metrics(["a", "b"]),
    "padded": list(acc.pad_across_processes(t).shape),
    "log": log_metrics({"loss": loss.detach(), "n": torch.tensor(3, device=acc.device)}),
}
acc.log({"loss": loss.detach()})

# Batches keep their types (torch_xla's own loader turns tuples into lists);
# iterable datasets are sharded and moved too.
Pair = collections.namedtuple("Pair", "x y")
def collate(items):
    return {"pair": Pair(torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])),
            "ids": tuple(range(len(items))), "name": "batch"}
class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(10.0).reshape(5, 2))
typed, stream = acc.prepare(DataLoader(dataset(), batch_size=8, collate_fn=collate),
                            DataLoader(Stream(), batch_size=2))
batch = next(iter(typed))
out["batches"] = {
    "types": [type(batch).__name__, type(batch["pair"]).__name__, type(batch["ids"]).__name__,
              batch["name"]],
    "device": batch["pair"].x.device.type,
    "stream": [b.cpu().tolist() for b in stream],
}

# (e) save_state -> a new Accelerator -> load_state continues exactly.
def resumable(acc, steps, save_at=None, directory=None, load=None):
    model = make_model(dropout=0.2)
    loader = DataLoader(dataset(), batch_size=8, shuffle=True)
    model, opt, loader = acc.prepare(model, make_optimizer(model), loader)
    if load:
        acc.load_state(load)
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss); opt.step(); opt.zero_grad()
        losses.append(loss.item())
        if len(losses) == save_at:
            acc.save_state(directory)
        if len(losses) == steps:
            break
    return losses, weights(model)

directory = Path(tempfile.mkdtemp()) / "ckpt"
torch.manual_seed(1)
full_losses, full_weights = resumable(Accelerator(), 7, save_at=4, directory=directory)
torch.manual_seed(2)  # the checkpoint's random states must win over this
resumed_losses, resumed_weights = resumable(Accelerator(), 3, load=directory)
state = directory / (directory / "LATEST").read_text().strip()
saved = [torch.load(state / name, weights_only=True) for name in ("model_0.pt", "optimizer_0.pt")]
saved_devices = set()
def note(x):
    if isinstance(x, torch.Tensor):
        saved_devices.add(x.device.type)
    elif isinstance(x, dict):
        [note(v) for v in x.values()]
    elif isinstance(x, (list, tuple)):
        [note(v) for v in x]
note(saved)
randomness = torch.load(state / "random_states_0.pt", weights_only=True)
out["resume"] = {
    "loss_diff": max(abs(a - b) for a, b in zip(full_losses[4:], resumed_losses)),
    "weight_diff": max_diff(full_weights, resumed_weights),
    "saved_devices": sorted(saved_devices),
    "momentum_saved": len(saved[1]["state"]),
    "device_rng": type(randomness.get("device")).__name__,
}

# save_model: the weights in model.safetensors, read back on the CPU.
from safetensors.torch import load_file
acc = Accelerator()
model = acc.prepare(make_model())
acc.save_model(model, directory.parent / "export")
exported = load_file(directory.parent / "export" / "model.safetensors")
out["save_model"] = {
    "keys": sorted(exported),
    "diff": max((exported[k] - v.cpu()).abs().max().item() for k, v in model.state_dict().items()),
}

# SPMD cannot start once the device was used in this process: refused with the fix.
try:
    Accelerator(config=nbaccel.Config(strategy="fsdp"))
    out["spmd_late"] = "accepted"
except ConfigError as error:
    out["spmd_late"] = str(error)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result: dict[str, Any] = run_scenario(SCENARIO, tmp_path_factory.mktemp("xla"), devices=1)
    return result


def test_runs_on_the_xla_device_and_matches_plain_cpu(results: dict[str, Any]) -> None:
    assert results["type"] == ["XLA", "xla:0", 1]
    plain = results["plain"]
    assert plain["devices"] == ["xla"] and plain["param_device"] == "xla"
    assert plain["loss_diff"] < 1e-5 and plain["weight_diff"] < 1e-5, plain
    assert plain["epoch_batches"] == 12  # 96 samples / 8, from the start again


def test_gradient_accumulation_equals_the_full_batch(results: dict[str, Any]) -> None:
    assert results["accumulate"]["weight_diff"] < 1e-5, results["accumulate"]


def test_bf16_autocast_computes_in_bf16_and_keeps_fp32_weights(results: dict[str, Any]) -> None:
    bf16 = results["bf16"]
    assert bf16["inner"] == ["torch.bfloat16"] and bf16["autocast"] == "torch.bfloat16"
    assert bf16["output"] == "torch.float32" and bf16["grad"] == "torch.float32"
    assert bf16["params"] == ["torch.float32"] and bf16["loss"] == bf16["loss"]  # not NaN


def test_collectives_and_log_with_one_process(results: dict[str, Any]) -> None:
    c = results["collectives"]
    assert c["gather"] == [1.0, 2.0] and c["gather_scalar"] == [3.0]
    assert c["gather_device"] == "xla"
    assert c["reduce_sum"] == [1.0, 2.0] and c["reduce_mean"] == [1.0, 2.0]
    assert c["metrics"] == [2.0, 4.0] and c["objects"] == ["a", "b"] and c["padded"] == [2]
    assert isinstance(c["log"]["loss"], float) and c["log"]["n"] == 3.0


def test_batches_keep_their_types_and_iterables_are_moved(results: dict[str, Any]) -> None:
    batches = results["batches"]
    assert batches["types"] == ["dict", "Pair", "tuple", "batch"]
    assert batches["device"] == "xla"
    assert batches["stream"] == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0, 7.0]], [[8.0, 9.0]]]


def test_save_and_load_state_resume_exactly_from_cpu_files(results: dict[str, Any]) -> None:
    resume = results["resume"]
    assert resume["loss_diff"] <= 1e-6 and resume["weight_diff"] <= 1e-6, resume
    assert resume["saved_devices"] == ["cpu"] and resume["momentum_saved"] == 4
    assert resume["device_rng"] == "int"


def test_save_model_writes_the_weights(results: dict[str, Any]) -> None:
    saved = results["save_model"]
    assert saved["keys"] == ["0.bias", "0.weight", "3.bias", "3.weight"]
    assert saved["diff"] == 0.0


def test_config_errors_say_why_and_the_fix(results: dict[str, Any]) -> None:
    assert "TPUs compute in bfloat16" in results["fp16"] and "'bf16'" in results["fp16"]
    assert "already used it" in results["spmd_late"]
    assert "use_spmd()" in results["spmd_late"]
