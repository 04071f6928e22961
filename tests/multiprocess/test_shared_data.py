"""The kernel's data reaches the ranks through shared memory, once (nbaccel/launcher/sharing).

Each rank says where its copy of the data lies (the mapping of /proc/self/maps that holds the
address): a memfd segment named ``nbaccel-data``, the same one (by inode) on every rank of the
machine, and never a private copy. Values come back the same way (``nbaccel-result`` on a
launch, ``nbaccel-data`` from interactive workers).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

import nbaccel
from nbaccel.launcher.sharing.cache import CACHE

MIB = 1 << 20
SEGMENTS = ("nbaccel-data", "nbaccel-result")


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    CACHE.clear()
    yield
    CACHE.clear()


def mapping_of(address: int) -> tuple[str, int]:
    """The file name and inode of the mapping of this process that holds ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, _perms, _offset, _device, inode, *path = line.split()
            low, high = (int(edge, 16) for edge in span.split("-"))
            if low <= address < high:
                return " ".join(path), int(inode)
    raise AssertionError(f"no mapping holds {address:#x}")


def address_of(value: Any) -> int:
    """Where the first large buffer of ``value`` lies in this process."""
    kind = type(value).__module__.split(".")[0]
    if kind == "numpy":
        return int(value.__array_interface__["data"][0])
    if kind == "pandas":
        return int(value["a"].to_numpy().__array_interface__["data"][0])
    if kind == "pyarrow":
        return int(value.column("a").chunks[0].buffers()[1].address)
    if kind == "datasets":
        return int(value.data.table.column("a").chunks[0].buffers()[1].address)
    if kind == "torch":
        return int(value.data_ptr())
    raise AssertionError(f"no probe for {type(value)}")


def checksum(value: Any) -> float:
    kind = type(value).__module__.split(".")[0]
    if kind == "pandas":
        return float(value["a"].sum())
    if kind in ("pyarrow", "datasets"):
        table = value if kind == "pyarrow" else value.data.table
        return float(table.column("a").to_numpy().sum())
    return float(value.sum())


def containers() -> dict[str, Any]:
    """Every kind of data a notebook holds, 4 MiB or more each."""
    import datasets
    import pandas as pd
    import pyarrow as pa
    import torch

    column = np.arange(1 << 19, dtype="f8")  # 4 MiB
    return {
        "numpy": column * 2,
        "pandas": pd.DataFrame({"a": column, "b": column.astype("i8"), "s": ["x"] * len(column)}),
        "arrow": pa.table({"a": column, "t": ["hi"] * len(column)}),
        "dataset": datasets.Dataset.from_dict({"a": column}),
        "tensor": torch.arange(1 << 20, dtype=torch.float32),
    }


def where_and_sums(data: dict[str, Any]) -> dict[str, tuple[str, int, float]]:
    """On a rank: for each container, the mapping its data lies in, and its checksum."""
    return {name: (*mapping_of(address_of(v)), checksum(v)) for name, v in data.items()}


def as_cell(source: str, **names: Any) -> dict[str, Any]:
    """Run ``source`` as a notebook cell does: its functions live in ``__main__`` (they
    travel by value, with the globals they use)."""
    namespace = {"__name__": "__main__", **names}
    exec(textwrap.dedent(source), namespace)
    return namespace


def assert_shared(
    found: dict[int, dict[str, tuple[str, int, float]]], data: dict[str, Any]
) -> None:
    for name, value in data.items():
        paths = {rank: found[rank][name][0] for rank in found}
        assert all("memfd:nbaccel-data" in path for path in paths.values()), (name, paths)
        inodes = {found[rank][name][1] for rank in found}
        assert len(inodes) == 1, f"{name}: each rank has its own segment {inodes}"
        assert {found[rank][name][2] for rank in found} == {checksum(value)}, name


def test_globals_closures_args_and_kwargs_reach_every_rank_in_one_segment(runs_dir: str) -> None:
    data = containers()
    cell = as_cell(
        """
        def from_globals():
            return where_and_sums(data)

        def make_closure(held):
            def from_closure():
                return where_and_sums(held)
            return from_closure

        def from_args(given, **more):
            return where_and_sums({**given, **more})
        """,
        data=data,
        where_and_sums=where_and_sums,
    )
    launch = dict(num_processes=2, runs_dir=runs_dir, dashboard="text")
    assert_shared(nbaccel.launch(cell["from_globals"], **launch).results(), data)
    closure = cell["make_closure"](data)
    assert_shared(nbaccel.launch(closure, **launch).results(), data)
    numpy_only = {"numpy": data["numpy"]}
    others = {k: v for k, v in data.items() if k != "numpy"}
    run = nbaccel.launch(cell["from_args"], args=(numpy_only,), kwargs=others, **launch)
    assert_shared(run.results(), data)


def return_containers() -> dict[str, Any]:
    import torch.distributed as dist

    data = containers()
    data["numpy"] += dist.get_rank()
    return data


def test_values_come_back_through_shared_memory(runs_dir: str) -> None:
    values = nbaccel.launch(return_containers, num_processes=2, runs_dir=runs_dir).results()
    expected = containers()
    for rank, data in values.items():
        for name, value in data.items():
            path, _ = mapping_of(address_of(value))
            assert "memfd:nbaccel-result" in path, (rank, name, path)
            extra = rank * len(value) if name == "numpy" else 0
            assert checksum(value) == checksum(expected[name]) + extra
    values[0]["numpy"][0] = 99.0  # writable in the kernel (its own private map of the box)
    assert values[0]["numpy"][0] == 99.0


def write_then_read(data: np.ndarray) -> tuple[float, float, str]:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        data[:] = -1.0  # copy-on-write: this rank's pages only
    dist.barrier()  # rank 1 reads after rank 0 wrote: a shared map would show it the -1s
    return float(data.min()), float(data.max()), where_it_lies(data)


def kernels_segment_holds(data: np.ndarray) -> np.ndarray:
    """What the kernel's cached segment of ``data`` holds (the copy every rank maps)."""
    (segment,) = CACHE._segments.values()
    return np.frombuffer(os.pread(segment.fd, data.nbytes, 0), dtype=data.dtype)


def test_a_rank_writing_its_data_changes_no_one_else(runs_dir: str) -> None:
    data = np.ones(MIB, dtype="f8")
    values = nbaccel.launch(write_then_read, args=(data,), num_processes=2, runs_dir=runs_dir)
    segment = "/memfd:nbaccel-data (deleted)"
    assert values.results() == {0: (-1.0, -1.0, segment), 1: (1.0, 1.0, segment)}
    assert data.min() == data.max() == 1.0  # the kernel's array
    assert kernels_segment_holds(data).min() == 1.0  # the copy the ranks map
    again = nbaccel.launch(write_then_read, args=(data,), num_processes=2, runs_dir=runs_dir)
    assert again.results() == {0: (-1.0, -1.0, segment), 1: (1.0, 1.0, segment)}


def first_and_sum(data: np.ndarray) -> tuple[float, float]:
    return float(data[0]), float(data.sum())


def test_unchanged_data_is_not_copied_again_and_changed_data_arrives(runs_dir: str) -> None:
    data = np.ones(2 * MIB, dtype="f4")
    launch = dict(args=(data,), num_processes=2, runs_dir=runs_dir)
    assert nbaccel.notebook_launcher(first_and_sum, **launch) == (1.0, 2.0 * MIB)
    written = CACHE.bytes_written
    assert written >= data.nbytes
    assert nbaccel.notebook_launcher(first_and_sum, **launch) == (1.0, 2.0 * MIB)
    assert CACHE.bytes_written == written  # compared, not copied
    data[0] = 5.0  # changed in place between two launches
    assert nbaccel.notebook_launcher(first_and_sum, **launch) == (5.0, 2.0 * MIB + 4)
    assert CACHE.bytes_written == written + data.nbytes


def test_a_check_of_kept_data_that_fails_is_raised_and_the_next_launch_works(
    runs_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Kept data is checked while the ranks start (sharing/late_check.py); they wait for it.
    data = np.ones(2 * MIB, dtype="f4")
    launch = dict(args=(data,), num_processes=2, runs_dir=runs_dir)
    assert nbaccel.notebook_launcher(first_and_sum, **launch) == (1.0, 2.0 * MIB)

    def no_memory(*args: Any) -> dict[int, Any]:
        raise OSError(12, "Cannot allocate memory")

    with monkeypatch.context() as patched:
        patched.setattr(CACHE, "settle", no_memory)
        with pytest.raises(OSError, match="allocate"):
            nbaccel.notebook_launcher(first_and_sum, **launch)
    data[1] = 2.0
    assert nbaccel.notebook_launcher(first_and_sum, **launch) == (1.0, 2.0 * MIB + 1)


def where_it_lies(data: Any) -> str:
    return mapping_of(address_of(data))[0]


def test_a_small_limit_sends_the_data_in_the_pickle_and_says_why(runs_dir: str) -> None:
    data = np.ones(2 * MIB, dtype="f4")  # 8 MiB
    run = nbaccel.launch(
        where_it_lies,
        args=(data,),
        num_processes=2,
        runs_dir=runs_dir,
        shared_memory_limit_gb=0.004,
        dashboard="text",
    )
    assert all("nbaccel-data" not in path for path in run.results().values())
    assert any(
        "(8.0 MiB) are more than shared_memory_limit_gb=0.004" in notice for notice in run.notices
    ), run.notices
    off = nbaccel.launch(
        where_it_lies, args=(data,), num_processes=1, runs_dir=runs_dir, shared_memory_limit_gb=0
    )
    assert "nbaccel-data" not in off.result() and not off.notices


def as_received(value: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The value as the rank got it, and where its large objects lie on the rank."""
    return value, [mapping_of(id(value[name]))[0] for name in ("text", "blob")]


def test_data_whose_pickling_exposes_no_buffer_travels_as_before(runs_dir: str) -> None:
    value = {
        "text": "x" * MIB,
        "blob": b"y" * (4 * MIB),
        "rows": [(i, str(i)) for i in range(1000)],
    }
    run = nbaccel.launch(as_received, args=(value,), num_processes=2, runs_dir=runs_dir)
    for rank, (got, where) in run.results().items():
        assert got == value, rank  # whole and unchanged
        assert not any("nbaccel" in path for path in where), where  # inside the pickle


def holders(pids: set[int], names: tuple[str, ...] = SEGMENTS) -> dict[int, list[str]]:
    """Which of ``pids`` hold (an fd) or map a segment of ``names``."""
    found: dict[int, list[str]] = {}
    for pid in pids:
        held = []
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            with open(f"/proc/{pid}/maps") as maps:
                held += list(maps)
        except OSError:
            continue  # gone
        for fd in fds:
            try:
                held.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass  # closed meanwhile
        ours = [seen for seen in held if any(name in seen for name in names)]
        if ours:
            found[pid] = ours
    return found


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


KERNEL = """
import os, sys, time, numpy as np, nbaccel
data = np.ones(1 << 21, dtype="f4")
ready = sys.argv[1]
def hold():
    import pathlib, torch.distributed as dist
    float(data.sum())
    pathlib.Path(ready + str(dist.get_rank())).write_text(str(os.getpid()))
    time.sleep(600)
nbaccel.notebook_launcher(hold, num_processes=2, dashboard="text", {extra})
"""


NO_MEMFD = """
import ctypes, os
del os.memfd_create
class _NoMemfd(ctypes.CDLL):
    def __getattr__(self, name):
        if name in ("memfd_create", "syscall"):
            raise AttributeError(name)
        return super().__getattr__(name)
ctypes.CDLL = _NoMemfd
"""


def shm_names() -> list[str]:
    return [name for name in os.listdir("/dev/shm") if "nbaccel" in name]


@pytest.mark.parametrize("who", ["kernel", "worker", "agent", "kernel without memfd"])
def test_sigkill_leaves_no_segment_anywhere(tmp_path: Path, who: str) -> None:
    # The agent: torch elastic's, which a launch with restarts runs on this machine too.
    # Without memfd (every process of the launch): the segments are /dev/shm files,
    # unlinked as soon as made, so nothing is left there either.
    extra = "max_restarts=1" if who == "agent" else "max_restarts=0"
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL.format(extra=extra))
    ready = tmp_path / "ready"
    env = dict(os.environ)
    if who == "kernel without memfd":
        (tmp_path / "site").mkdir()
        (tmp_path / "site" / "sitecustomize.py").write_text(NO_MEMFD)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join((str(tmp_path / "site"), root))
    shm_before = shm_names()
    kernel = subprocess.Popen(
        [sys.executable, str(script), str(ready)],
        cwd=tmp_path,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        files = [Path(f"{ready}{rank}") for rank in (0, 1)]
        wait_for(lambda: all(f.exists() and f.read_text() for f in files), 120, "both ranks")
        rank1 = int(files[1].read_text())
        tree = {kernel.pid} | {p.pid for p in psutil.Process(kernel.pid).children(recursive=True)}
        held = holders(tree)
        assert {kernel.pid, rank1} <= set(held), held
        if who == "kernel without memfd":  # the segments are /dev/shm files, without a name
            assert any("/dev/shm/nbaccel-data-" in line for line in held[rank1]), held
            assert not any("memfd:" in line for line in held[rank1]), held
            assert shm_names() == shm_before
        if who.startswith("kernel"):
            victim = kernel.pid
        elif who == "worker":
            victim = rank1
        else:
            victim = psutil.Process(rank1).ppid()  # elastic forks its workers
            assert any("agent_main" in part for part in psutil.Process(victim).cmdline())
        os.kill(victim, signal.SIGKILL)
        if who != "kernel":
            assert kernel.wait(timeout=120) != 0  # the run failed, the script ended
        wait_for(lambda: not holders(tree), 60, "every holder of a segment to end")
        assert shm_names() == shm_before
    finally:
        kernel.kill()
        kernel.wait()


def test_push_pull_and_run_arguments_go_through_shared_memory(runs_dir: str) -> None:
    data = containers()
    with nbaccel.Workers(num_processes=2, runs_dir=runs_dir, dashboard="text") as workers:
        workers.push(data=data)
        workers.run_cell(
            "from tests.multiprocess.test_shared_data import where_and_sums\n"
            "found = where_and_sums(data)\n",
            "<cell 1>",
        )
        assert_shared(workers.pull("found"), data)
        assert_shared(workers.run(where_and_sums, data), data)
        for rank, pulled in workers.pull("data").items():
            for name, value in pulled.items():
                path, _ = mapping_of(address_of(value))
                assert "memfd:nbaccel-data" in path, (rank, name, path)
                assert checksum(value) == checksum(data[name])
        CACHE.clear()  # the kernel lets go: the ranks keep what a name refers to
        assert workers.run_cell("float(data['numpy'].sum())", "<cell 2>") == {
            0: repr(checksum(data["numpy"])),
            1: repr(checksum(data["numpy"])),
        }
        usage = workers.memory
        assert all(usage[rank]["uss"] < usage[rank]["rss"] for rank in usage), usage
        assert all("pss" in usage[rank] for rank in usage), usage


def test_fifty_launches_with_100_mb_leak_no_segment_and_no_fd(runs_dir: str) -> None:
    data = np.ones(100 * MIB // 4, dtype="f4")
    me = psutil.Process()
    launch = dict(args=(data,), num_processes=2, runs_dir=runs_dir, dashboard="text")
    for _ in range(3):  # the helper settles (a library it may not preload retires it once)
        nbaccel.notebook_launcher(first_and_sum, **launch)
    fds = me.num_fds()
    for index in range(50):
        if index % 10 == 9:
            data[0] = index  # changed: written again, and the old segment goes
        assert nbaccel.notebook_launcher(first_and_sum, **launch)[0] == data[0]
    assert me.num_fds() <= fds
    assert CACHE.size <= 101 * MIB  # one segment, the latest
    # The kernel holds that one segment's fd, and no result box or late segment of any run.
    # A run is freed by the cycle collector (its display subscriber holds run.host_of): one
    # collection first, so that an earlier test's values, dropped but not yet collected,
    # are not taken for this test's leak.
    gc.collect()
    assert holders({me.pid}) == {me.pid: ["/memfd:nbaccel-data (deleted)"]}
    helper_tree = {p.pid for p in me.children(recursive=True)}
    assert not holders(helper_tree)
    CACHE.clear()  # released: no segment is left open in the kernel
    assert not holders({me.pid})


def after_the_gate(gate: str, data: np.ndarray) -> tuple[str, float]:
    deadline = time.monotonic() + 120  # bounded: the test opens the gate
    while not os.path.exists(gate):
        assert time.monotonic() < deadline, "the test never opened the gate"
        time.sleep(0.02)
    return where_it_lies(data), float(data.sum())


def test_a_detached_run_keeps_its_data_while_it_runs(tmp_path: Path, runs_dir: str) -> None:
    data = np.ones(2 * MIB, dtype="f4")
    gate = tmp_path / "gate"
    run = nbaccel.launch(
        after_the_gate,
        args=(str(gate), data),
        num_processes=2,
        detach=True,
        runs_dir=runs_dir,
        dashboard=False,
    )
    supervisor = psutil.Process(run.supervisor_pid)
    wait_for(  # its workers hold the segments (the supervisor handed them over)
        lambda: len(holders({p.pid for p in supervisor.children(recursive=True)})) == 2,
        60,
        "both workers to map the data",
    )
    CACHE.clear()  # the kernel lets go of its copy: the run goes on with its own
    assert os.getpid() not in holders({os.getpid()}, ("nbaccel-data",))
    gate.touch()
    assert run.wait(120) is nbaccel.RunState.SUCCEEDED, run.error
    assert set(run.results().values()) == {("/memfd:nbaccel-data (deleted)", float(data.sum()))}


def test_the_run_folder_keeps_a_plain_pickle_of_a_shared_value(runs_dir: str) -> None:
    import pickle

    run = nbaccel.launch(return_containers, num_processes=1, runs_dir=runs_dir)
    value = run.result()
    with open(run.run_dir / "result-rank0.pkl", "rb") as file:
        kept = pickle.load(file)  # no buffers needed: they are inside
    assert {name: checksum(v) for name, v in kept.items()} == {
        name: checksum(v) for name, v in value.items()
    }


def column_sum(table: Any) -> float:
    return checksum(table)


def test_arrow_data_is_kept_while_launches_send_it_and_goes_when_they_stop(runs_dir: str) -> None:
    # pyarrow hands out a new buffer object with each pickle, over memory the table owns:
    # no weak reference can tell when the table goes, so its segment stays while launches
    # keep sending it (compared, not copied) and goes at the first launch that does not.
    import pyarrow as pa

    table = pa.table({"a": np.arange(1 << 20, dtype="f8")})  # 8 MiB
    launch = dict(num_processes=1, runs_dir=runs_dir)
    assert nbaccel.notebook_launcher(column_sum, args=(table,), **launch) == checksum(table)
    written = CACHE.bytes_written
    assert nbaccel.notebook_launcher(column_sum, args=(table,), **launch) == checksum(table)
    assert CACHE.bytes_written == written  # the second launch copied nothing
    assert CACHE.size >= 8 * MIB
    nbaccel.notebook_launcher(first_and_sum, args=(np.ones(2 * MIB, "f4"),), **launch)
    assert CACHE.size < 10 * MIB  # the table's segment went; the new array's is there


def segment_size(data: np.ndarray) -> tuple[str, int]:
    """The mapping ``data`` lies in on this rank, and its size (its segment's, whole)."""
    address = int(data.__array_interface__["data"][0])
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, _perms, _offset, _device, _inode, *path = line.split()
            low, high = (int(edge, 16) for edge in span.split("-"))
            if low <= address < high:
                return " ".join(path), high - low
    raise AssertionError("not mapped")


def total(arrays: dict[str, np.ndarray]) -> float:
    return sum(float(array.sum()) for array in arrays.values())


def test_an_agent_gets_only_the_data_its_launch_uses(runs_dir: str) -> None:
    # A launch with restarts goes through an agent, as one on other hosts does: it is sent
    # the bytes of the buffers its launch uses, not the kernel's whole cached segments.
    used, other = np.ones(2 * MIB, dtype="f4"), np.zeros(4 * MIB, dtype="f4")  # 8, 16 MiB
    launch = dict(num_processes=1, runs_dir=runs_dir, dashboard="text")
    nbaccel.notebook_launcher(total, args=({"u": used, "o": other},), **launch)
    assert CACHE.size >= used.nbytes + other.nbytes  # one segment holds both
    path, size = nbaccel.notebook_launcher(segment_size, args=(used,), max_restarts=1, **launch)
    assert path == "/memfd:nbaccel-data (deleted)"  # the agent's own segment
    assert size == used.nbytes, size  # not the 24 MiB of the kernel's segment
