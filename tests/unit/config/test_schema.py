"""Config schema: types, choices, limits, field names — every bad value named with its fix."""

from __future__ import annotations

import pytest

from nbaccel.config.schema import (
    Config,
    DeepSpeedOptions,
    FSDPOptions,
    check_names,
    flatten,
    from_flat,
    option,
    options,
    parse_text,
    shown_ranks,
)
from nbaccel.errors import ConfigError


def spec(name: str):  # type: ignore[no-untyped-def]
    return option(name)


def test_defaults_are_valid_and_documented() -> None:
    config = Config()
    assert config.num_processes is None
    assert config.mixed_precision == "no"
    assert config.fsdp == FSDPOptions() and config.deepspeed == DeepSpeedOptions()
    for opt in options():
        assert len(opt.help) > 15, f"{opt.name} has no real help text"
    names = [opt.name for opt in options()]
    assert len(names) == len(set(names))
    assert "fsdp_sharding_strategy" in names and option("fsdp.cpu_offload").kind is bool


def test_flat_round_trip_and_nested_sections() -> None:
    config = Config(strategy="fsdp", fsdp=FSDPOptions(cpu_offload=True), log_with=("csv",))
    assert from_flat(flatten(config)) == config
    assert (
        from_flat({"fsdp.sharding_strategy": "SHARD_GRAD_OP"}).fsdp.sharding_strategy
        == "SHARD_GRAD_OP"
    )
    assert Config().replace(fsdp_cpu_offload=True).fsdp.cpu_offload is True
    assert from_flat({"log_with": ["csv", "jsonl"]}).log_with == ("csv", "jsonl")


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"num_processes": 0}, "num_processes must be >= 1, got 0"),
        ({"num_processes": -2}, "num_processes must be >= 1"),
        ({"num_processes": 2.5}, "num_processes must be int or None, got 2.5 (float)"),
        ({"num_processes": "2"}, "num_processes must be int or None, got '2' (str)"),
        ({"num_processes": True}, "num_processes must be int or None, got True (bool)"),
        ({"mixed_precision": "fp32"}, "'no', 'fp16', 'bf16'"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be >= 1"),
        ({"collective_timeout": 0}, "collective_timeout must be >= 0.001"),
        ({"use_cpu": "yes"}, "use_cpu must be bool"),
        ({"log_ranks": "zero"}, "log_ranks='zero' is not 'all' or a comma list"),
        ({"log_ranks": "-1"}, "at least one rank >= 0"),
        ({"strategy": "zero"}, "'auto', 'ddp', 'fsdp', 'deepspeed', 'xla'"),
        ({"log_with": ("csv", "neptune")}, "log_with entry 'neptune' is not one of"),
        ({"log_with": "csv"}, "log_with must be comma list"),
        ({"max_grad_norm": -1.0}, "max_grad_norm must be >= 0"),
        ({"machine_rank": 1}, "machine_rank=1 but num_machines=1"),
        ({"fsdp_sharding_strategy": "ZERO3"}, "'FULL_SHARD', 'SHARD_GRAD_OP'"),
        ({"deepspeed_zero_stage": 4}, "deepspeed_zero_stage=4 is not one of 0, 1, 2, 3"),
    ],
)
def test_bad_values_raise_config_error_naming_the_field(changes: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_flat(changes)
    assert fragment in str(caught.value)
    assert caught.value.field == next(iter(changes))


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"strategy": "deepspeed", "use_cpu": True}, "needs CUDA GPUs"),
        ({"strategy": "xla", "use_cpu": True}, "runs on TPUs"),
        ({"fsdp_sharding_strategy": "HYBRID_SHARD"}, "Use FULL_SHARD on one machine"),
    ],
)
def test_contradictions(changes: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        from_flat(changes)


def test_ints_are_accepted_for_float_fields() -> None:
    assert Config(collective_timeout=5).collective_timeout == 5


def test_unknown_field_suggests_the_close_match() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'mixed_precision'"):
        check_names(["mixed_precison"], "argument")
    with pytest.raises(ConfigError, match="Valid fields: num_processes"):
        Config().replace(bogus=1)


def test_replace_validates() -> None:
    assert Config().replace(mixed_precision="bf16").mixed_precision == "bf16"
    with pytest.raises(ConfigError):
        Config().replace(mixed_precision="int8")


def test_shown_ranks() -> None:
    assert shown_ranks("all") is None
    assert shown_ranks(" 0, 3 ") == frozenset({0, 3})


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("num_processes", "4", 4),
        ("num_processes", "auto", None),
        ("use_cpu", "TRUE", True),
        ("use_cpu", "0", False),
        ("collective_timeout", "2.5", 2.5),
        ("mixed_precision", " bf16 ", "bf16"),
        ("log_with", "tensorboard,csv", ("tensorboard", "csv")),
        ("max_grad_norm", "none", None),
        ("fsdp_cpu_offload", "yes", True),
    ],
)
def test_parse_text(name: str, text: str, value: object) -> None:
    assert parse_text(spec(name), text) == value


@pytest.mark.parametrize(("name", "text"), [("use_cpu", "maybe"), ("num_processes", "two")])
def test_parse_text_rejects_garbage(name: str, text: str) -> None:
    with pytest.raises(ConfigError, match=name):
        parse_text(spec(name), text)
