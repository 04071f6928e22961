"""`--num_processes` counts all machines; `--nproc_per_node` (torchrun's) counts one machine."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from nbaccel.cli import main
from nbaccel.cli.flags import add_config_flags, resolve_flags
from nbaccel.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith(("NBACCEL_", "ACCELERATE_")) or var in ("XDG_CONFIG_HOME", "HF_HOME"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path))


def flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return parser.parse_args(argv)


def shown(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, tuple[str, str]]:
    assert main(["config", "show", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    return {path: (value, source) for path, value, source in (x.split(maxsplit=2) for x in lines)}


@pytest.mark.parametrize("spelling", ["--nproc_per_node", "--nproc-per-node"])
def test_nproc_per_node_is_the_per_machine_count(spelling: str) -> None:
    resolved = resolve_flags(flags(spelling, "2", "--num_machines", "2"), env={})
    assert resolved.config.num_processes == 4  # the one meaning: the total
    assert resolved.config.processes_per_machine(gpus=0) == 2


def test_both_forms_give_the_same_config() -> None:
    total = resolve_flags(flags("--num_machines", "2", "--num_processes", "4"), env={})
    per_node = resolve_flags(flags("--nproc_per_node", "2", "--num_machines", "2"), env={})
    assert total.config == per_node.config
    assert total.config.processes_per_machine(gpus=0) == 2


def test_num_machines_from_the_environment_counts_too() -> None:
    resolved = resolve_flags(flags("--nproc_per_node", "3"), env={"NBACCEL_NUM_MACHINES": "2"})
    assert resolved.config.num_processes == 6


def test_config_show_lists_the_total_with_the_flag_as_its_source(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = shown(capsys, "--nproc_per_node", "2", "--num_machines", "3")
    assert rows["num_processes"] == ("6", "argument (--nproc_per_node 2 × num_machines 3)")
    assert rows["num_machines"] == ("3", "argument")
    assert shown(capsys, "--num_processes", "4", "--num_machines", "2")["num_processes"] == (
        "4",
        "argument",
    )


def test_both_flags_agreeing_is_accepted() -> None:
    argv = ("--nproc_per_node", "2", "--num_processes", "4", "--num_machines", "2")
    assert resolve_flags(flags(*argv), env={}).config.num_processes == 4


def test_both_flags_disagreeing_is_an_error_naming_both(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--nproc_per_node", "2", "--num_processes", "2", "--num_machines", "2"]
    assert main(["config", "show", *argv]) == 2
    err = capsys.readouterr().err
    assert "--num_processes 2 and --nproc_per_node 2 disagree" in err
    assert "num_machines=2 (from argument)" in err and "--num_processes 4" in err


def test_nproc_per_node_overrides_a_file_total(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("num_processes: 3\n")  # flags win over files, as for --num_processes
    args = flags("--config_file", str(path), "--nproc_per_node", "2", "--num_machines", "2")
    assert resolve_flags(args, env={}).config.num_processes == 4


@pytest.mark.parametrize("text", ["0", "two", "-1"])
def test_a_bad_nproc_per_node_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match=rf"--nproc_per_node '{text}' is not a whole number"):
        resolve_flags(flags("--nproc_per_node", text), env={})


def test_num_processes_not_divisible_is_refused_before_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["config", "show", "--num_machines", "2", "--num_processes", "3"]) == 2
    err = capsys.readouterr().err
    assert "num_processes=3 cannot be split evenly over num_machines=2" in err
    assert "(from argument)" in err
