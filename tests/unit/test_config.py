"""Config schema: types, choices, limits, field names — every bad value named with its fix."""

from __future__ import annotations

import dataclasses

import pytest

from nbaccel.config import Config, check_field_names, field_specs, parse_text, shown_ranks
from nbaccel.errors import ConfigError


def spec(name: str) -> dataclasses.Field:  # type: ignore[type-arg]
    return next(s for s in field_specs() if s.name == name)


def test_defaults_are_valid_and_documented() -> None:
    config = Config()
    assert config.num_processes is None
    assert config.mixed_precision == "no"
    for field in field_specs():
        assert field.metadata["help"], f"{field.name} has no help text"


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"num_processes": 0}, "num_processes must be >= 1, got 0"),
        ({"num_processes": -2}, "num_processes must be >= 1"),
        ({"num_processes": 2.5}, "num_processes must be int, got 2.5 (float)"),
        ({"num_processes": "2"}, "num_processes must be int, got '2' (str)"),
        ({"num_processes": True}, "num_processes must be int, got True (bool)"),
        ({"mixed_precision": "fp32"}, "'no', 'fp16', 'bf16'"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be >= 1"),
        ({"collective_timeout": 0}, "collective_timeout must be >= 0.001"),
        ({"use_cpu": "yes"}, "use_cpu must be bool"),
        ({"log_ranks": "zero"}, "log_ranks='zero' is not 'all' or a comma list"),
        ({"log_ranks": "-1"}, "at least one rank >= 0"),
    ],
)
def test_bad_values_raise_config_error_naming_the_field(changes: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Config(**changes)
    assert fragment in str(caught.value)
    assert caught.value.field == next(iter(changes))


def test_ints_are_accepted_for_float_fields() -> None:
    assert Config(collective_timeout=5).collective_timeout == 5


def test_unknown_field_suggests_the_close_match() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'mixed_precision'"):
        check_field_names(["mixed_precison"])
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
    ],
)
def test_parse_text(name: str, text: str, value: object) -> None:
    assert parse_text(spec(name), text) == value


@pytest.mark.parametrize(("name", "text"), [("use_cpu", "maybe"), ("num_processes", "two")])
def test_parse_text_rejects_garbage(name: str, text: str) -> None:
    with pytest.raises(ConfigError, match=name):
        parse_text(spec(name), text)
