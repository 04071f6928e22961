"""The facade members that gather across ranks, on real 2-process gloo runs: full state dicts
from FSDP2 shards, triggers raised on one rank, DDP's wrapped keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import nbaccel


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def train_and_get_state(out: str) -> dict[str, Any]:
    from nbaccel import Accelerator

    acc = Accelerator()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    torch.manual_seed(1 + acc.process_index)
    for _ in range(3):
        loss = model(torch.randn(4, 6)).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    weights = acc.get_state_dict(model)
    acc.save_model(model, out)
    wrapped_keys = sorted(acc.get_state_dict(model, unwrap=False))
    return {
        "types": sorted({type(t).__name__ for t in weights.values()}),
        "weights": {k: t.clone() for k, t in weights.items()},
        "wrapped_keys": wrapped_keys,
    }


def test_fsdp2_full_state_dict_is_plain_and_loads_into_one_process_model(
    runs_dir: str, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    result = nbaccel.notebook_launcher(
        train_and_get_state,
        args=(str(tmp_path / "fsdp"),),
        num_processes=2,
        strategy="fsdp",
        fsdp_min_num_params=1,
        runs_dir=runs_dir,
    )
    assert result["types"] == ["Tensor"]  # not DTensor: comparable with a plain model
    plain = _model()
    plain.load_state_dict(result["weights"])  # strict: every key, every shape
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, result["weights"][name])
    saved = load_file(str(tmp_path / "fsdp" / "model.safetensors"))
    assert saved.keys() == result["weights"].keys()
    assert all(torch.equal(saved[k], result["weights"][k]) for k in saved)


def test_ddp_get_state_dict_unwraps_unless_asked_not_to(runs_dir: str, tmp_path: Path) -> None:
    result = nbaccel.notebook_launcher(
        train_and_get_state, args=(str(tmp_path / "ddp"),), num_processes=2, runs_dir=runs_dir
    )
    assert sorted(result["weights"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert result["wrapped_keys"] == [f"module.{k}" for k in sorted(result["weights"])]


def trigger_on_rank_one() -> list[bool]:
    from nbaccel import Accelerator

    acc = Accelerator()
    seen = [acc.check_trigger()]
    if acc.process_index == 1:
        acc.set_trigger()
    seen.append(acc.check_trigger())  # every rank sees rank 1's trigger
    seen.append(acc.check_trigger())  # and it was reset
    return seen


def test_a_trigger_set_on_one_rank_reaches_every_rank(runs_dir: str) -> None:
    run = nbaccel.launch(trigger_on_rank_one, num_processes=2, runs_dir=runs_dir)
    assert run.results(timeout=120) == {0: [False, True, False], 1: [False, True, False]}


def accelerator_with_plugin() -> str:
    from nbaccel import Accelerator
    from nbaccel.utils import FullyShardedDataParallelPlugin, GradScalerKwargs

    acc = Accelerator(
        mixed_precision="bf16",
        fsdp_plugin=FullyShardedDataParallelPlugin(reshard_after_forward=False),
        kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)],
    )
    return acc.distributed_type.value


def test_what_the_workers_accelerator_changed_reaches_the_run_folder_and_output(
    runs_dir: str, capsys: Any
) -> None:
    import json

    run = nbaccel.launch(accelerator_with_plugin, num_processes=2, runs_dir=runs_dir)
    assert run.result(timeout=120) == "FSDP"
    written = json.loads((run.run_dir / "accelerator_config.json").read_text())
    assert written["values"]["strategy"] == "fsdp"
    assert written["values"]["mixed_precision"] == "bf16"
    assert written["values"]["fsdp_sharding_strategy"] == "SHARD_GRAD_OP"
    assert written["sources"]["fsdp_sharding_strategy"] == "plugin: FullyShardedDataParallelPlugin"
    assert written["sources"]["mixed_precision"] == "Accelerator argument"
    assert (run.run_dir / "accelerator_config.json").stat().st_mode & 0o777 == 0o600
    assert "nbaccel: settings: " in capsys.readouterr().out
