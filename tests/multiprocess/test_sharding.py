"""FSDP2 and ZeRO-1 through the Accelerator, on 2 CPU processes (gloo).

Parity is against one process on the full batch with SGD (FACTS.md: Adam's rounding noise
in zero-gradient parameters hides real differences); tolerance 1e-6 on float32 weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import nbaccel

pytestmark = pytest.mark.timeout(240)
TOLERANCE = 1e-6


def blocks_model() -> Any:
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.inner(x))

    torch.manual_seed(0)  # FSDP2 does not broadcast initial weights: seed identically
    return torch.nn.Sequential(Block(), Block(), Block(), torch.nn.Linear(8, 1))


def full_weights(model: Any) -> dict[str, Any]:
    """The whole tensors of a plain or sharded model (every rank must call it)."""
    return {
        name: getattr(t, "full_tensor", t.detach)().detach().clone()
        for name, t in model.state_dict().items()
    }


def train_blocks(per_rank: int, accumulation: int, steps: int = 3, **settings: Any) -> Any:
    """SGD on fixed data; rank r takes rows [r*per_rank, (r+1)*per_rank) of every batch."""
    import torch
    import torch.distributed as dist

    reductions = [0]
    real = dist.reduce_scatter_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        reductions[0] += 1
        return real(*args, **kwargs)

    dist.reduce_scatter_single = counted  # FSDP2 looks it up on every call
    acc = nbaccel.Accelerator(gradient_accumulation_steps=accumulation, **settings)
    model = blocks_model()
    forwards = [0]
    model[0].inner.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    data = torch.randn(steps * accumulation, 8, 8, generator=torch.Generator().manual_seed(1))
    start = acc.process_index * per_rank
    losses = []
    for batch in data:
        with acc.accumulate(model):
            loss = model(batch[start : start + per_rank]).pow(2).mean()
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.dtype)
    return {
        "type": acc.distributed_type.value,
        "weights": full_weights(acc.unwrap_model(model)),
        "units": sorted(
            name for name, m in model.named_modules() if type(m).__name__.startswith("FSDP")
        ),
        "compiled": sorted(
            name for name, m in model.named_modules() if m._compiled_call_impl is not None
        ),
        "offloaded": offloaded_units(model),
        "reductions": reductions[0],
        "forwards_per_step": forwards[0] / len(data),
        "loss_dtype": str(losses[0]),
        "master_dtype": str(next(model.parameters()).dtype),
    }


def offloaded_units(model: Any) -> list[str]:
    """Shard units whose parameters FSDP2 keeps on the CPU between uses (their parameter
    group's CPUOffloadPolicy; torch's private attributes: a release that moves them fails
    here, not silently)."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None and all(p.offload_to_cpu for p in group.fsdp_params):
                assert type(group.offload_policy).__name__ == "CPUOffloadPolicy"
                found.append(name)
    return sorted(found)


def assert_close(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert float((a[name] - b[name]).abs().max()) < TOLERANCE, name


BY_CLASS = {
    "strategy": "fsdp",
    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "fsdp_transformer_layer_cls": "Block",
}


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_fsdp_matches_one_process_on_the_full_batch(
    runs_dir: str, sharding: str, accumulation: int
) -> None:
    one = nbaccel.notebook_launcher(
        train_blocks, args=(8, accumulation), num_processes=1, runs_dir=runs_dir
    )
    two = nbaccel.notebook_launcher(
        train_blocks,
        args=(4, accumulation),
        num_processes=2,
        runs_dir=runs_dir,
        fsdp_sharding_strategy=sharding,
        **BY_CLASS,
    )
    assert two["type"] == "FSDP"
    assert two["units"] == ["", "0", "1", "2"]  # each Block, then the root
    assert_close(one["weights"], two["weights"])


def test_accumulation_reduces_gradients_only_on_the_syncing_step(runs_dir: str) -> None:
    # 4 shard units (3 blocks + root) -> one reduce-scatter each per synced backward.
    synced_every_step = nbaccel.notebook_launcher(
        train_blocks, args=(4, 1, 4), num_processes=2, runs_dir=runs_dir, **BY_CLASS
    )
    accumulating = nbaccel.notebook_launcher(
        train_blocks, args=(4, 4, 1), num_processes=2, runs_dir=runs_dir, **BY_CLASS
    )
    assert synced_every_step["reductions"] == 4 * 4
    assert accumulating["reductions"] == 4  # 4 micro-steps, only the last one reduces
    # sync_each_batch trades that back for sharded gradients between micro-steps.
    each = nbaccel.notebook_launcher(
        train_blocks,
        args=(4, 4, 1),
        num_processes=2,
        runs_dir=runs_dir,
        sync_each_batch=True,
        **BY_CLASS,
    )
    assert each["reductions"] == 4 * 4
    assert_close(accumulating["weights"], each["weights"])


def test_wrapping_by_size_and_none(runs_dir: str) -> None:
    by_size = nbaccel.notebook_launcher(
        train_blocks,
        args=(4, 1, 1),
        num_processes=2,
        runs_dir=runs_dir,
        strategy="fsdp",
        fsdp_auto_wrap_policy="SIZE_BASED_WRAP",
        fsdp_min_num_params=72,  # a Block's Linear has 72 parameters, the head 9
    )
    # The innermost module that reaches the size becomes the unit, as in torch's policy.
    assert by_size["units"] == ["", "0.inner", "1.inner", "2.inner"]
    none = nbaccel.notebook_launcher(
        train_blocks,
        args=(4, 1, 1),
        num_processes=2,
        runs_dir=runs_dir,
        strategy="fsdp",
        fsdp_auto_wrap_policy="NO_WRAP",
    )
    assert none["units"] == [""]


def test_dynamo_compiles_each_shard_unit(runs_dir: str) -> None:
    one = nbaccel.notebook_launcher(train_blocks, args=(8, 1), num_processes=1, runs_dir=runs_dir)
    compiled = nbaccel.notebook_launcher(
        train_blocks,
        args=(4, 1),
        num_processes=2,
        runs_dir=runs_dir,
        dynamo_backend="aot_eager",  # inductor's cold compile is ~40 s here; same path
        **BY_CLASS,
    )
    assert compiled["compiled"] == ["0", "1", "2"]  # the blocks; compiling the root does not
    assert_close(one["weights"], compiled["weights"])


def test_a_layer_class_that_is_not_in_the_model_names_close_matches(runs_dir: str) -> None:
    settings = {**BY_CLASS, "fsdp_transformer_layer_cls": "Blok"}
    with pytest.raises(nbaccel.ConfigError, match=r"'Blok' \(did you mean 'Block'\?\)"):
        nbaccel.notebook_launcher(
            train_blocks, args=(4, 1), num_processes=2, runs_dir=runs_dir, **settings
        )


def test_activation_checkpointing_recomputes_blocks_and_keeps_results(runs_dir: str) -> None:
    plain = nbaccel.notebook_launcher(
        train_blocks, args=(4, 1), num_processes=2, runs_dir=runs_dir, **BY_CLASS
    )
    recomputed = nbaccel.notebook_launcher(
        train_blocks,
        args=(4, 1),
        num_processes=2,
        runs_dir=runs_dir,
        fsdp_activation_checkpointing=True,
        **BY_CLASS,
    )
    assert plain["forwards_per_step"] == 1
    assert recomputed["forwards_per_step"] == 2  # forward, and again in backward
    assert_close(plain["weights"], recomputed["weights"])


def test_cpu_offload_trains_the_same(runs_dir: str) -> None:
    plain = nbaccel.notebook_launcher(
        train_blocks, args=(4, 2), num_processes=2, runs_dir=runs_dir, **BY_CLASS
    )
    offloaded = nbaccel.notebook_launcher(
        train_blocks,
        args=(4, 2),
        num_processes=2,
        runs_dir=runs_dir,
        fsdp_cpu_offload=True,
        **BY_CLASS,
    )
    # On CPU processes the numbers cannot tell offload from none: the policy must be there.
    assert plain["offloaded"] == [] and offloaded["offloaded"] == ["", "0", "1", "2"]
    assert_close(plain["weights"], offloaded["weights"])


def precision_inside(mode: str) -> dict[str, Any]:
    import torch

    acc = nbaccel.Accelerator(mixed_precision=mode)
    model = blocks_model()
    seen: list[str] = []
    model[0].inner.register_forward_hook(lambda m, i, o: seen.append(str(m.weight.dtype)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    out = model(torch.randn(4, 8))
    acc.backward(out.pow(2).mean())
    optimizer.step()
    return {
        "compute": seen[0],
        "output": str(out.dtype),
        "master": str(next(model.parameters()).dtype),
        "scaler": type(acc.scaler).__name__,
    }


@pytest.mark.parametrize(
    ("mode", "compute", "scaler"),
    [("bf16", "torch.bfloat16", "NoneType"), ("fp16", "torch.float16", "ShardedGradScaler")],
)
def test_mixed_precision_policy_follows_mixed_precision(
    runs_dir: str, mode: str, compute: str, scaler: str
) -> None:
    result = nbaccel.notebook_launcher(
        precision_inside, args=(mode,), num_processes=2, runs_dir=runs_dir, **BY_CLASS
    )
    # Parameters gathered in low precision for compute, fp32 master shards, fp32 outputs.
    assert result == {
        "compute": compute,
        "output": "torch.float32",
        "master": "torch.float32",
        "scaler": scaler,
    }


def save_sharded(checkpoint: str, directory: str) -> dict[str, Any]:
    import torch

    acc = nbaccel.Accelerator()
    model = blocks_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer = acc.prepare(model, optimizer)
    for _ in range(2):
        acc.backward(model(torch.ones(4, 8)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    acc.save_state(checkpoint)
    acc.save_model(model, directory)
    return full_weights(model)


def load_sharded(checkpoint: str) -> dict[str, Any]:
    import torch

    acc = nbaccel.Accelerator()
    model = blocks_model()
    torch.nn.init.zeros_(model[3].weight)  # so a load that does nothing is caught
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer = acc.prepare(model, optimizer)
    acc.load_state(checkpoint)
    weights = full_weights(model)
    # Optimizer state came back too: the next step moves the weights the same way.
    acc.backward(model(torch.ones(4, 8)).pow(2).mean())
    optimizer.step()
    return {"weights": weights, "after_step": full_weights(model), "type": acc.distributed_type}


@pytest.mark.parametrize(("saved_by", "loaded_by"), [(2, 1), (1, 2), (2, 2)])
def test_sharded_checkpoints_load_onto_another_number_of_processes(
    tmp_path: Path, runs_dir: str, saved_by: int, loaded_by: int
) -> None:
    import torch
    from safetensors.torch import load_file

    checkpoint, export = str(tmp_path / "ckpt"), tmp_path / "export"
    settings = {"runs_dir": runs_dir, **BY_CLASS}
    saved = nbaccel.notebook_launcher(
        save_sharded, args=(checkpoint, str(export)), num_processes=saved_by, **settings
    )
    loaded = nbaccel.notebook_launcher(
        load_sharded, args=(checkpoint,), num_processes=loaded_by, **settings
    )
    assert_close(saved, loaded["weights"])
    reference = nbaccel.notebook_launcher(
        load_sharded, args=(checkpoint,), num_processes=saved_by, **settings
    )
    assert_close(reference["after_step"], loaded["after_step"])
    # save_model: one consolidated file with whole tensors, whatever the process count.
    exported = load_file(export / "model.safetensors")
    assert list(export.iterdir()) == [export / "model.safetensors"]
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name


def test_loading_a_checkpoint_of_another_layout_or_model_changes_nothing(
    tmp_path: Path, runs_dir: str
) -> None:
    checkpoint = str(tmp_path / "ckpt")
    nbaccel.notebook_launcher(
        save_sharded,
        args=(checkpoint, str(tmp_path / "x")),
        num_processes=2,
        runs_dir=runs_dir,
        **BY_CLASS,
    )
    with pytest.raises(ValueError, match=r"holds the 'sharded' model layout.*'plain'"):
        nbaccel.notebook_launcher(
            load_sharded, args=(checkpoint,), num_processes=2, runs_dir=runs_dir
        )
    with pytest.raises(
        ValueError, match=r"does not match the prepared.*3\.weight: saved \(1, 8\), now \(2, 8\)"
    ):
        nbaccel.notebook_launcher(
            load_wider, args=(checkpoint,), num_processes=2, runs_dir=runs_dir, strategy="fsdp"
        )


def load_wider(checkpoint: str) -> None:
    import torch

    acc = nbaccel.Accelerator()
    model = blocks_model()
    model[3] = torch.nn.Linear(8, 2)  # the same names, one shape differs
    torch.nn.init.constant_(model[0].inner.weight, 7.0)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = acc.prepare(model, optimizer)
    try:
        acc.load_state(checkpoint)
    finally:
        weight = model[0].inner.weight.full_tensor()
        assert bool((weight == 7.0).all()), "a failed load changed the weights"


def train_zero1(per_rank: int, steps: int = 4) -> dict[str, Any]:
    import torch

    acc = nbaccel.Accelerator()
    model = blocks_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, schedule = acc.prepare(model, optimizer, schedule)
    data = torch.randn(steps, 8, 8, generator=torch.Generator().manual_seed(1))
    start = acc.process_index * per_rank
    for batch in data:
        acc.backward(model(batch[start : start + per_rank]).pow(2).mean())
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    inner = optimizer.optimizer
    local = getattr(inner, "optim", inner)  # ZeroRedundancyOptimizer keeps its part here
    return {
        "weights": full_weights(acc.unwrap_model(model)),
        "optimizer": type(inner).__name__,
        "states_here": sum(1 for s in local.state.values() if s),
        "lr": inner.param_groups[0]["lr"],  # ZeRO copies it to its part at each step
    }


def test_zero1_shards_the_optimizer_state_and_trains_like_ddp(runs_dir: str) -> None:
    ddp = nbaccel.notebook_launcher(train_zero1, args=(4,), num_processes=2, runs_dir=runs_dir)
    zero = nbaccel.notebook_launcher(
        train_zero1, args=(4,), num_processes=2, runs_dir=runs_dir, shard_optimizer_state=True
    )
    assert (ddp["optimizer"], zero["optimizer"]) == ("AdamW", "ZeroRedundancyOptimizer")
    assert ddp["states_here"] == 8  # every parameter's Adam state on every rank
    assert 0 < zero["states_here"] < 8  # rank 0 holds only its partition
    assert zero["lr"] == ddp["lr"] == 0.05 * 0.5**8  # the schedule drives ZeRO's optimizer
    for name in ddp["weights"]:
        assert float((ddp["weights"][name] - zero["weights"][name]).abs().max()) < 1e-6


def train_hybrid(processes_per_machine: int) -> dict[str, Any]:
    """HYBRID_SHARD as if the 2 processes sat on 2 / processes_per_machine machines."""
    import dataclasses

    import torch

    from nbaccel.accel.strategies import sharding
    from nbaccel.config.sections import FSDPOptions

    acc = nbaccel.Accelerator()  # only for rank and device: sharding is applied directly
    state = dataclasses.replace(acc.strategy.state, local_world_size=processes_per_machine)
    model = blocks_model()
    options = FSDPOptions(sharding_strategy="HYBRID_SHARD", transformer_layer_cls="Block")
    sharding.shard_model(model, options, state, None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(1))
    for batch in data:
        model(batch[acc.process_index * 4 :][:4]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    weight = model[0].inner.weight
    return {
        "mesh": tuple(weight.device_mesh.shape),
        "placements": [type(p).__name__ for p in weight.placements],
        "weights": full_weights(model),
    }


def test_hybrid_shard_shards_within_a_machine_and_replicates_across(runs_dir: str) -> None:
    one = nbaccel.notebook_launcher(train_blocks, args=(8, 1), num_processes=1, runs_dir=runs_dir)
    across = nbaccel.notebook_launcher(train_hybrid, args=(1,), num_processes=2, runs_dir=runs_dir)
    within = nbaccel.notebook_launcher(train_hybrid, args=(2,), num_processes=2, runs_dir=runs_dir)
    assert across["mesh"] == (2, 1) and within["mesh"] == (1, 2)  # (machines, per machine)
    assert across["placements"] == within["placements"] == ["Replicate", "Shard"]
    assert_close(one["weights"], across["weights"])
    assert_close(one["weights"], within["weights"])


def save_twice_dying_inside_dcp(checkpoint: str, victim: int) -> None:
    """Save after 2 steps; in the next save, ``victim`` dies while DCP writes its shards."""
    import os
    import signal

    import torch

    import nbaccel.accel.checkpoints.sharded_checkpoint as sharded

    acc = nbaccel.Accelerator()
    model = blocks_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)

    def train() -> None:
        for _ in range(2):
            acc.backward(model(torch.ones(4, 8)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()

    train()
    acc.save_state(checkpoint)
    expected = full_weights(model)
    if acc.is_main_process:
        torch.save(expected, f"{checkpoint}-expected.pt")
    train()
    real_save = sharded.dcp_save

    def die_while_writing(state: Any, checkpoint_id: Any) -> Any:
        if acc.process_index == victim:  # a torn shard file, as a crash mid-write leaves
            Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
            (Path(checkpoint_id) / f"__{victim}_0.distcp").write_bytes(b"torn")
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(state, checkpoint_id=checkpoint_id)

    sharded.dcp_save = die_while_writing
    acc.save_state(checkpoint)


def load_and_save_again(checkpoint: str) -> dict[str, Any]:
    import torch

    acc = nbaccel.Accelerator()
    model = blocks_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    acc.load_state(checkpoint)
    acc.save_state(checkpoint)  # a later save clears what the killed one left
    return full_weights(model)


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_while_writing_shards_leaves_the_previous_checkpoint_whole(
    tmp_path: Path, runs_dir: str, victim: int
) -> None:
    import torch

    checkpoint = tmp_path / "ckpt"
    run = nbaccel.launch(
        save_twice_dying_inside_dcp,
        args=(str(checkpoint), victim),
        num_processes=2,
        runs_dir=runs_dir,
        **BY_CLASS,
    )
    with pytest.raises(nbaccel.WorkerError) as failure:
        run.result(timeout=120)
    assert failure.value.rank == victim and failure.value.signal_name == "SIGKILL"
    assert list(checkpoint.glob(".partial-*/sharded")), "the kill should hit the second save"
    restored = nbaccel.notebook_launcher(
        load_and_save_again,
        args=(str(checkpoint),),
        num_processes=2,
        runs_dir=runs_dir,
        **BY_CLASS,
    )
    assert_close(torch.load(f"{checkpoint}-expected.pt", weights_only=True), restored)
    assert not list(checkpoint.glob(".partial-*"))
    assert len(list(checkpoint.glob("state-*"))) == 1


def train_clipped(per_rank: int) -> dict[str, Any]:
    import torch

    acc = nbaccel.Accelerator()
    model = blocks_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = acc.prepare(model, optimizer)
    data = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(1))
    norms = []
    for batch in data:
        acc.backward(model(batch[acc.process_index * per_rank :][:per_rank]).pow(2).mean())
        norm = acc.clip_grad_norm_(model.parameters(), max_norm=0.05)
        norms.append((type(norm).__name__, round(float(norm), 6)))
        optimizer.step()
        optimizer.zero_grad()
    return {"norms": norms, "weights": full_weights(acc.unwrap_model(model))}


def test_clip_grad_norm_clips_the_global_norm_of_sharded_gradients(runs_dir: str) -> None:
    one = nbaccel.notebook_launcher(train_clipped, args=(8,), num_processes=1, runs_dir=runs_dir)
    two = nbaccel.notebook_launcher(
        train_clipped, args=(4,), num_processes=2, runs_dir=runs_dir, **BY_CLASS
    )
    # The norm over all shards (a plain tensor, not a DTensor), equal to one process's.
    assert two["norms"] == one["norms"]
    assert all(kind == "Tensor" and norm > 0.05 for kind, norm in two["norms"])  # it clipped
    assert_close(one["weights"], two["weights"])


def prepare_only() -> int:

    acc = nbaccel.Accelerator()
    model = acc.prepare(blocks_model())
    return sum(p.numel() for p in model.parameters())


def test_the_dashboard_estimates_the_prepared_models_memory(runs_dir: str) -> None:
    from nbaccel.hardware.memory_estimate import estimate_for_config
    from nbaccel.ui.attach import dashboard_for

    # dashboard=True outside a kernel builds the widgets without showing them.
    run = nbaccel.launch(
        prepare_only, num_processes=2, runs_dir=runs_dir, dashboard=True, **BY_CLASS
    )
    params = run.result(timeout=120)
    dashboard = dashboard_for(run)
    assert dashboard is not None and dashboard.model.estimate is not None
    assert params == 3 * 72 + 9  # counted by rank 0 in prepare and sent to the parent
    expected = estimate_for_config(run.config, params, world_size=2)
    assert dashboard.model.estimate == expected
    assert "Estimate for the prepared model, model states only" in dashboard.summary_text
    assert expected.describe() in dashboard.summary_text
