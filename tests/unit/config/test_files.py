"""Config files: discovery, nbaccel YAML round trip, Accelerate's YAML in and its env out."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbaccel.config.accelerate.compat import accelerate_env, from_accelerate_yaml
from nbaccel.config.files import default_file, dump, load_file, save
from nbaccel.config.resolve import resolve
from nbaccel.config.schema import Config, DeepSpeedOptions, FSDPOptions, from_flat
from nbaccel.errors import ConfigError

ACCELERATE_FSDP = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: true
  fsdp_sharding_strategy: SHARD_GRAD_OP
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: BertLayer
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def home(tmp_path: Path) -> dict[str, str]:
    return {"HOME": str(tmp_path)}


def test_nbaccel_yaml_round_trips_exactly(tmp_path: Path) -> None:
    config = Config(
        num_processes=4,
        num_machines=2,
        mixed_precision="bf16",
        max_grad_norm=1.0,
        strategy="fsdp",
        fsdp=FSDPOptions(
            sharding_strategy="HYBRID_SHARD", cpu_offload=True, transformer_layer_cls="Block"
        ),
        deepspeed=DeepSpeedOptions(zero_stage=3),
        log_with=("tensorboard", "csv"),
        dynamo_backend="inductor",
    )
    path = save(config, tmp_path / "run.yaml")
    assert resolve(env={}, config=path).config == config
    assert from_flat(load_file(path)) == config
    text = dump(config)
    assert "fsdp:\n" in text and "  sharding_strategy: HYBRID_SHARD" in text
    assert "# What is sharded" in text  # help text travels as comments


def test_default_file_is_nbaccel_then_accelerate(tmp_path: Path) -> None:
    env = home(tmp_path)
    assert default_file(env) is None
    accel = tmp_path / ".cache/huggingface/accelerate/default_config.yaml"
    accel.parent.mkdir(parents=True)
    accel.write_text(ACCELERATE_FSDP)
    assert default_file(env) == accel
    resolved = resolve(env=env)
    assert resolved.config.strategy == "fsdp"
    assert resolved.sources["strategy"] == f"file:{accel}"
    own = tmp_path / ".config/nbaccel/default_config.yaml"
    save(Config(mixed_precision="fp16"), own)
    assert default_file(env) == own
    assert resolve(env=env).config.mixed_precision == "fp16"
    assert default_file({}) is None  # no HOME given: the real home is never read


def test_named_file_beats_default_and_env_beats_both(tmp_path: Path) -> None:
    env = home(tmp_path)
    save(
        Config(num_processes=3, mixed_precision="fp16"),
        tmp_path / ".config/nbaccel/default_config.yaml",
    )
    named = save(Config(num_processes=5), tmp_path / "named.yaml")
    resolved = resolve(env={**env, "NBACCEL_CONFIG": str(named), "NBACCEL_MIXED_PRECISION": "bf16"})
    assert resolved.config.num_processes == 5
    assert resolved.sources["num_processes"] == f"file:{named}"
    assert resolved.config.mixed_precision == "bf16"


def test_accelerate_fsdp_file_maps_onto_the_schema(tmp_path: Path) -> None:
    path = tmp_path / "default_config.yaml"
    path.write_text(ACCELERATE_FSDP)
    config = resolve(env={}, config=path).config
    assert (config.strategy, config.num_processes, config.mixed_precision) == ("fsdp", 2, "bf16")
    assert config.fsdp == FSDPOptions(
        sharding_strategy="SHARD_GRAD_OP",
        cpu_offload=True,
        transformer_layer_cls="BertLayer",
        state_dict_type="FULL_STATE_DICT",
    )


def test_accelerate_deepspeed_dynamo_and_machines() -> None:
    values = from_accelerate_yaml(
        {
            "distributed_type": "DEEPSPEED",
            "num_machines": 2,
            "num_processes": 8,
            "main_process_ip": "10.0.0.1",
            "main_process_port": 29555,
            "deepspeed_config": {
                "zero_stage": 3,
                "offload_optimizer_device": "cpu",
                "offload_param_device": None,
                "gradient_accumulation_steps": 4,
                "gradient_clipping": 1.0,
                "zero3_init_flag": True,
            },
            "dynamo_config": {"dynamo_backend": "INDUCTOR"},
        },
        "ds.yaml",
    )
    config = from_flat(values)
    assert values["num_processes"] == 8  # Accelerate's total passes through: nbaccel's too
    assert config.num_processes == 8 and config.processes_per_machine(gpus=8) == 4
    assert config.deepspeed == DeepSpeedOptions(zero_stage=3, offload_optimizer_device="cpu")
    assert (config.gradient_accumulation_steps, config.max_grad_norm) == (4, 1.0)
    assert config.dynamo_backend == "inductor" and config.main_process_port == 29555


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"distributed_type": "MEGATRON_LM"}, "supports distributed_type NO, MULTI_CPU"),
        (
            {"distributed_type": "NO", "downcast_bf16": "yes"},
            "downcast_bf16='yes' is not supported",
        ),
        ({"distributed_type": "NO", "num_procs": 2}, "Unknown Accelerate config key 'num_procs'"),
        ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_magic": 1}}, "fsdp_config.fsdp_magic"),
    ],
)
def test_accelerate_values_nbaccel_cannot_honour_are_errors(data: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        from_accelerate_yaml(data, "acc.yaml")


def test_multi_cpu_means_use_cpu() -> None:
    assert from_accelerate_yaml({"distributed_type": "MULTI_CPU"}, "x")["use_cpu"] is True


def test_bad_nested_key_in_nbaccel_file_names_file_and_suggests(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("fsdp:\n  cpu_offlaod: true\n")
    with pytest.raises(
        ConfigError,
        match=r"'fsdp.cpu_offlaod' \(file .*c\.yaml\)\. Did you mean 'fsdp.cpu_offload'",
    ):
        resolve(env={}, config=path)
    path.write_text("fsdp: true\n")
    with pytest.raises(ConfigError, match="fsdp must be a mapping"):
        resolve(env={}, config=path)


def test_unknown_nbaccel_env_var_suggests_the_real_one() -> None:
    with pytest.raises(ConfigError, match="Did you mean NBACCEL_MIXED_PRECISION"):
        resolve(env={"NBACCEL_MIXED_PRECISON": "bf16"})
    assert resolve(env={"NBACCEL_FSDP_CPU_OFFLOAD": "true"}).config.fsdp.cpu_offload is True


def test_sections_can_be_given_as_mappings_or_objects() -> None:
    assert resolve({"fsdp": {"cpu_offload": True}}, env={}).config.fsdp.cpu_offload
    assert resolve({"fsdp": FSDPOptions(min_num_params=5)}, env={}).config.fsdp.min_num_params == 5


def test_accelerate_env_for_workers() -> None:
    fsdp = accelerate_env(
        Config(
            strategy="fsdp",
            mixed_precision="bf16",
            fsdp=FSDPOptions(sharding_strategy="SHARD_GRAD_OP", transformer_layer_cls="Block"),
        ),
        on_cpu=True,
    )
    assert fsdp["ACCELERATE_USE_FSDP"] == "true" and fsdp["FSDP_VERSION"] == "2"
    assert fsdp["FSDP_RESHARD_AFTER_FORWARD"] == "false"  # ZeRO-2 in FSDP2's terms
    assert fsdp["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "Block"
    assert fsdp["ACCELERATE_USE_CPU"] == "true" and fsdp["ACCELERATE_MIXED_PRECISION"] == "bf16"
    ds = accelerate_env(
        Config(strategy="deepspeed", deepspeed=DeepSpeedOptions(zero_stage=1)), on_cpu=False
    )
    assert ds["ACCELERATE_USE_DEEPSPEED"] == "true" and ds["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "1"
    assert "ACCELERATE_USE_CPU" not in ds and "ACCELERATE_USE_FSDP" not in ds
    assert (
        accelerate_env(Config(dynamo_backend="inductor"), on_cpu=True)["ACCELERATE_DYNAMO_BACKEND"]
        == "INDUCTOR"
    )
