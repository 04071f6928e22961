"""The ZeRO / FSDP memory arithmetic behind the config panel's estimate, and its inputs."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from nbaccel.config.schema import Config, DeepSpeedOptions, FSDPOptions
from nbaccel.hardware.memory_estimate import (
    STAGES,
    MemoryEstimate,
    count_parameters,
    estimate_for_config,
    estimate_memory,
    sharding_stage,
)

PSI = 1_000_000  # Ψ: parameters
MB = 1_000_000


def states(e: MemoryEstimate) -> int:
    """Parameters + gradients + optimizer state: the paper's "model states"."""
    return e.parameters + e.gradients + e.optimizer_state


def parts(e: MemoryEstimate) -> tuple[float, ...]:
    return tuple(x / MB for x in (e.parameters, e.gradients, e.optimizer_state, e.buffers, e.host))


# --------------------------------------------------------------------------- the paper


def test_the_papers_mixed_precision_table_with_the_deepspeed_engine() -> None:
    # ZeRO paper §5: 2Ψ fp16 params, 2Ψ fp16 grads, KΨ optimizer (K = 12: fp32 master + Adam).
    n, k = 2, 12
    expected = {
        "ddp": (2 + 2 + k) * PSI,
        "zero1": (2 + 2 + k / n) * PSI,
        "zero2": (2 + (2 + k) / n) * PSI,
        "zero3": (2 + 2 + k) / n * PSI,
    }
    for stage, total in expected.items():
        for precision in ("bf16", "fp16"):
            e = estimate_memory(
                PSI, world_size=n, stage=stage, mixed_precision=precision, engine="deepspeed"
            )
            assert e.total == total, (stage, precision)
            assert e.buffers == 0 and e.host == 0


def test_fp32_adam_model_states_per_stage_on_two_processes() -> None:
    # 16 / 12 / 8 MB as in the paper's fp32 reading; ZeRO-2 is 12, not the paper's 10:
    # FSDP keeps the fp32 shard *and* the whole gathered parameters from forward to backward.
    got = {s: estimate_memory(PSI, world_size=2, stage=s) for s in STAGES}
    assert {s: states(e) / MB for s, e in got.items()} == {
        "ddp": 16,
        "zero1": 12,
        "zero2": 12,
        "zero3": 8,
    }
    assert parts(got["ddp"]) == (4, 4, 8, 4, 0)  # + DDP's gradient buckets
    assert parts(got["zero1"]) == (4, 4, 4, 4, 0)
    assert parts(got["zero2"]) == (2 + 4, 2, 4, 0, 0)  # fp32 shard + gathered params
    assert parts(got["zero3"]) == (2, 2, 4, 0, 0)
    assert [e.total / MB for e in got.values()] == [20, 16, 12, 8]


def test_gradient_as_bucket_view_drops_ddps_bucket_copy() -> None:
    for stage, total in (("ddp", 16), ("zero1", 12)):
        e = estimate_memory(PSI, world_size=2, stage=stage, gradient_as_bucket_view=True)
        assert e.buffers == 0 and e.total == total * MB
    # FSDP stages have no DDP buckets either way.
    assert estimate_memory(PSI, world_size=2, stage="zero3").buffers == 0


def test_more_processes_shard_finer() -> None:
    e = estimate_memory(PSI, world_size=8, stage="zero3")
    assert parts(e) == (0.5, 0.5, 1, 0, 0)
    e = estimate_memory(PSI, world_size=8, stage="zero1")
    assert parts(e) == (4, 4, 1, 4, 0)


def test_one_process_shards_nothing() -> None:
    assert states(estimate_memory(PSI, world_size=1, stage="zero3")) == 16 * MB
    assert states(estimate_memory(PSI, world_size=1, stage="zero1")) == 16 * MB


def test_uneven_shards_round_up() -> None:
    e = estimate_memory(3, world_size=2, stage="zero3", optimizer="sgd")
    assert (e.parameters, e.gradients, e.optimizer_state) == (6, 6, 0)


# --------------------------------------------------------------------------- precision


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_under_ddp_keeps_fp32_parameters_and_gradients(precision: str) -> None:
    for stage in ("ddp", "zero1"):
        low = estimate_memory(PSI, world_size=2, stage=stage, mixed_precision=precision)
        assert low == estimate_memory(PSI, world_size=2, stage=stage)  # autocast casts on the fly


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_under_fsdp(precision: str) -> None:
    zero2 = estimate_memory(PSI, world_size=2, stage="zero2", mixed_precision=precision)
    # fp32 shard 2 MB + the gathered 16-bit parameters 2 MB; fp32 gradient shards.
    assert parts(zero2) == (2 + 2, 2, 4, 0, 0)
    zero3 = estimate_memory(PSI, world_size=2, stage="zero3", mixed_precision=precision)
    assert zero3 == estimate_memory(PSI, world_size=2, stage="zero3")  # one block at a time


def test_deepspeed_fp32_keeps_an_fp32_partition_in_its_zero_optimizer() -> None:
    e = estimate_memory(PSI, world_size=2, stage="zero1", engine="deepspeed")
    assert parts(e) == (4, 4, (4 + 8) / 2, 0, 0)
    e = estimate_memory(PSI, world_size=2, stage="ddp", engine="deepspeed")
    assert parts(e) == (4, 4, 8, 0, 0)  # stage 0, fp32: the plain optimizer


def test_accumulating_without_sync_keeps_fsdp_gradients_whole() -> None:
    # accumulate(model): FSDP keeps whole fp32 gradients between unsynced micro-steps.
    for precision in ("no", "bf16"):
        for stage in ("zero2", "zero3"):
            plain = estimate_memory(PSI, world_size=2, stage=stage, mixed_precision=precision)
            e = estimate_memory(
                PSI,
                world_size=2,
                stage=stage,
                mixed_precision=precision,
                no_sync_accumulation=True,
            )
            assert e.gradients == 4 * MB and plain.gradients == 2 * MB
            assert e.total == plain.total + 2 * MB
    for stage in ("ddp", "zero1"):  # DDP gradients are whole anyway
        e = estimate_memory(PSI, world_size=2, stage=stage, no_sync_accumulation=True)
        assert e == estimate_memory(PSI, world_size=2, stage=stage)
    for flag in (True, False):  # DeepSpeed accumulates into its partitions
        e = estimate_memory(
            PSI, world_size=2, stage="zero3", engine="deepspeed", no_sync_accumulation=flag
        )
        assert e.gradients == 2 * MB  # fp32 gradient partitions
    offload = estimate_memory(
        PSI, world_size=2, stage="zero3", cpu_offload=True, no_sync_accumulation=True
    )
    assert parts(offload) == (0, 4, 0, 0, 8)  # the accumulators stay on the device


def test_estimate_for_config_assumes_accumulate_model_when_accumulating() -> None:
    config = Config(num_processes=2, strategy="fsdp", gradient_accumulation_steps=4)
    assert estimate_for_config(config, PSI).gradients == 4 * MB
    assert estimate_for_config(config, PSI, no_sync_accumulation=False).gradients == 2 * MB
    assert estimate_for_config(config.replace(gradient_accumulation_steps=1), PSI).gradients == (
        2 * MB
    )


# --------------------------------------------------------------------------- optimizers


@pytest.mark.parametrize(
    ("optimizer", "state_mb"),
    [("adamw", 8), ("adam", 8), ("sgd_momentum", 4), ("sgd", 0), ("adagrad", 4), ("rmsprop", 4)],
)
def test_optimizer_state_per_parameter(optimizer: str, state_mb: int) -> None:
    ddp = estimate_memory(PSI, world_size=2, stage="ddp", optimizer=optimizer)
    assert ddp.optimizer_state == state_mb * MB
    zero1 = estimate_memory(PSI, world_size=2, stage="zero1", optimizer=optimizer)
    assert zero1.optimizer_state == state_mb * MB // 2


# --------------------------------------------------------------------------- offload


def test_fsdp_cpu_offload_moves_the_shards_to_the_host() -> None:
    zero3 = estimate_memory(PSI, world_size=2, stage="zero3", cpu_offload=True)
    assert parts(zero3) == (0, 0, 0, 0, 2 + 2 + 4)
    assert zero3.total == 0
    zero2 = estimate_memory(PSI, world_size=2, stage="zero2", cpu_offload=True)
    assert parts(zero2) == (4, 0, 0, 0, 8)  # the gathered parameters stay on the device
    zero2 = estimate_memory(
        PSI, world_size=2, stage="zero2", cpu_offload=True, mixed_precision="bf16"
    )
    assert parts(zero2) == (2, 0, 0, 0, 8)


def test_deepspeed_offload() -> None:
    kw: dict[str, object] = {"world_size": 2, "mixed_precision": "bf16", "engine": "deepspeed"}
    zero2 = estimate_memory(PSI, stage="zero2", cpu_offload=True, **kw)  # type: ignore[arg-type]
    assert parts(zero2) == (2, 0, 0, 0, 1 + 6)
    zero1 = estimate_memory(PSI, stage="zero1", cpu_offload=True, **kw)  # type: ignore[arg-type]
    assert parts(zero1) == (2, 2, 0, 0, 6)  # stage 1 does not partition gradients
    zero3 = estimate_memory(
        PSI,
        stage="zero3",
        cpu_offload=True,
        offload_parameters=True,
        **kw,  # type: ignore[arg-type]
    )
    assert parts(zero3) == (0, 0, 0, 0, 1 + 1 + 6)


# --------------------------------------------------------------------------- config forms


@pytest.mark.parametrize(
    ("config", "stage"),
    [
        (Config(), "ddp"),
        (Config(strategy="ddp"), "ddp"),
        (Config(shard_optimizer_state=True), "zero1"),
        (Config(strategy="ddp", shard_optimizer_state=True), "zero1"),
        (Config(strategy="fsdp"), "zero3"),
        (Config(strategy="fsdp", fsdp=FSDPOptions(sharding_strategy="FULL_SHARD")), "zero3"),
        (Config(strategy="fsdp", fsdp=FSDPOptions(sharding_strategy="SHARD_GRAD_OP")), "zero2"),
        (Config(strategy="fsdp", fsdp=FSDPOptions(sharding_strategy="NO_SHARD")), "ddp"),
        (
            Config(
                strategy="fsdp", num_machines=2, fsdp=FSDPOptions(sharding_strategy="HYBRID_SHARD")
            ),
            "zero3",
        ),
        (Config(strategy="deepspeed", deepspeed=DeepSpeedOptions(zero_stage=0)), "ddp"),
        (Config(strategy="deepspeed", deepspeed=DeepSpeedOptions(zero_stage=1)), "zero1"),
        (Config(strategy="deepspeed"), "zero2"),  # DeepSpeed's default stage is 2
        (Config(strategy="deepspeed", deepspeed=DeepSpeedOptions(zero_stage=3)), "zero3"),
        (Config(strategy="xla"), "ddp"),
    ],
)
def test_sharding_stage(config: Config, stage: str) -> None:
    assert sharding_stage(config) == stage


def test_estimate_for_config_reads_processes_precision_and_offload() -> None:
    config = Config(num_processes=2, strategy="fsdp", fsdp=FSDPOptions(cpu_offload=True))
    assert estimate_for_config(config, PSI) == estimate_memory(
        PSI, world_size=2, stage="zero3", cpu_offload=True
    )
    config = Config(num_processes=2, shard_optimizer_state=True, mixed_precision="bf16")
    assert estimate_for_config(config, PSI, optimizer="sgd_momentum") == estimate_memory(
        PSI, world_size=2, stage="zero1", optimizer="sgd_momentum"
    )
    assert estimate_for_config(Config(), PSI, world_size=4).total == 20 * MB


def test_hybrid_shard_divides_within_one_machine() -> None:
    config = Config(
        num_processes=8,  # in all: 4 on each of the 2 machines
        num_machines=2,
        strategy="fsdp",
        fsdp=FSDPOptions(sharding_strategy="HYBRID_SHARD"),
    )
    e = estimate_for_config(config, PSI)
    assert e == estimate_memory(PSI, world_size=8, stage="zero3", shard_group_size=4)
    assert parts(e) == (1, 1, 2, 0, 0)  # over 4 processes, not 8


def test_the_world_size_is_num_processes_itself_over_several_machines() -> None:
    config = Config(num_processes=4, num_machines=2, strategy="fsdp")
    assert estimate_for_config(config, PSI) == estimate_memory(PSI, world_size=4, stage="zero3")


def test_the_panel_estimate_uses_the_total_and_this_machines_share() -> None:
    from nbaccel.ui.panel.config_widgets import memory_report

    config = Config(num_processes=4, num_machines=2, strategy="fsdp", use_cpu=True)
    text = memory_report(config, PSI, gpus=0, limit=lambda config, on_gpu: (10**12, "RAM"))
    zero3_over_4 = estimate_memory(PSI, world_size=4, stage="zero3")
    assert zero3_over_4.describe() in text  # world size 4, not 8
    assert "for 2 processes here" in text  # this machine's 2 of the 4
    unset = Config(num_machines=2, strategy="fsdp")  # one per GPU on each machine: 2 × 3
    text = memory_report(unset, PSI, gpus=3, limit=lambda config, on_gpu: None)
    assert estimate_memory(PSI, world_size=6, stage="zero3").describe() in text


def test_no_shard_is_fsdp_with_groups_of_one() -> None:
    # nbaccel's NO_SHARD is FSDP2 on a (world, 1) mesh: DDP's figures, no gradient buckets.
    options = FSDPOptions(sharding_strategy="NO_SHARD")
    config = Config(num_processes=2, strategy="fsdp", fsdp=options)
    assert parts(estimate_for_config(config, PSI)) == (4, 4, 8, 0, 0)
    bf16 = config.replace(mixed_precision="bf16")
    assert parts(estimate_for_config(bf16, PSI)) == (4, 4, 8, 0, 0)
    offload = config.replace(fsdp_cpu_offload=True)
    assert parts(estimate_for_config(offload, PSI)) == (0, 0, 0, 0, 16)


def test_deepspeed_config_offload_devices() -> None:
    options = DeepSpeedOptions(
        zero_stage=3, offload_optimizer_device="cpu", offload_param_device="nvme"
    )
    config = Config(
        num_processes=2, strategy="deepspeed", deepspeed=options, mixed_precision="bf16"
    )
    assert estimate_for_config(config, PSI) == estimate_memory(
        PSI,
        world_size=2,
        stage="zero3",
        mixed_precision="bf16",
        engine="deepspeed",
        cpu_offload=True,
        offload_parameters=True,
    )
    stage0 = DeepSpeedOptions(zero_stage=0, offload_optimizer_device="cpu")  # ignored there
    config = Config(num_processes=2, strategy="deepspeed", deepspeed=stage0)
    assert estimate_for_config(config, PSI).host == 0


def test_estimate_for_config_needs_a_process_count() -> None:
    with pytest.raises(ValueError, match="Pass world_size="):
        estimate_for_config(Config(), PSI)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"stage": "zero4"}, r"stage='zero4' is not one of 'ddp', 'zero1', 'zero2', 'zero3'"),
        ({"mixed_precision": "fp8"}, r"mixed_precision='fp8' is not one of 'no', 'fp16'"),
        ({"optimizer": "lion"}, r"optimizer='lion' is not one of 'adamw'"),
        ({"engine": "megatron"}, r"engine='megatron' is not one of 'torch', 'deepspeed'"),
        ({"num_params": -1}, r"num_params must be an int >= 0, got -1"),
        ({"num_params": 1.5e6}, r"num_params must be an int >= 0, got 1500000.0"),
        ({"num_params": True}, r"num_params must be an int >= 0, got True"),
        ({"world_size": 0}, r"world_size must be an int >= 1, got 0"),
        ({"shard_group_size": 3, "world_size": 4}, r"must divide world_size=4"),
        ({"shard_group_size": 0}, r"shard_group_size=0 must divide"),
        ({"cpu_offload": True, "stage": "ddp"}, r"shards nothing\. Use stage 'zero2' or"),
        ({"cpu_offload": True, "stage": "zero1"}, r"ZeroRedundancyOptimizer, which has no"),
        ({"offload_parameters": True, "stage": "zero3"}, r"FSDP's cpu_offload already"),
        (
            {"offload_parameters": True, "stage": "zero2", "engine": "deepspeed"},
            r"offload_parameters=True is DeepSpeed's ZeRO-3 offload_param",
        ),
    ],
)
def test_bad_arguments_name_the_fix(changes: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"num_params": PSI, "world_size": 2, "stage": "zero3"}
    with pytest.raises(ValueError, match=message):
        estimate_memory(**{**arguments, **changes})  # type: ignore[arg-type]


def test_deepspeed_zero1_may_offload() -> None:
    e = estimate_memory(PSI, world_size=2, stage="zero1", engine="deepspeed", cpu_offload=True)
    assert e.optimizer_state == 0 and e.host > 0


# --------------------------------------------------------------------------- results


def test_estimate_is_frozen_and_describes_itself() -> None:
    e = estimate_memory(PSI, world_size=2, stage="ddp")
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.parameters = 0  # type: ignore[misc]
    assert e.describe() == (
        "19.07 MiB per device: parameters 3.81, gradients 3.81, optimizer 7.63, DDP buckets 3.81"
    )
    big = estimate_memory(7 * 10**9, world_size=8, stage="zero3", mixed_precision="bf16")
    assert big.describe() == (
        "13.04 GiB per device: parameters 3.26, gradients 3.26, optimizer 6.52"
    )
    off = estimate_memory(PSI, world_size=2, stage="zero3", cpu_offload=True)
    assert off.describe() == (
        "0.00 MiB per device: parameters 0.00, gradients 0.00, optimizer 0.00; host memory 7.63 MiB"
    )
    assert "KiB" in estimate_memory(10, world_size=1, stage="ddp").describe()


# --------------------------------------------------------------------------- counting


def test_count_parameters_of_a_torch_model_counts_tied_weights_once() -> None:
    torch = pytest.importorskip("torch")
    embed = torch.nn.Embedding(100, 8)
    head = torch.nn.Linear(8, 100, bias=False)
    head.weight = embed.weight  # tied
    model = torch.nn.Sequential(embed, torch.nn.Linear(8, 8), head)
    assert count_parameters(model) == 100 * 8 + 8 * 8 + 8
    model[1].bias.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == 100 * 8 + 8 * 8


def test_count_parameters_needs_a_model() -> None:
    with pytest.raises(TypeError, match="pass the number to estimate_memory"):
        count_parameters(12345)


def test_importing_and_estimating_keep_torch_out() -> None:
    code = (
        "import sys\n"
        "from nbaccel.config.schema import Config\n"
        "from nbaccel.hardware.memory_estimate import estimate_for_config, count_parameters\n"
        "estimate_for_config(Config(num_processes=2, strategy='fsdp'), 10**6).describe()\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
        "print('TORCH_MODULES', bad)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "TORCH_MODULES []" in result.stdout


def test_sync_each_batch_keeps_fsdp_gradients_sharded_while_accumulating() -> None:
    accumulating = Config(num_processes=2, strategy="fsdp", gradient_accumulation_steps=4)
    assert estimate_for_config(accumulating, 10**6).gradients == 4 * 10**6  # whole, unreduced
    each = accumulating.replace(sync_each_batch=True)
    assert estimate_for_config(each, 10**6).gradients == 2 * 10**6  # 4 bytes / 2 ranks
