"""Accelerate's plugins and kwargs handlers on nbaccel's schema, checked against Accelerate itself.

Accelerate (installed in the venv) is the reference: field names, order and defaults, the
``to_kwargs()`` of each handler, and how its plugins resolve a field that is set, or unset
with and without the variables a launcher exports (nbaccel's ``accelerate_env`` writes them
here, as its launcher does for workers).
"""

from __future__ import annotations

import dataclasses
import functools
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from nbaccel.cli.config import format_sources
from nbaccel.config.accelerate.compat import accelerate_env, from_accelerate_yaml
from nbaccel.config.accelerate.configs import DataLoaderConfiguration, ProjectConfiguration
from nbaccel.config.accelerate.kwargs_handlers import (
    AutocastKwargs,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    TorchDynamoPlugin,
)
from nbaccel.config.accelerate.plugins import (
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    plugin_settings,
)
from nbaccel.config.accelerator_options import apply_accelerator_arguments
from nbaccel.config.resolve import resolve
from nbaccel.config.schema import Config
from nbaccel.errors import ConfigError

OURS = {
    "DeepSpeedPlugin": DeepSpeedPlugin,
    "FullyShardedDataParallelPlugin": FullyShardedDataParallelPlugin,
    "DistributedDataParallelKwargs": DistributedDataParallelKwargs,
    "GradScalerKwargs": GradScalerKwargs,
    "InitProcessGroupKwargs": InitProcessGroupKwargs,
    "AutocastKwargs": AutocastKwargs,
    "ProfileKwargs": ProfileKwargs,
    "ProjectConfiguration": ProjectConfiguration,
    "DataLoaderConfiguration": DataLoaderConfiguration,
    "GradientAccumulationPlugin": GradientAccumulationPlugin,
    "TorchDynamoPlugin": TorchDynamoPlugin,
}
FSDP_KEYS = (
    "fsdp_sharding_strategy",
    "fsdp_cpu_offload",
    "fsdp_auto_wrap_policy",
    "fsdp_activation_checkpointing",
    "fsdp_state_dict_type",
)


@pytest.fixture
def accelerate_utils(monkeypatch: pytest.MonkeyPatch) -> Any:
    """accelerate.utils, with no launcher variables left over (its plugins read them)."""
    utils = pytest.importorskip("accelerate.utils")
    import os

    for name in list(os.environ):
        if name.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.delenv(name)
    return utils


def launched(monkeypatch: pytest.MonkeyPatch, launch: Config) -> None:
    """The variables nbaccel's launcher gives a worker of ``launch``, as Accelerate reads them."""
    for name, value in accelerate_env(launch, on_cpu=launch.use_cpu).items():
        monkeypatch.setenv(name, value)


def default_of(spec: dataclasses.Field[Any]) -> Any:
    missing = spec.default is dataclasses.MISSING
    value = spec.default_factory() if missing else spec.default  # type: ignore[misc]
    return getattr(value, "value", value)  # Accelerate's enums and ours, by value


# -- same classes as Accelerate's --------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(OURS))
def test_fields_order_and_defaults_are_accelerates(accelerate_utils: Any, name: str) -> None:
    theirs = [(f.name, default_of(f)) for f in dataclasses.fields(getattr(accelerate_utils, name))]
    ours = [(f.name, default_of(f)) for f in dataclasses.fields(OURS[name])]
    assert ours == theirs


def test_positional_construction_matches_accelerates_order() -> None:
    plugin = DeepSpeedPlugin("ds.json", 4, 1.0, 3)
    assert (plugin.hf_ds_config, plugin.gradient_accumulation_steps, plugin.zero_stage) == (
        "ds.json",
        4,
        3,
    )
    assert FullyShardedDataParallelPlugin(2).fsdp_version == 2


@pytest.mark.parametrize(
    "handler",
    [
        DistributedDataParallelKwargs(find_unused_parameters=True, bucket_cap_mb=50),
        DistributedDataParallelKwargs(comm_hook="fp16", static_graph=True),
        GradScalerKwargs(init_scale=1024.0, growth_interval=10),
        InitProcessGroupKwargs(timeout=timedelta(seconds=800)),
        InitProcessGroupKwargs(backend="gloo"),
        InitProcessGroupKwargs(),
        AutocastKwargs(cache_enabled=True),
        AutocastKwargs(enabled=False),
        ProfileKwargs(activities=["cpu"], record_shapes=True, schedule_option={"wait": 1}),
    ],
    ids=repr,
)
def test_to_kwargs_equals_accelerates(accelerate_utils: Any, handler: Any) -> None:
    fields = {f.name: getattr(handler, f.name) for f in dataclasses.fields(handler)}
    if "comm_hook" in fields:  # Accelerate's own enum for its own class
        fields["comm_hook"] = accelerate_utils.DDPCommunicationHookType(fields["comm_hook"].value)
        fields["comm_wrapper"] = accelerate_utils.DDPCommunicationHookType("no")
    if isinstance(handler, InitProcessGroupKwargs) and handler.to_kwargs() == {}:
        fields["timeout"] = None  # the default instance: both compute the backend's timeout
    theirs = getattr(accelerate_utils, type(handler).__name__)(**fields)
    assert handler.to_kwargs() == theirs.to_kwargs()


def test_ddp_comm_hook_takes_accelerates_enum_its_string_or_ours(accelerate_utils: Any) -> None:
    theirs = accelerate_utils.DDPCommunicationHookType.BF16
    for given in (theirs, "bf16", DDPCommunicationHookType.BF16):
        assert (
            DistributedDataParallelKwargs(comm_hook=given).comm_hook
            is DDPCommunicationHookType.BF16
        )
    with pytest.raises(ValueError, match="comm_wrapper='power_sgd' is not one of 'no', 'fp16'"):
        DistributedDataParallelKwargs(comm_wrapper="power_sgd")


DYNAMO_LAUNCH = Config(dynamo_backend="aot_eager").replace(
    dynamo_mode="max-autotune", dynamo_use_fullgraph=True, dynamo_use_dynamic=False
)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"backend": "inductor", "mode": "reduce-overhead"},
        {"fullgraph": False, "dynamic": True},
        {"backend": "EAGER", "use_regional_compilation": True, "disable": True},
    ],
    ids=repr,
)
@pytest.mark.parametrize("launch", [Config(), DYNAMO_LAUNCH], ids=["plain launch", "dynamo launch"])
def test_dynamo_plugin_resolves_as_accelerates(
    accelerate_utils: Any, monkeypatch: pytest.MonkeyPatch, kwargs: dict, launch: Config
) -> None:
    launched(monkeypatch, launch)
    theirs = accelerate_utils.TorchDynamoPlugin(**kwargs)
    options = apply_accelerator_arguments(launch, dynamo_plugin=TorchDynamoPlugin(**kwargs))
    expected = theirs.to_kwargs()
    expected.pop("backend", None)
    assert options.config.dynamo_backend == theirs.backend.value.lower()
    assert options.compile_kwargs == expected
    assert options.config.dynamo.use_regional_compilation == theirs.use_regional_compilation
    accepts = TorchDynamoPlugin(backend=accelerate_utils.DynamoBackend.AOT_EAGER).backend
    assert accepts == "aot_eager"


# -- FSDP: the same resolution as Accelerate's plugin ------------------------------------------
def accelerate_fsdp_view(plugin: Any) -> dict[str, Any]:
    """Accelerate's resolved FullyShardedDataParallelPlugin, in nbaccel's config fields."""
    from torch.distributed.fsdp.wrap import (
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    if plugin.fsdp_version == 2:
        sharding = "FULL_SHARD" if plugin.reshard_after_forward else "SHARD_GRAD_OP"
        offload = type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"
    else:
        sharding = plugin.sharding_strategy.name
        offload = plugin.cpu_offload.offload_params
    policies = {
        transformer_auto_wrap_policy: "TRANSFORMER_BASED_WRAP",
        size_based_auto_wrap_policy: "SIZE_BASED_WRAP",
        None: "NO_WRAP",
    }
    view = {
        "fsdp_sharding_strategy": sharding,
        "fsdp_cpu_offload": offload,
        "fsdp_auto_wrap_policy": policies[plugin.auto_wrap_policy],
        "fsdp_activation_checkpointing": plugin.activation_checkpointing,
        "fsdp_state_dict_type": plugin.state_dict_type.name,
    }
    if view["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP":
        view["fsdp_transformer_layer_cls"] = ",".join(plugin.transformer_cls_names_to_wrap or [])
    if view["fsdp_auto_wrap_policy"] == "SIZE_BASED_WRAP":
        view["fsdp_min_num_params"] = plugin.min_num_params
    return view


def nbaccel_fsdp_view(plugin: FullyShardedDataParallelPlugin, launch: Config) -> dict[str, Any]:
    config = apply_accelerator_arguments(launch, fsdp_plugin=plugin).config
    flat = {
        "fsdp_sharding_strategy": config.fsdp.sharding_strategy,
        "fsdp_cpu_offload": config.fsdp.cpu_offload,
        "fsdp_auto_wrap_policy": config.fsdp.auto_wrap_policy,
        "fsdp_activation_checkpointing": config.fsdp.activation_checkpointing,
        "fsdp_state_dict_type": config.fsdp.state_dict_type,
    }
    if config.fsdp.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
        flat["fsdp_transformer_layer_cls"] = config.fsdp.transformer_layer_cls
    if config.fsdp.auto_wrap_policy == "SIZE_BASED_WRAP":
        flat["fsdp_min_num_params"] = config.fsdp.min_num_params
    return flat


FSDP_CASES = [
    {},
    {"fsdp_version": 2},
    {"fsdp_version": 2, "reshard_after_forward": False, "cpu_offload": True},
    {"fsdp_version": 2, "auto_wrap_policy": "size_based_wrap", "min_num_params": 1000},
    {"fsdp_version": 2, "auto_wrap_policy": "size_based_wrap"},
    {
        "fsdp_version": 2,
        "auto_wrap_policy": "transformer_based_wrap",
        "transformer_cls_names_to_wrap": ["Block"],
        "activation_checkpointing": True,
        "state_dict_type": "full_state_dict",
    },
    {"fsdp_version": 1, "sharding_strategy": "SHARD_GRAD_OP", "cpu_offload": False},
    {"fsdp_version": 1, "auto_wrap_policy": "transformer_based_wrap", "state_dict_type": "3"},
]
FSDP_LAUNCH = Config(strategy="fsdp", use_cpu=True).replace(
    fsdp_sharding_strategy="SHARD_GRAD_OP",
    fsdp_cpu_offload=True,
    fsdp_auto_wrap_policy="SIZE_BASED_WRAP",
    fsdp_min_num_params=500,
    fsdp_state_dict_type="FULL_STATE_DICT",
)


@pytest.mark.parametrize("kwargs", FSDP_CASES, ids=repr)
@pytest.mark.parametrize("launch", [Config(), FSDP_LAUNCH], ids=["no fsdp launch", "fsdp launch"])
def test_fsdp_plugin_resolves_as_accelerates(
    accelerate_utils: Any, monkeypatch: pytest.MonkeyPatch, kwargs: dict, launch: Config
) -> None:
    # Set fields win; unset ones take the launch's FSDP_* variables, else Accelerate's defaults.
    launched(monkeypatch, launch)
    theirs = accelerate_utils.FullyShardedDataParallelPlugin(**kwargs)
    assert nbaccel_fsdp_view(FullyShardedDataParallelPlugin(**kwargs), launch) == (
        accelerate_fsdp_view(theirs)
    )


def test_fsdp_plugin_takes_torchs_own_objects() -> None:
    torch = pytest.importorskip("torch")
    from torch.distributed.fsdp import (
        CPUOffload,
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        ShardingStrategy,
        StateDictType,
    )
    from torch.distributed.fsdp.wrap import (
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    layer = torch.nn.TransformerEncoderLayer
    plugin = FullyShardedDataParallelPlugin(
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        cpu_offload=CPUOffload(offload_params=True),
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={layer}
        ),
        state_dict_type=StateDictType.FULL_STATE_DICT,
        mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    )
    assert plugin_settings(plugin, Config()).values | {"strategy": "fsdp"} == {
        "strategy": "fsdp",
        "fsdp_sharding_strategy": "HYBRID_SHARD",
        "fsdp_cpu_offload": True,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls": "TransformerEncoderLayer",
        "fsdp_state_dict_type": "FULL_STATE_DICT",
        "fsdp_param_dtype": "bf16",
        "fsdp_reduce_dtype": "bf16",  # FSDP2: an unset reduce dtype follows the parameters'
        "fsdp_min_num_params": 0,
        "fsdp_activation_checkpointing": False,
    }
    size = functools.partial(size_based_auto_wrap_policy, min_num_params=123)
    values = plugin_settings(
        FullyShardedDataParallelPlugin(auto_wrap_policy=size, cpu_offload=CPUOffloadPolicy()),
        Config(),
    ).values
    assert (values["fsdp_auto_wrap_policy"], values["fsdp_min_num_params"]) == (
        "SIZE_BASED_WRAP",
        123,
    )
    assert values["fsdp_cpu_offload"] is True
    off = FullyShardedDataParallelPlugin(cpu_offload=OffloadPolicy())
    assert plugin_settings(off, Config()).values["fsdp_cpu_offload"] is False
    policy = {"param_dtype": torch.float16, "reduce_dtype": torch.float32, "buffer_dtype": None}
    values = plugin_settings(
        FullyShardedDataParallelPlugin(mixed_precision_policy=policy), Config()
    ).values
    assert (values["fsdp_param_dtype"], values["fsdp_reduce_dtype"]) == ("fp16", "fp32")


def test_fsdp2_reshard_keeps_a_hybrid_launch_and_refuses_a_zero2_hybrid() -> None:
    hybrid = Config(strategy="fsdp", num_machines=2).replace(fsdp_sharding_strategy="HYBRID_SHARD")
    keep = FullyShardedDataParallelPlugin(reshard_after_forward=True)
    assert apply_accelerator_arguments(hybrid, fsdp_plugin=keep).config.fsdp.sharding_strategy == (
        "HYBRID_SHARD"
    )
    with pytest.raises(NotImplementedError, match="reshard_after_forward=False with HYBRID_SHARD"):
        apply_accelerator_arguments(
            hybrid, fsdp_plugin=FullyShardedDataParallelPlugin(reshard_after_forward=False)
        )


# -- DeepSpeed: the same resolution as Accelerate's plugin ---------------------------------------
DS_LAUNCH = Config(strategy="deepspeed", gradient_accumulation_steps=4, max_grad_norm=0.5).replace(
    deepspeed_zero_stage=3, deepspeed_offload_param_device="cpu"
)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"zero_stage": 3, "offload_optimizer_device": "cpu"},
        {"zero_stage": 3, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0},
        {"zero_stage": 3, "zero3_save_16bit_model": True, "offload_param_device": "none"},
    ],
    ids=repr,
)
@pytest.mark.parametrize("launch", [Config(), DS_LAUNCH], ids=["no deepspeed launch", "launch"])
def test_deepspeed_plugin_resolves_as_accelerates(
    accelerate_utils: Any, monkeypatch: pytest.MonkeyPatch, kwargs: dict, launch: Config
) -> None:
    launched(monkeypatch, launch)
    theirs = accelerate_utils.DeepSpeedPlugin(**kwargs)
    config = apply_accelerator_arguments(launch, deepspeed_plugin=DeepSpeedPlugin(**kwargs)).config
    ds = config.deepspeed
    assert (ds.zero_stage, ds.offload_optimizer_device, ds.offload_param_device) == (
        theirs.zero_stage,
        theirs.offload_optimizer_device,
        theirs.offload_param_device,
    )
    assert ds.zero3_save_16bit_model == theirs.zero3_save_16bit_model
    # "auto" accumulation in Accelerate: filled from the Accelerator's own value, which is the
    # launch's here; "auto" clipping: filled with 1.0 by its _prepare_deepspeed.
    steps = theirs.gradient_accumulation_steps
    clip = theirs.gradient_clipping
    assert config.gradient_accumulation_steps == (
        launch.gradient_accumulation_steps if steps == "auto" else steps
    )
    assert config.max_grad_norm == (1.0 if clip == "auto" else clip)


def test_deepspeed_plugin_with_a_config_dict_or_file(tmp_path: Path) -> None:
    given = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}
    options = apply_accelerator_arguments(
        Config(), deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=given)
    )
    assert options.deepspeed_config == given and options.config.deepspeed.config_file == ""
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2}}')
    config = apply_accelerator_arguments(
        Config(), deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=str(path))
    ).config
    assert config.deepspeed.config_file == str(path)
    # A plugin value the file contradicts is refused, naming both (nbaccel never picks one).
    with pytest.raises(ConfigError, match=r"deepspeed_zero_stage=3 contradicts .*ds\.json"):
        apply_accelerator_arguments(
            Config(), deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=str(path), zero_stage=3)
        )


def test_deepspeed_plugin_wins_over_the_accumulation_argument() -> None:
    # Accelerate: "Gradient accumulation steps mismatch ... Using DeepSpeed's value."
    options = apply_accelerator_arguments(
        Config(),
        deepspeed_plugin=DeepSpeedPlugin(gradient_accumulation_steps=8),
        gradient_accumulation_steps=2,
    )
    assert options.config.gradient_accumulation_steps == 8
    assert options.sources["gradient_accumulation_steps"] == "plugin: DeepSpeedPlugin"


# -- precedence of the other arguments -----------------------------------------------------------
def test_set_plugin_field_beats_the_launch_and_unset_field_keeps_it() -> None:
    launch = Config(strategy="fsdp").replace(
        fsdp_cpu_offload=True, fsdp_activation_checkpointing=True
    )
    plugin = FullyShardedDataParallelPlugin(cpu_offload=False)
    options = apply_accelerator_arguments(launch, fsdp_plugin=plugin)
    assert options.config.fsdp.cpu_offload is False
    assert options.config.fsdp.activation_checkpointing is True
    assert options.config.fsdp.auto_wrap_policy == "TRANSFORMER_BASED_WRAP"  # nbaccel's default
    assert options.sources["fsdp_cpu_offload"] == "plugin: FullyShardedDataParallelPlugin"
    assert options.sources["fsdp_activation_checkpointing"] == "launch config"


def test_a_field_the_launch_chose_explicitly_counts_without_its_strategy() -> None:
    launch = resolve({"fsdp_min_num_params": 777}, env={}, use_default_file=False)
    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="size_based_wrap")
    options = apply_accelerator_arguments(launch, fsdp_plugin=plugin)
    assert options.config.fsdp.min_num_params == 777
    assert options.sources["fsdp_min_num_params"] == "argument"
    assert options.config.fsdp.state_dict_type == "FULL_STATE_DICT"  # FSDP1's default
    assert options.sources["fsdp_state_dict_type"] == (
        "plugin: FullyShardedDataParallelPlugin (Accelerate's default)"
    )


def test_accumulation_plugin_rules() -> None:
    launch = Config(gradient_accumulation_steps=4)
    options = apply_accelerator_arguments(
        launch, gradient_accumulation_plugin=GradientAccumulationPlugin(sync_each_batch=True)
    )
    assert options.config.gradient_accumulation_steps == 1  # None is 1, as in Accelerate
    assert options.config.sync_each_batch is True
    options = apply_accelerator_arguments(
        launch,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=3, adjust_scheduler=False
        ),
        gradient_accumulation_steps=1,  # Accelerate's default: allowed beside the plugin
    )
    assert (options.config.gradient_accumulation_steps, options.adjust_scheduler) == (3, False)
    with pytest.raises(ValueError, match="only pass one of gradient_accumulation_steps"):
        apply_accelerator_arguments(
            launch,
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2),
            gradient_accumulation_steps=2,
        )


def test_arguments_beat_the_launch_and_are_labelled() -> None:
    options = apply_accelerator_arguments(
        Config(mixed_precision="fp16"), mixed_precision="bf16", cpu=True, log_with="csv"
    )
    assert (options.config.mixed_precision, options.config.use_cpu) == ("bf16", True)
    assert options.config.log_with == ("csv",)
    assert options.sources["use_cpu"] == "Accelerator argument"
    assert (
        apply_accelerator_arguments(Config(mixed_precision="fp16")).config.mixed_precision == "fp16"
    )


def test_dynamo_plugin_rules() -> None:
    launch = Config(dynamo_backend="aot_eager")
    assert apply_accelerator_arguments(
        launch, dynamo_plugin=TorchDynamoPlugin()
    ).config.dynamo_backend == ("aot_eager")
    options = apply_accelerator_arguments(
        launch, dynamo_plugin=TorchDynamoPlugin(backend="EAGER", fullgraph=True)
    )
    assert (options.config.dynamo_backend, options.compile_kwargs) == ("eager", {"fullgraph": True})
    with pytest.raises(ValueError, match="both dynamo_plugin and dynamo_backend"):
        apply_accelerator_arguments(
            launch, dynamo_plugin=TorchDynamoPlugin(), dynamo_backend="eager"
        )


def test_project_configuration_rules() -> None:
    launch = Config(project_dir="from_launch")
    given = ProjectConfiguration(
        project_dir="mine", automatic_checkpoint_naming=True, total_limit=2
    )
    options = apply_accelerator_arguments(launch, project_config=given, project_dir="argument")
    assert options.config.project_dir == "mine"  # the configuration's own directory wins
    assert (options.project.logging_dir, options.project.total_limit) == ("mine", 2)
    assert given.project_dir == "mine" and options.project is not given  # not mutated
    options = apply_accelerator_arguments(
        launch, project_config=ProjectConfiguration(logging_dir="logs")
    )
    assert (options.config.project_dir, options.project.project_dir) == ("from_launch",) * 2
    assert options.project.logging_dir == "logs"


def test_handlers_reach_the_worker_as_keywords() -> None:
    options = apply_accelerator_arguments(
        Config(),
        kwargs_handlers=[
            InitProcessGroupKwargs(timeout=timedelta(seconds=90)),
            GradScalerKwargs(growth_interval=5),
            AutocastKwargs(cache_enabled=False),
            DistributedDataParallelKwargs(comm_hook="power_sgd", comm_state_option={"a": 1}),
            ProfileKwargs(with_flops=True),
        ],
        rng_types=["torch", "generator"],
        split_batches=True,
    )
    assert options.config.collective_timeout == 90.0
    assert options.sources["collective_timeout"] == "kwargs handler: InitProcessGroupKwargs"
    assert options.init_process_group_kwargs == {"timeout": timedelta(seconds=90)}
    assert options.grad_scaler_kwargs == {"growth_interval": 5}
    assert options.autocast_kwargs == {"cache_enabled": False}
    assert (options.ddp_kwargs, options.ddp_comm_hook) == ({}, "power_sgd")
    assert options.ddp_comm_state_option == {"a": 1}
    assert options.profile_kwargs is not None and options.profile_kwargs.with_flops
    assert options.rng_types == ("torch", "generator") and options.dataloader.split_batches


def test_a_full_state_dict_config_decides_where_get_state_dict_puts_the_weights() -> None:
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedStateDictConfig,
    )

    def placement(**kwargs: Any) -> tuple[bool, bool]:
        plugin = FullyShardedDataParallelPlugin(**kwargs)
        found = apply_accelerator_arguments(Config(), fsdp_plugin=plugin).full_state_dict
        return found.offload_to_cpu, found.rank0_only

    assert placement() == (True, True)  # Accelerate's default: CPU, rank 0 only
    every_rank = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
    assert placement(state_dict_config=every_rank) == (True, False)
    assert placement(state_dict_config=FullStateDictConfig()) == (False, False)  # torch's default
    # The optimizer's rank0_only changes nothing nbaccel does (one file from rank 0 either way).
    optim = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)
    assert placement(optim_state_dict_config=optim) == (True, True)
    with pytest.raises(NotImplementedError, match="offload_to_cpu=True"):
        FullyShardedDataParallelPlugin(state_dict_config=ShardedStateDictConfig())


# -- refusals name the value ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"forward_prefetch": True}, "forward_prefetch=True"),
        ({"backward_prefetch": "BACKWARD_POST"}, "backward_prefetch='BACKWARD_POST'"),
        ({"backward_prefetch": "NO_PREFETCH"}, "backward_prefetch='NO_PREFETCH'"),
        ({"limit_all_gathers": False}, "limit_all_gathers=False"),
        ({"ignored_modules": ["head"]}, "ignored_modules=\\['head'\\]"),
        ({"param_init_fn": print}, "param_init_fn="),
        ({"state_dict_type": "LOCAL_STATE_DICT"}, "state_dict_type='LOCAL_STATE_DICT'"),
        ({"fsdp_version": 1, "sync_module_states": True}, "sync_module_states=True"),
        ({"activation_checkpointing_offload": True}, "activation_checkpointing_offload=True"),
        ({"sharding_strategy": "HYBRID_SHARD_ZERO2"}, "'HYBRID_SHARD_ZERO2'"),
        ({"mixed_precision_policy": "fp8"}, "mixed_precision_policy='fp8'"),
        ({"mixed_precision_policy": {"buffer_dtype": "bf16"}}, "buffer_dtype='bf16'"),
        ({"auto_wrap_policy": lambda module: True}, "auto_wrap_policy=<function"),
        ({"sharding_strategy": "NONSENSE"}, "sharding_strategy='NONSENSE' is not one of"),
        ({"fsdp_version": 3}, "fsdp_version=3"),
        (
            {"sharding_strategy": "FULL_SHARD", "reshard_after_forward": False},
            "contradict each other",
        ),
    ],
)
def test_fsdp_values_fsdp2_cannot_honour_are_refused(kwargs: dict, fragment: str) -> None:
    with pytest.raises((NotImplementedError, ValueError), match=fragment):
        FullyShardedDataParallelPlugin(**kwargs)


def test_sync_module_states_follows_the_fsdp_version_accelerate_would_use() -> None:
    # Outside an FSDP launch Accelerate defaults to FSDP1, which broadcasts: refused here.
    plugin = FullyShardedDataParallelPlugin(sync_module_states=True)
    with pytest.raises(NotImplementedError, match=r"sync_module_states=True\): under FSDP1"):
        apply_accelerator_arguments(Config(), fsdp_plugin=plugin)
    # An FSDP launch exports FSDP_VERSION=2, where Accelerate ignores it (FSDP2 never syncs).
    fsdp = apply_accelerator_arguments(Config(strategy="fsdp"), fsdp_plugin=plugin).config
    assert fsdp.strategy == "fsdp"


def test_fsdp2_no_ops_are_accepted_as_in_accelerates_fsdp2() -> None:
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        use_orig_params=False,
        sync_module_states=True,
        cpu_ram_efficient_loading=True,
    )
    assert apply_accelerator_arguments(Config(), fsdp_plugin=plugin).config.strategy == "fsdp"


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"is_train_batch_min": False}, "is_train_batch_min=False"),
        ({"enable_msamp": True}, "enable_msamp=True"),
        ({"transformer_moe_cls_names": "MoE"}, "transformer_moe_cls_names='MoE'"),
        ({"offload_param_nvme_path": "/nvme"}, "offload_param_nvme_path='/nvme'"),
    ],
)
def test_deepspeed_values_nbaccel_cannot_honour_are_refused(kwargs: dict, fragment: str) -> None:
    with pytest.raises(NotImplementedError, match=fragment):
        DeepSpeedPlugin(**kwargs)


def test_handler_refusals(accelerate_utils: Any) -> None:
    with pytest.raises(ValueError, match="only pass one GradScalerKwargs"):
        apply_accelerator_arguments(
            Config(), kwargs_handlers=[GradScalerKwargs(), GradScalerKwargs(init_scale=2.0)]
        )
    with pytest.raises(TypeError, match="Unsupported kwargs handler 'fast'"):
        apply_accelerator_arguments(Config(), kwargs_handlers=["fast"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"Accelerate's own GradScalerKwargs.*nbaccel\.utils"):
        apply_accelerator_arguments(Config(), kwargs_handlers=[accelerate_utils.GradScalerKwargs()])
    with pytest.raises(TypeError, match=r"Accelerate's own TorchDynamoPlugin.*nbaccel\.utils"):
        apply_accelerator_arguments(Config(), dynamo_plugin=accelerate_utils.TorchDynamoPlugin())
    with pytest.raises(TypeError, match="project_config must be a ProjectConfiguration, got str"):
        apply_accelerator_arguments(Config(), project_config="runs")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pass it as Accelerator\\(gradient_accumulation_plugin="):
        apply_accelerator_arguments(Config(), kwargs_handlers=[GradientAccumulationPlugin()])


def test_plugin_combination_refusals() -> None:
    two = {"a": DeepSpeedPlugin(), "b": DeepSpeedPlugin(zero_stage=3)}
    with pytest.raises(NotImplementedError, match="deepspeed_plugins with 2 entries \\(a, b\\)"):
        apply_accelerator_arguments(Config(), deepspeed_plugins=two)
    one = apply_accelerator_arguments(
        Config(), deepspeed_plugins={"only": DeepSpeedPlugin(zero_stage=1)}
    )
    assert one.config.deepspeed.zero_stage == 1
    with pytest.raises(ValueError, match="Both a DeepSpeed and an FSDP plugin"):
        apply_accelerator_arguments(
            Config(),
            deepspeed_plugin=DeepSpeedPlugin(),
            fsdp_plugin=FullyShardedDataParallelPlugin(),
        )
    with pytest.raises(ConfigError, match="strategy='xla' \\(TPUs"):
        apply_accelerator_arguments(
            Config(strategy="xla"), fsdp_plugin=FullyShardedDataParallelPlugin()
        )
    with pytest.raises(ConfigError, match=r"needs CUDA GPUs.*\(from plugin: DeepSpeedPlugin\)"):
        apply_accelerator_arguments(Config(use_cpu=True), deepspeed_plugin=DeepSpeedPlugin())


# -- the four faces: config show, schema, YAML ------------------------------------------------
def test_config_show_labels_what_plugins_and_handlers_set() -> None:
    launch = resolve({"num_processes": 2}, env={}, use_default_file=False)
    options = apply_accelerator_arguments(
        launch,
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=60))],
    )
    rows = {
        line.split()[0]: line.split(maxsplit=2)[1:]
        for line in format_sources(options.resolved).splitlines()
    }
    assert rows["fsdp.cpu_offload"] == ["true", "plugin: FullyShardedDataParallelPlugin"]
    assert rows["strategy"] == ["fsdp", "plugin: FullyShardedDataParallelPlugin"]
    assert rows["collective_timeout"] == ["60.0", "kwargs handler: InitProcessGroupKwargs"]
    assert rows["fsdp.auto_wrap_policy"] == [
        "NO_WRAP",
        "plugin: FullyShardedDataParallelPlugin (Accelerate's default)",
    ]
    assert rows["num_processes"] == ["2", "argument"]


def test_accelerate_yaml_fsdp2_and_deepspeed_keys_now_mapped() -> None:
    values = from_accelerate_yaml(
        {
            "distributed_type": "FSDP",
            "fsdp_config": {
                "fsdp_version": 2,
                "fsdp_reshard_after_forward": False,
                "fsdp_offload_params": False,
                "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                "fsdp_min_num_params": 1000,
                "fsdp_cpu_ram_efficient_loading": True,
                "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            },
        },
        "acc.yaml",
    )
    config = Config().replace(**values)
    assert config.fsdp.sharding_strategy == "SHARD_GRAD_OP"
    assert (config.fsdp.auto_wrap_policy, config.fsdp.min_num_params) == ("SIZE_BASED_WRAP", 1000)
    values = from_accelerate_yaml(
        {
            "distributed_type": "NO",
            "dynamo_config": {
                "dynamo_backend": "INDUCTOR",
                "dynamo_mode": "max-autotune",
                "dynamo_use_fullgraph": True,
                "dynamo_use_dynamic": False,
                "dynamo_use_regional_compilation": True,
            },
        },
        "acc.yaml",
    )
    dynamo = Config().replace(**values).dynamo
    assert (dynamo.mode, dynamo.use_fullgraph, dynamo.use_dynamic) == ("max-autotune", True, False)
    assert dynamo.use_regional_compilation is True
    with pytest.raises(ConfigError, match=r"dynamo_config\.dynamo_magic is not an option"):
        from_accelerate_yaml({"dynamo_config": {"dynamo_magic": 1}}, "acc.yaml")
    values = from_accelerate_yaml(
        {
            "distributed_type": "DEEPSPEED",
            "deepspeed_config": {"zero_stage": 3, "zero3_save_16bit_model": True},
        },
        "ds.yaml",
    )
    assert Config().replace(**values).deepspeed.zero3_save_16bit_model is True


@pytest.mark.parametrize(
    ("fsdp_config", "fragment"),
    [
        ({"fsdp_forward_prefetch": True}, "forward_prefetch=True"),
        ({"fsdp_backward_prefetch": "BACKWARD_POST"}, "BACKWARD_POST"),
        ({"fsdp_version": 1, "fsdp_sync_module_states": True}, "sync_module_states=True"),
        (
            {"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_reshard_after_forward": False},
            "contradict",
        ),
        ({"fsdp_state_dict_type": "LOCAL_STATE_DICT"}, "LOCAL_STATE_DICT"),
    ],
)
def test_accelerate_yaml_fsdp_values_nbaccel_cannot_honour(
    fsdp_config: dict, fragment: str
) -> None:
    with pytest.raises(ConfigError, match=f"acc.yaml: fsdp_config: .*{fragment}"):
        from_accelerate_yaml({"distributed_type": "FSDP", "fsdp_config": fsdp_config}, "acc.yaml")


def test_new_schema_fields_reach_env_and_deepspeed_config() -> None:
    from nbaccel.config.deepspeed.settings import deepspeed_config

    config = Config(strategy="deepspeed").replace(
        deepspeed_zero_stage=3, deepspeed_zero3_save_16bit_model=True
    )
    assert deepspeed_config(config)["zero_optimization"] == {
        "stage": 3,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    assert (
        accelerate_env(config, on_cpu=False)["ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"]
        == "true"
    )
    with pytest.raises(
        ConfigError, match="zero3_save_16bit_model=True only applies to ZeRO stage 3"
    ):
        deepspeed_config(
            Config(strategy="deepspeed").replace(deepspeed_zero3_save_16bit_model=True)
        )
    file_says_no = {
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}
    }
    with pytest.raises(ConfigError, match="contradicts the DeepSpeedPlugin's hf_ds_config dict"):
        deepspeed_config(config, file_says_no)
    assert (
        Config().replace(fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32").fsdp.param_dtype
        == "bf16"
    )
    with pytest.raises(ConfigError, match="fsdp_reduce_dtype='fp8' is not one of"):
        Config().replace(fsdp_reduce_dtype="fp8")


def test_import_nbaccel_gives_the_top_level_config_objects() -> None:
    import nbaccel

    assert nbaccel.FullyShardedDataParallelPlugin is FullyShardedDataParallelPlugin
    assert nbaccel.DistributedDataParallelKwargs is DistributedDataParallelKwargs
    assert nbaccel.DataLoaderConfiguration is DataLoaderConfiguration


def test_the_wizard_and_panel_ask_the_new_fields_where_they_apply() -> None:
    from nbaccel.config.display import applies

    deepspeed = {"strategy": "deepspeed", "deepspeed_zero_stage": 3}
    assert applies("deepspeed.zero3_save_16bit_model", deepspeed)
    assert not applies("deepspeed.zero3_save_16bit_model", {**deepspeed, "deepspeed_zero_stage": 2})
    assert applies("fsdp.reduce_dtype", {"strategy": "fsdp"})
    assert not applies("fsdp.param_dtype", {"strategy": "ddp"})
