"""``gpu_ids``, the GPUs of this machine a launch uses, in every face of the one schema:
keywords, nbaccel's YAML, Accelerate's YAML, ``NBACCEL_GPU_IDS``, ``--gpu_ids``, the wizard,
``--help``; bad values refused with the field named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nbaccel.cli import build_parser
from nbaccel.cli.config import run_wizard
from nbaccel.cli.flags import add_config_flags, resolve_flags
from nbaccel.config.accelerate.compat import from_accelerate_yaml
from nbaccel.config.field_values import gpu_id_list
from nbaccel.config.files import dump, load_file
from nbaccel.config.resolve import resolve
from nbaccel.config.schema import Config, option
from nbaccel.errors import ConfigError


def test_the_default_is_every_gpu_as_in_accelerate() -> None:
    assert Config().gpu_ids == "all" and gpu_id_list("all") is None
    assert gpu_id_list(" ALL ") is None
    assert gpu_id_list("3, 1") == (3, 1)  # the order given: rank 0 uses GPU 3


@pytest.mark.parametrize(
    ("given", "held"),
    [("0,2", "0,2"), ([0, 2], "0,2"), ((1,), "1"), (3, "3"), ("all", "all")],
)
def test_code_gives_text_a_list_or_an_int(given: Any, held: str) -> None:
    resolved = resolve({"gpu_ids": given}, env={})
    assert resolved.config.gpu_ids == held
    assert resolved.sources["gpu_ids"] == "argument"


@pytest.mark.parametrize(
    ("given", "fragment"),
    [
        ("0,a", "holds 'a', which is not a GPU index"),
        ("1.5", "holds '1.5', which is not a GPU index"),
        ("-1", "holds '-1', which is not a GPU index"),
        ("", "holds an empty entry"),
        ("0,,1", "holds an empty entry"),
        ("1,0,1", "names GPU 1 twice"),
        ([0, 0], "names GPU 0 twice"),
        ([0.5], "gpu_ids must be text such as '0,2' (or a list of ints), got [0.5]"),
        (True, "gpu_ids must be text such as '0,2' (or a list of ints), got True"),
    ],
)
def test_bad_values_are_refused_naming_the_field(given: Any, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve({"gpu_ids": given}, env={})
    assert fragment in str(caught.value) and "(from argument)" in str(caught.value)
    assert caught.value.field == "gpu_ids"


def test_the_environment_sets_it_with_nbaccels_name() -> None:
    resolved = resolve({}, env={"NBACCEL_GPU_IDS": "1,2"})
    assert resolved.config.gpu_ids == "1,2"
    assert resolved.sources["gpu_ids"] == "env:NBACCEL_GPU_IDS"
    # Accelerate has no variable for it (its launcher writes CUDA_VISIBLE_DEVICES itself).
    assert option("gpu_ids").accelerate_env is None
    with pytest.raises(ConfigError, match=r"names GPU 1 twice.*\(from env:NBACCEL_GPU_IDS\)"):
        resolve({}, env={"NBACCEL_GPU_IDS": "1,1"})


@pytest.mark.parametrize(("line", "held"), [("'0,2'", "0,2"), ("[1, 3]", "1,3"), ("2", "2")])
def test_nbaccel_yaml_holds_it_and_writes_it_back(tmp_path: Path, line: str, held: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(f"gpu_ids: {line}\n")
    config = resolve({}, env={}, config=path).config
    assert config.gpu_ids == held
    again = tmp_path / "again.yaml"
    again.write_text(dump(config))
    assert resolve({}, env={}, config=again).config.gpu_ids == held


def test_a_bad_value_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("gpu_ids: 0,x\n")
    with pytest.raises(ConfigError, match=rf"holds 'x'.*\(from file:{path}\)"):
        resolve({}, env={}, config=path)


@pytest.mark.parametrize(
    ("value", "held"), [("0,1", "0,1"), ("all", "all"), (1, "1"), (None, "all")]
)
def test_accelerates_yaml_gpu_ids_is_honoured(tmp_path: Path, value: Any, held: str) -> None:
    import yaml

    path = tmp_path / "default_config.yaml"
    data = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU"}
    path.write_text(yaml.safe_dump({**data, "gpu_ids": value, "num_processes": 2}))
    resolved = resolve({}, env={}, config=path)
    assert resolved.config.gpu_ids == held
    if value is not None:
        assert resolved.sources["gpu_ids"] == f"file:{path}"
    assert "gpu_ids" not in from_accelerate_yaml({**data, "gpu_ids": None}, "acc.yaml")
    assert load_file(path).get("gpu_ids", None) == value


def test_the_launch_flag_and_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    resolved = resolve_flags(parser.parse_args(["--gpu_ids", "2,0"]), env={})
    assert (resolved.config.gpu_ids, resolved.sources["gpu_ids"]) == ("2,0", "argument")
    assert resolve_flags(parser.parse_args(["--gpu-ids", "all"]), env={}).config.gpu_ids == "all"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--gpu_ids STR, --gpu-ids STR" in text
    assert "each worker sees only those, rank r the r-th" in text and "Default: all." in text


def test_the_wizard_asks_it_for_gpu_processes_only() -> None:
    asked: list[str] = []

    def answer(answers: dict[str, str]) -> Any:
        def ask(prompt: str) -> str:
            asked.append(prompt.split()[0])
            return answers.get(prompt.split()[0], "")

        return ask

    config = run_wizard(Config(), answer({"gpu_ids": "1,0"}), say=lambda line: None)
    assert config.gpu_ids == "1,0" and "gpu_ids" in asked
    asked.clear()
    config = run_wizard(Config(), answer({"use_cpu": "true"}), say=lambda line: None)
    assert config.gpu_ids == "all" and "gpu_ids" not in asked


def test_hosts_choose_no_gpus_here() -> None:
    with pytest.raises(ConfigError, match=r"gpu_ids='0'.*GPUs are chosen on this machine only"):
        Config(hosts=("a", "b"), gpu_ids="0")
