"""Which hosts a multi-host launch uses (lists, hostfiles, Slurm) and how processes split."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbaccel.errors import ConfigError
from nbaccel.launcher.remote.hosts import (
    Host,
    expand_hostlist,
    expand_tasks_per_node,
    processes_per_host,
    read_hosts,
)


def error_of(hosts: object, env: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        read_hosts(hosts, env or {})  # type: ignore[arg-type]
    assert caught.value.field == "hosts"
    return caught.value


# --- lists ---------------------------------------------------------------------------------


def test_a_list_keeps_names_and_order_without_slots() -> None:
    hosts = read_hosts(["node2", "alice@node1", "gpu-box", "::1"], {})
    assert hosts == [Host("node2"), Host("alice@node1"), Host("gpu-box"), Host("::1")]
    assert read_hosts(("a", "b"), {}) == [Host("a"), Host("b")]


@pytest.mark.parametrize(
    ("hosts", "fragments"),
    [
        (["node1", "node1"], ["node1 twice", "slots=8"]),
        ([], ["names no host", "hostfile"]),
        (["node1", ""], ["'' is empty"]),
        (["node 1"], ["'node 1' holds a blank"]),
        (["-oProxyCommand=x"], ["starts with '-'", "option"]),
        (["node1:4"], ["host:port or host:slots", "'-p'", "hostfile"]),
        (["node1", 2], ["int 2", 'hosts=["node1", "node2"]']),
    ],
)
def test_bad_lists_say_what_and_how_to_fix(hosts: list[object], fragments: list[str]) -> None:
    message = str(error_of(hosts))
    for fragment in fragments:
        assert fragment in message


# --- hostfiles -----------------------------------------------------------------------------


def test_a_hostfile_in_deepspeeds_format(tmp_path: Path) -> None:
    path = tmp_path / "hostfile"
    path.write_text(
        "# the cluster\n\nnode1 slots=4\n  node2   slots=2   # the small one\n"
        "\t\nworker-3 slots=8\n"
    )
    assert read_hosts(str(path), {}) == [Host("node1", 4), Host("node2", 2), Host("worker-3", 8)]


def test_a_hostfile_may_leave_slots_out(tmp_path: Path) -> None:
    path = tmp_path / "hosts.txt"
    path.write_text("node1\nnode2\n")
    assert read_hosts(str(path), {}) == [Host("node1"), Host("node2")]


@pytest.mark.parametrize(
    "line", ["node1 slots=four", "node1 slots=0", "node1 4", "node1 slots=2 slots=3", "node1 x=1"]
)
def test_a_bad_hostfile_line_is_named_by_file_and_line(tmp_path: Path, line: str) -> None:
    path = tmp_path / "hostfile"
    path.write_text(f"# header\nnode0 slots=1\n{line}\n")
    message = str(error_of(str(path)))
    assert f"{path}, line 3: cannot read {line!r}" in message
    assert "`node1 slots=4`" in message


def test_hostfile_duplicates_and_missing_files(tmp_path: Path) -> None:
    path = tmp_path / "hostfile"
    path.write_text("node1 slots=2\nnode1 slots=2\n")
    assert "node1 twice" in str(error_of(str(path)))
    missing = str(error_of(str(tmp_path / "nope")))
    assert "neither a hostfile" in missing and '"slurm"' in missing
    assert "names no host" in str(error_of(str(_write(tmp_path / "empty", "# nothing\n"))))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- Slurm ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("node1", ["node1"]),
        ("node[01-03,7],gpu2", ["node01", "node02", "node03", "node7", "gpu2"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[007,010-011]", ["n007", "n010", "n011"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("a[1-2],b,c[3]", ["a1", "a2", "b", "c3"]),
        ("a[1-2] b", ["a1", "a2", "b"]),
        ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
    ],
)
def test_slurm_host_lists_expand_in_slurms_order(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


@pytest.mark.parametrize(
    "text",
    ["node[1-3", "node1-3]", "node[3-1]", "node[a-b]", "node[]", "node[1-2-3]", "n[0-70000]"],
)
def test_bad_slurm_host_lists_raise(text: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(text)


@pytest.mark.parametrize(
    ("text", "counts"),
    [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3]), ("8(x1)", [8])],
)
def test_tasks_per_node_forms(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(3)", "x2", "2(x)", "2,,1"])
def test_bad_tasks_per_node_raise(text: str) -> None:
    with pytest.raises(ValueError):
        expand_tasks_per_node(text)


def test_slurm_allocation_with_and_without_tasks() -> None:
    env = {"SLURM_JOB_NODELIST": "gpu[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert read_hosts("slurm", env) == [Host("gpu1", 2), Host("gpu2", 2), Host("gpu3", 1)]
    assert read_hosts("slurm", {"SLURM_JOB_NODELIST": "gpu[1-2]"}) == [Host("gpu1"), Host("gpu2")]
    # Older Slurm releases name the variable SLURM_NODELIST.
    assert read_hosts("slurm", {"SLURM_NODELIST": "a,b"}) == [Host("a"), Host("b")]


def test_slurm_errors_name_the_variable_and_the_way_out() -> None:
    outside = str(error_of("slurm", {}))
    assert "not set" in outside and "salloc" in outside and "hostfile" in outside
    bad = str(error_of("slurm", {"SLURM_JOB_NODELIST": "node[1-"}))
    assert "SLURM_JOB_NODELIST='node[1-'" in bad
    mismatch = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    assert "counts 2 nodes" in str(error_of("slurm", mismatch))
    garbled = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "two"}
    assert "SLURM_TASKS_PER_NODE='two' cannot be read" in str(error_of("slurm", garbled))
    assert "n1 twice" in str(error_of("slurm", {"SLURM_JOB_NODELIST": "n[1-2],n1"}))


# --- splitting num_processes ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("slots", "num_processes", "counts"),
    [
        ([4, 4], None, [4, 4]),
        ([4, 2], None, [4, 2]),
        ([4, 4], 8, [4, 4]),
        ([4, 4], 6, [4, 2]),
        ([4, 4], 3, [3, 0]),
        ([1, 2, 3], 4, [1, 2, 1]),
    ],
)
def test_slots_fill_hosts_in_order(
    slots: list[int], num_processes: int | None, counts: list[int]
) -> None:
    hosts = [Host(f"h{i}", n) for i, n in enumerate(slots)]
    assert processes_per_host(hosts, num_processes) == counts


def test_more_processes_than_slots_says_both_numbers() -> None:
    with pytest.raises(ConfigError) as caught:
        processes_per_host([Host("a", 4), Host("b", 2)], 8)
    message = str(caught.value)
    assert "slots add up to 6 but num_processes=8" in message
    assert "a=4, b=2" in message and "num_processes <= 6" in message
    assert caught.value.field == "num_processes"


@pytest.mark.parametrize(
    ("hosts", "num_processes", "counts"),
    [(2, 8, [4, 4]), (3, 3, [1, 1, 1]), (1, 5, [5])],
)
def test_without_slots_processes_split_evenly(
    hosts: int, num_processes: int, counts: list[int]
) -> None:
    assert processes_per_host([Host(f"h{i}") for i in range(hosts)], num_processes) == counts


@pytest.mark.parametrize(
    ("hosts", "num_processes", "nearest"),
    [(2, 7, "num_processes=6 or 8"), (3, 2, "num_processes=3 or 6"), (4, 10, "=8 or 12")],
)
def test_not_divisible_offers_the_two_nearest_totals(
    hosts: int, num_processes: int, nearest: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        processes_per_host([Host(f"h{i}") for i in range(hosts)], num_processes)
    message = str(caught.value)
    assert f"num_processes={num_processes} cannot be split evenly over {hosts} hosts" in message
    assert nearest in message


def test_split_refusals() -> None:
    with pytest.raises(ConfigError, match="num_processes is needed"):
        processes_per_host([Host("a"), Host("b")], None)
    with pytest.raises(ConfigError, match="b have none") as mixed:
        processes_per_host([Host("a", 2), Host("b")], 4)
    assert mixed.value.field == "hosts"
    with pytest.raises(ConfigError, match="must be >= 1, got 0"):
        processes_per_host([Host("a", 2)], 0)
    with pytest.raises(ConfigError, match="at least one host"):
        processes_per_host([], 2)
