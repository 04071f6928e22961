"""resolve(): defaults < file < env < explicit, a pure function that records every source."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nbaccel.config.resolve import env_names, resolve
from nbaccel.config.schema import Config
from nbaccel.errors import ConfigError


def test_defaults_when_nothing_is_given() -> None:
    resolved = resolve(env={})
    assert resolved.config == Config()
    assert set(resolved.sources.values()) == {"default"}


def test_precedence_file_then_env_then_explicit(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("num_processes: 3\nmixed_precision: fp16\ngradient_accumulation_steps: 2\n")
    env = {"NBACCEL_MIXED_PRECISION": "bf16", "NBACCEL_GRADIENT_ACCUMULATION_STEPS": "5"}
    resolved = resolve({"gradient_accumulation_steps": 7}, env=env, config=path)
    assert resolved.config.num_processes == 3
    assert resolved.sources["num_processes"] == f"file:{path}"
    assert resolved.config.mixed_precision == "bf16"
    assert resolved.sources["mixed_precision"] == "env:NBACCEL_MIXED_PRECISION"
    assert resolved.config.gradient_accumulation_steps == 7
    assert resolved.sources["gradient_accumulation_steps"] == "argument"


def test_accelerate_names_are_aliases_and_lose_to_nbaccel_names() -> None:
    env = {"ACCELERATE_MIXED_PRECISION": "fp16", "ACCELERATE_USE_CPU": "true"}
    resolved = resolve(env=env)
    assert resolved.config.mixed_precision == "fp16"
    assert resolved.config.use_cpu is True
    env["NBACCEL_MIXED_PRECISION"] = "bf16"
    assert resolve(env=env).config.mixed_precision == "bf16"
    assert env_names("use_cpu") == ("NBACCEL_USE_CPU", "ACCELERATE_USE_CPU")


def test_config_object_counts_as_explicit_but_env_fills_the_rest() -> None:
    env = {"NBACCEL_MIXED_PRECISION": "bf16", "NBACCEL_NUM_PROCESSES": "4"}
    resolved = resolve(env=env, config=Config(num_processes=2))
    assert resolved.config.num_processes == 2
    assert resolved.config.mixed_precision == "bf16"


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="env:NBACCEL_USE_CPU"):
        resolve(env={"NBACCEL_USE_CPU": "perhaps"})
    with pytest.raises(ConfigError, match=r"'fp8'.*env:ACCELERATE_MIXED_PRECISION"):
        resolve(env={"ACCELERATE_MIXED_PRECISION": "fp8"})


def test_bad_file_value_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("num_processes: 0\n")
    with pytest.raises(ConfigError, match=f"from file:{path}"):
        resolve(env={}, config=path)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("num_processes: [1,\n", "is not valid YAML"),
        ("- 1\n- 2\n", "must hold a mapping"),
        ("num_procs: 2\n", "Did you mean 'num_processes'"),
    ],
)
def test_malformed_files(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        resolve(env={}, config=path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Cannot read config file"):
        resolve(env={}, config=tmp_path / "absent.yaml")


def test_resolve_never_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NBACCEL_MIXED_PRECISION", "bf16")
    assert resolve(env={}).config.mixed_precision == "no"
    assert os.environ["NBACCEL_MIXED_PRECISION"] == "bf16"


def test_caller_defaults_sit_below_files_env_and_arguments(tmp_path: Path) -> None:
    # What `nbaccel launch` does for scripts: its defaults must not override the user's.
    path = tmp_path / "c.yaml"
    path.write_text("init_process_group: true\n")
    defaults = {"init_process_group": False, "log_ranks": "all"}
    resolved = resolve(env={"NBACCEL_LOG_RANKS": "0"}, config=path, defaults=defaults)
    assert resolved.config.init_process_group is True
    assert resolved.config.log_ranks == "0"
    plain = resolve(env={}, defaults=defaults)
    assert plain.config.init_process_group is False
    assert plain.sources["init_process_group"] == "default"
    with pytest.raises(ConfigError, match="Did you mean 'log_ranks'"):
        resolve(env={}, defaults={"log_rank": "all"})
