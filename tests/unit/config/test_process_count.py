"""num_processes counts every machine's processes (as in Accelerate), from every source.

The per-machine count is derived in one place (``Config.processes_per_machine``); a total that
does not split evenly over the machines, and an nbaccel file written when num_processes
counted one machine's processes, are refused before anything starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nbaccel.config.files import dump, load_file, save
from nbaccel.config.resolve import resolve
from nbaccel.config.schema import Config, option
from nbaccel.errors import ConfigError

# What `nbaccel config` wrote above num_processes before it became the total.
OLD_HELP = "# Worker processes per machine. Default: one per visible GPU, else 1."


def test_the_total_is_split_evenly_over_the_machines() -> None:
    config = Config(num_processes=4, num_machines=2)
    assert config.processes_per_machine(gpus=8) == 2  # the total, not the GPUs, decides
    assert config.total_processes(gpus=8) == 4
    assert Config(num_processes=6, num_machines=3).processes_per_machine(gpus=0) == 2


def test_unset_num_processes_is_still_one_per_gpu_on_each_machine() -> None:
    assert Config(num_machines=2).processes_per_machine(gpus=4) == 4
    assert Config(num_machines=2).total_processes(gpus=4) == 8
    assert Config(num_machines=3).total_processes(gpus=0) == 3  # CPU: one per machine


@pytest.mark.parametrize("gpus", [0, 1, 8])
def test_one_machine_is_unchanged(gpus: int) -> None:
    config = Config(num_processes=3)
    assert config.processes_per_machine(gpus) == config.total_processes(gpus) == 3
    assert Config().processes_per_machine(gpus) == Config().total_processes(gpus) == max(gpus, 1)


def test_the_help_says_total() -> None:
    text = option("num_processes").help
    assert "in all, over every machine" in text and "per machine." not in text


@pytest.mark.parametrize(("total", "machines"), [(3, 2), (1, 2), (5, 4)])
def test_a_total_that_does_not_split_is_refused_with_the_fix(total: int, machines: int) -> None:
    with pytest.raises(ConfigError) as caught:
        Config(num_processes=total, num_machines=machines)
    text = str(caught.value)
    assert caught.value.field == "num_processes"
    assert f"num_processes={total} cannot be split evenly over num_machines={machines}" in text
    assert "counts the processes of all machines together" in text  # why
    assert f"set num_processes={total * machines}" in text  # the fix for the old meaning
    assert f"--nproc_per_node {total}" in text


def test_every_source_gets_the_split_check(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"split evenly.*\(from argument\)"):
        resolve({"num_processes": 3, "num_machines": 2}, env={})
    env = {"NBACCEL_NUM_PROCESSES": "3", "NBACCEL_NUM_MACHINES": "2"}
    with pytest.raises(ConfigError, match=r"split evenly.*\(from env:NBACCEL_NUM_PROCESSES\)"):
        resolve(env=env)
    named = save(Config(num_processes=3), tmp_path / "three.yaml")
    with pytest.raises(ConfigError, match=r"split evenly.*\(from file:"):
        resolve({"num_machines": 2}, env={}, config=named)
    assert resolve({"num_processes": 4, "num_machines": 2}, env={}).config.num_processes == 4


def test_an_accelerate_file_total_passes_through_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "accelerate.yaml"
    path.write_text("distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 8\n")
    assert load_file(path)["num_processes"] == 8
    config = resolve(env={}, config=path).config
    assert (config.num_processes, config.processes_per_machine(gpus=4)) == (8, 4)
    path.write_text("distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 3\n")
    with pytest.raises(ConfigError, match=rf"split evenly.*\(from file:{path}\)"):
        resolve(env={}, config=path)


def old_file(tmp_path: Path, processes: int, machines: int) -> Path:
    """A file as `nbaccel config` wrote it while num_processes counted one machine."""
    text = dump(Config(num_processes=processes * machines, num_machines=machines))
    new_help = f"# {option('num_processes').help}"
    assert new_help in text
    text = text.replace(new_help, OLD_HELP).replace(
        f"num_processes: {processes * machines}", f"num_processes: {processes}"
    )
    path = tmp_path / "old.yaml"
    path.write_text(text)
    return path


def test_a_file_written_for_the_old_meaning_is_refused_even_when_it_divides(
    tmp_path: Path,
) -> None:
    path = old_file(tmp_path, processes=4, machines=2)  # meant 8 in all; read anew: 4
    with pytest.raises(ConfigError) as caught:
        resolve(env={}, config=path)
    text = str(caught.value)
    assert caught.value.field == "num_processes"
    assert f"Config file {path}" in text  # the file
    assert "'Worker processes per machine'" in text  # how it was told from a new one
    assert "would start 4 processes in all instead of 8" in text  # what would go wrong
    assert "write num_processes: 8" in text and "delete that comment line" in text  # the fix


def test_an_old_file_fixed_as_told_gives_the_same_job(tmp_path: Path) -> None:
    path = old_file(tmp_path, processes=4, machines=2)
    fixed = "\n".join(line for line in path.read_text().splitlines() if line != OLD_HELP)
    path.write_text(fixed.replace("num_processes: 4", "num_processes: 8"))
    config = resolve(env={}, config=path).config
    assert (config.num_processes, config.processes_per_machine(gpus=4)) == (8, 4)


def test_an_old_file_on_one_machine_means_the_same_and_loads(tmp_path: Path) -> None:
    path = tmp_path / "one.yaml"
    path.write_text(f"{OLD_HELP}\nnum_processes: 3\nnum_machines: 1\n")
    assert resolve(env={}, config=path).config.num_processes == 3
    path.write_text(f"{OLD_HELP}\nnum_processes: null\nnum_machines: 2\n")
    assert resolve(env={}, config=path).config.num_processes is None  # one per GPU, as before


@pytest.mark.parametrize(("processes", "machines"), [(3, 2), (1, 2), (2, 4)])
def test_a_hand_written_file_whose_count_cannot_be_a_total_names_the_old_meaning(
    tmp_path: Path, processes: int, machines: int
) -> None:
    path = tmp_path / "hand.yaml"
    path.write_text(f"num_machines: {machines}\nnum_processes: {processes}\n")
    with pytest.raises(ConfigError) as caught:
        load_file(path)
    text = str(caught.value)
    assert f"Config file {path}: num_processes: {processes} cannot be split evenly" in text
    assert "before, nbaccel counted one machine's" in text
    assert f"write num_processes: {processes * machines}" in text
    assert f"use a multiple of {machines}" in text


def test_a_hand_written_total_that_divides_is_read_as_a_total(tmp_path: Path) -> None:
    # Without the old comment nothing tells the two meanings apart: a count that can be a
    # total is one (documented), never silently multiplied.
    path = tmp_path / "hand.yaml"
    path.write_text("num_machines: 2\nnum_processes: 4\n")
    assert resolve(env={}, config=path).config.num_processes == 4


def test_a_new_file_round_trips_with_several_machines(tmp_path: Path) -> None:
    config = Config(num_processes=4, num_machines=2)
    path = save(config, tmp_path / "new.yaml")
    assert OLD_HELP not in path.read_text()
    assert resolve(env={}, config=path).config == config
