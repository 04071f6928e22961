"""DeepSpeed through the Accelerator: ZeRO-2 with bf16 trains, ZeRO-3 matches ZeRO-0,
save_state/load_state resumes, save_model writes one consolidated file.

Runs only on a CUDA machine with deepspeed installed (the ``cuda`` marker and an
importorskip); the config mapping is tested everywhere in
tests/unit/config/deepspeed/test_deepspeed.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import nbaccel
from nbaccel.hardware.devices import visible_gpu_count

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]

TOLERANCE = 1e-5  # fp32 runs: only the order of the reductions differs between ZeRO stages


def gpu_ranks() -> int:
    return max(1, min(2, visible_gpu_count(os.environ)))


def train_with_deepspeed(
    micro_steps: int, folder: str, mode: str = "fresh", embedding: bool = False
) -> dict[str, Any]:
    """Train a small regression through the Accelerator; ``mode``: fresh, save, or resume.

    ``embedding``: integer inputs (an Embedding first, AdamW), so the first layer works in
    whatever dtype DeepSpeed casts the module to (bf16); otherwise an MLP on float inputs
    with SGD.
    """
    import deepspeed
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    acc = nbaccel.Accelerator(gradient_accumulation_steps=2)
    data = torch.Generator().manual_seed(1)
    if embedding:
        table = torch.randn(64, generator=data)
        inputs = torch.randint(0, 64, (512, 4), generator=data)
        targets = table[inputs].sum(1, keepdim=True)
        layers = [torch.nn.Embedding(64, 32), torch.nn.Flatten(), torch.nn.Linear(128, 1)]
    else:
        inputs = torch.randn(512, 8, generator=data)
        targets = inputs.sin().sum(1, keepdim=True)
        layers = [torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)]
    model = torch.nn.Sequential(*layers)
    # SGD for the parity runs: Adam magnifies rounding noise in tiny gradients (FACTS.md).
    optimizer: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if embedding
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    )
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=8, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    if mode == "resume":
        acc.load_state(f"{folder}/state")
    losses: list[float] = []
    target = acc.step + micro_steps
    while acc.step < target:
        for x, y in loader:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
                acc.backward(loss)
                optimizer.step()  # the engine stepped in backward: these do nothing
                optimizer.zero_grad()
            losses.append(loss.item())
            if acc.step == target:
                break
    if mode == "save":
        acc.save_state(f"{folder}/state")
    acc.save_model(model, f"{folder}/model")
    return {
        "losses": losses,
        "engine": isinstance(model, deepspeed.DeepSpeedEngine),
        "type": acc.distributed_type.value,
        "zero_stage": model.zero_optimization_stage(),
    }


def weights(folder: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(f"{folder}/model/model.safetensors")


def launch(folder: Path, runs_dir: str, *args: Any, **settings: Any) -> Any:
    return nbaccel.notebook_launcher(
        train_with_deepspeed,
        args=(args[0], str(folder), *args[1:]),
        num_processes=gpu_ranks(),
        strategy="deepspeed",
        runs_dir=runs_dir,
        **settings,
    )


def test_zero2_with_bf16_trains_a_deepspeed_engine(tmp_path: Path, runs_dir: str) -> None:
    result = launch(
        tmp_path, runs_dir, 120, "fresh", True, deepspeed_zero_stage=2, mixed_precision="bf16"
    )
    assert result["engine"] and result["type"] == "DEEPSPEED" and result["zero_stage"] == 2
    losses = result["losses"]
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10]), losses
    saved = weights(str(tmp_path))
    assert {name: tuple(t.shape) for name, t in saved.items()} == {
        "0.weight": (64, 32),
        "2.weight": (1, 128),
        "2.bias": (1,),
    }
    # The fp32 master weights, not the bf16 training copy.
    assert {str(t.dtype) for t in saved.values()} == {"torch.float32"}


def test_zero3_save_16bit_model_writes_deepspeeds_gathered_bf16_weights(
    tmp_path: Path, runs_dir: str
) -> None:
    # The same bf16 ZeRO-3 training twice: saved as the 16-bit copy DeepSpeed gathers from every
    # rank's partitions, then (without the option) as the fp32 master copy.
    bf16 = {"deepspeed_zero_stage": 3, "mixed_precision": "bf16"}
    for name, save_16bit in (("16bit", True), ("fp32", False)):
        result = launch(
            tmp_path / name, runs_dir, 40, "fresh", True,
            deepspeed_zero3_save_16bit_model=save_16bit, **bf16,
        )  # fmt: skip
        assert result["zero_stage"] == 3
    sixteen, masters = weights(str(tmp_path / "16bit")), weights(str(tmp_path / "fp32"))
    shapes = {"0.weight": (64, 32), "2.weight": (1, 128), "2.bias": (1,)}
    assert {name: tuple(t.shape) for name, t in sixteen.items()} == shapes  # whole, not a shard
    assert {str(t.dtype) for t in sixteen.values()} == {"torch.bfloat16"}
    assert {str(t.dtype) for t in masters.values()} == {"torch.float32"}
    for name, master in masters.items():
        # The training copy is the master rounded to bf16: within one bf16 step of it.
        gap = (sixteen[name].float() - master).abs()
        assert bool((gap <= master.abs() * 2**-8 + 1e-30).all()), name


def test_zero3_ends_where_zero0_does(tmp_path: Path, runs_dir: str) -> None:
    for stage in (0, 3):
        result = launch(tmp_path / f"zero{stage}", runs_dir, 40, deepspeed_zero_stage=stage)
        assert result["zero_stage"] == stage
    zero0, zero3 = weights(str(tmp_path / "zero0")), weights(str(tmp_path / "zero3"))
    assert zero0.keys() == zero3.keys()
    for name in zero0:
        assert zero0[name].shape == zero3[name].shape  # ZeRO-3 saved whole, not its shard
        assert float((zero0[name] - zero3[name]).abs().max()) < TOLERANCE, name


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_from_save_state_equals_the_straight_run(
    tmp_path: Path, runs_dir: str, stage: int
) -> None:
    straight = launch(tmp_path / "straight", runs_dir, 40, deepspeed_zero_stage=stage)
    launch(tmp_path / "split", runs_dir, 20, "save", deepspeed_zero_stage=stage)
    assert (tmp_path / "split" / "state").is_dir()
    resumed = launch(tmp_path / "split", runs_dir, 20, "resume", deepspeed_zero_stage=stage)
    for a, b in zip(straight["losses"][20:], resumed["losses"], strict=True):
        assert abs(a - b) < TOLERANCE
    one, other = weights(str(tmp_path / "straight")), weights(str(tmp_path / "split"))
    for name in one:
        assert float((one[name] - other[name]).abs().max()) < TOLERANCE, name


def test_a_bad_deepspeed_file_fails_before_any_process(tmp_path: Path, runs_dir: str) -> None:
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}')
    with pytest.raises(nbaccel.ConfigError, match="needs ZeRO stage 3"):
        launch(tmp_path, runs_dir, 4, deepspeed_config_file=str(bad))
    assert not Path(runs_dir).exists()  # refused before a run folder was made
