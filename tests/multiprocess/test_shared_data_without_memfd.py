"""Launches where Python has no ``os.memfd_create`` (uv's and some conda builds,
astral-sh/uv#15081): the data still reaches the ranks through shared memory (the memfd
system call, else an unnamed /dev/shm file), else through the pipe; each way is said once,
and no launch fails, with data or without.

Every process of the launch (kernel, helper, workers) runs a ``sitecustomize`` that takes
the ways away, as such a Python build lacks them everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

SITECUSTOMIZE = """
import ctypes, errno, os, tempfile
if {os!r}:
    del os.memfd_create  # as uv's Pythons before mid-2026 lack it
if {ctypes!r}:
    class _NoMemfd(ctypes.CDLL):  # a C library without memfd_create or syscall
        def __getattr__(self, name):
            if name in ("memfd_create", "syscall"):
                raise AttributeError(name)
            return super().__getattr__(name)
    ctypes.CDLL = _NoMemfd
if {shm!r}:
    _mkstemp = tempfile.mkstemp
    def _no_shm(*args, dir=None, **kwargs):  # a container without /dev/shm
        if dir is not None and str(dir).startswith("/dev/shm"):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", dir)
        return _mkstemp(*args, dir=dir, **kwargs)
    tempfile.mkstemp = _no_shm
"""

KERNEL = """
import gc, json, os, sys
import numpy as np
import nbaccel
from nbaccel.launcher.sharing.cache import CACHE

assert not hasattr(os, "memfd_create")

def mapping_of(address):
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, _perms, _offset, _device, inode, *path = line.split()
            low, high = (int(edge, 16) for edge in span.split("-"))
            if low <= address < high:
                return " ".join(path), int(inode)
    return "", 0

def shm():
    return sorted(name for name in os.listdir("/dev/shm") if "nbaccel" in name)

def nbaccel_fds():
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "nbaccel-data" in target or "nbaccel-result" in target:
            found.append(target)
    return found

def where(data):
    import torch.distributed as dist
    path, inode = mapping_of(data.__array_interface__["data"][0])
    back = np.full(1 << 18, dist.get_rank(), dtype="f4")  # 1 MiB: through the result box
    return {"path": path, "inode": inode, "sum": float(data.sum()), "shm": shm(), "back": back}

def nothing():
    return "no data"

data = np.arange(1 << 20, dtype="f4")  # 4 MiB
launch = dict(num_processes=2, dashboard="text", runs_dir=sys.argv[1])
report = {"launches": []}
for _ in range(2):
    run = nbaccel.launch(where, args=(data,), **launch)
    values = run.results()
    report["launches"].append({
        "notices": run.notices,
        "ranks": {
            str(rank): {
                **{k: v for k, v in value.items() if k != "back"},
                "back": mapping_of(value["back"].__array_interface__["data"][0])[0],
                "back_ok": bool((value["back"] == rank).all()),
            }
            for rank, value in values.items()
        },
    })
    del run, values
bare = nbaccel.launch(nothing, **launch)
report["bare"] = {"value": bare.result(), "notices": bare.notices}
report["expected_sum"] = float(data.sum())
del bare
gc.collect()
CACHE.clear()
report["kernel_fds"] = nbaccel_fds()
report["shm_after"] = shm()
print("REPORT " + json.dumps(report))
"""


def launch_without(tmp_path: Path, *ways: str) -> dict[str, Any]:
    """Run the kernel script where ``ways`` ("os", "ctypes", "shm") are missing."""
    site = tmp_path / "site"
    site.mkdir()
    missing = {way: way in ways for way in ("os", "ctypes", "shm")}
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(**missing))
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent(KERNEL))
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{root}", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    report: dict[str, Any] = json.loads(lines[-1].removeprefix("REPORT "))
    report["output"] = done.stdout
    return report


def ours(notices: list[str]) -> list[str]:
    words = ("memfd_create", "/dev/shm", "shared memory")
    return [text for text in notices if any(word in text for word in words)]


def check_common(report: dict[str, Any]) -> None:
    for launch in report["launches"]:
        for rank, found in launch["ranks"].items():
            assert found["sum"] == report["expected_sum"], (rank, found)
            assert found["back_ok"], (rank, found)
            assert found["shm"] == [], found  # no name in /dev/shm, even while mapped
    assert report["bare"]["value"] == "no data"  # a launch without data works too
    assert report["kernel_fds"] == []  # released: the kernel holds no segment
    assert report["shm_after"] == []


def one_segment(launch: dict[str, Any]) -> tuple[str, ...]:
    inodes = {found["inode"] for found in launch["ranks"].values()}
    assert len(inodes) == 1, launch  # every rank maps the same one
    return tuple(found["path"] for found in launch["ranks"].values())


def test_without_os_memfd_create_the_system_call_shares_the_data(tmp_path: Path) -> None:
    report = launch_without(tmp_path, "os")
    check_common(report)
    first, second = report["launches"]
    for launch in (first, second):
        assert set(one_segment(launch)) == {"/memfd:nbaccel-data (deleted)"}, launch
        assert {f["back"] for f in launch["ranks"].values()} == {"/memfd:nbaccel-result (deleted)"}
    told = ours(first["notices"])
    assert len(told) == 1 and "no os.memfd_create" in told[0], first["notices"]
    assert ours(second["notices"]) == [] and ours(report["bare"]["notices"]) == []  # once


def test_without_any_memfd_an_unnamed_dev_shm_file_shares_the_data(tmp_path: Path) -> None:
    report = launch_without(tmp_path, "os", "ctypes")
    check_common(report)
    first, second = report["launches"]
    for launch in (first, second):
        for path in one_segment(launch):
            assert path.startswith("/dev/shm/nbaccel-data-") and path.endswith(" (deleted)")
        for found in launch["ranks"].values():
            assert found["back"].startswith("/dev/shm/nbaccel-result-"), found
    told = ours(first["notices"])
    assert len(told) == 1 and "/dev/shm" in told[0], first["notices"]
    assert ours(second["notices"]) == []


def test_without_shared_memory_the_data_goes_through_the_pipe(tmp_path: Path) -> None:
    report = launch_without(tmp_path, "os", "ctypes", "shm")
    check_common(report)
    first, second = report["launches"]
    for launch in (first, second):
        for found in launch["ranks"].values():
            assert "nbaccel" not in found["path"] and "nbaccel" not in found["back"], found
    told = ours(first["notices"])
    assert len(told) == 1 and "through the pipe" in told[0], first["notices"]
    assert ours(second["notices"]) == []
    assert "SerializationError" not in report["output"]


AGENT_KERNEL = """
import sys
import numpy as np
import nbaccel

data = np.arange(1 << 20, dtype="f4")

def total(d):
    return float(d.sum())

run = nbaccel.launch(total, args=(data,), num_processes=1, dashboard="text",
                     runs_dir=sys.argv[1], max_restarts=1)
assert run.result() == float(data.sum()), run.result()
print("REPORT ok")
"""


def test_an_agent_without_shared_memory_takes_its_payload_from_a_file(tmp_path: Path) -> None:
    # A launch with restarts goes through an agent (as on other hosts), which holds the
    # payload for elastic's forked workers: in a temporary file where no memfd can be made.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(os=True, ctypes=True, shm=True))
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent(AGENT_KERNEL))
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{root}", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0 and "REPORT ok" in done.stdout, done.stdout + done.stderr[-3000:]
