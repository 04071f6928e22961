"""Data held in a notebook's kernel, used by 2 CPU ranks: nbaccel (shared memory) against
Accelerate's fork and ipyparallel, in real Jupyter kernels.

What is measured
----------------
A kernel holds its data as globals: a 1 GiB float32 numpy array, a 1 GiB pandas DataFrame
(8 float64 columns) and a 1 GiB in-memory Hugging Face ``datasets.Dataset`` (Arrow). A
function defined in a cell reads all of it (sums every value) on each rank. Every figure is
taken in the kernel (``time.perf_counter()`` around the call), and each rank writes its own
memory figures to a file (Accelerate's launcher returns no values).

* **launch using the data**: the whole ``notebook_launcher`` call (its workers reaped), for
  the first launch after the data was made ("first") and for later ones with the same data
  ("warm"); the function joins a gloo group, sums the data, leaves. Accelerate's runs with
  ``ACCELERATE_USE_CPU=true`` (set in the kernel before its import) and a free port; it forks
  the kernel, so its ranks share the kernel's pages copy-on-write.
* **private memory per rank**: a rank's USS after it read all the data, minus the USS of the
  same function on no data (``no data``): what the data cost that rank alone.
* **no data**: the same function without the data, warm: the cost of a launch as such.
* **push / pull** (interactive workers): ``Workers.push(data=array)`` of a fresh 256 MiB
  float64 array (new data, copied once into shared memory), the same push again (unchanged
  data: checked, not copied), and ``Workers.pull`` of a 256 MiB array from each rank (512
  MiB in all); against ``ipyparallel``'s ``DirectView.push``/``pull`` (2 engines) of the same
  sizes, and one loopback TCP connection in the same kernel (a thread receiving what the
  kernel sends, ``sendall`` of the same array): the rate of a copy through a socket here.
  Rates are the value's bytes (a push's value once; a pull's values together) per second.
* **Ray**: where ``ray`` is installed, ``ray.put`` of the array and a task on the same node
  reading it (zero-copy): the rate of making the data reachable. Not installed: skipped.

Rounds: each round starts one kernel per way (nbaccel, accelerate, ipyparallel), in an
order reversed every other round, so the machine's drift falls on all alike. Medians over
rounds; ratios of medians taken in the same run. The machine may be loaded (the load average
is printed): compare ratios, rerun. The machine's policy for huge pages in shared memory is
printed too: segments are held in huge pages under any policy but ``deny`` on Linux 6.1+
(``MADV_COLLAPSE`` under ``never``), and then a rank reads them as fast as a fork reads the
kernel's arrays; where they cannot be, through 4 KiB pages, ~0.1 s more per GiB here
(docs/data.md).

Goals (issue 31): warm launch using the data <= 1.0x Accelerate's; first launch <=
Accelerate's + one copy of the data (the time of ``numpy.copy`` of it, measured here);
private memory per rank <= 5 % of the data; push / pull >= 0.5x the loopback TCP rate and
>= 5x ipyparallel's; a launch with no data <= 0.5x Accelerate's (warm).

Usage::

    python benchmarks/data_handoff.py              # 3 rounds, 4 warm launches per kind
    python benchmarks/data_handoff.py --quick      # 1 round, 2 warm, 256 MiB data
    python benchmarks/data_handoff.py --json out.json
    python benchmarks/data_handoff.py --dashboard  # nbaccel shows its widget dashboard
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_util import median, progress, verdict
from relaunch_real_cell import Kernel

from nbaccel.launcher.sharing.segments import SHMEM_HUGE_SETTING, shmem_huge_mode

GIB = 1 << 30
LAUNCH_TIMEOUT_S = 60.0  # a launch takes 3 s at most here; past this it hung
KINDS = ("numpy", "pandas", "dataset")

SETUP = """
import json, os, socket, threading, time
import numpy as np, pandas as pd, datasets, pyarrow.compute as pc
_out = {out!r}
_size = {size}
_rows = _size // 64  # 8 float64 columns

def _make(kind):
    if kind == "numpy":
        return np.full(_size // 4, 1.0, dtype="f4")
    columns = {{f"c{{i}}": np.full(_rows, float(i), dtype="f8") for i in range(8)}}
    if kind == "pandas":
        return pd.DataFrame(columns)
    return datasets.Dataset.from_dict(columns)

# One function per kind, as a notebook has: each uses its own library only (a function that
# named pandas would make a numpy launch import pandas in every worker).
def _sum_numpy(value):
    return float(value.sum())

def _sum_pandas(value):
    return float(value.to_numpy(copy=False).sum())

def _sum_dataset(value):
    table = value.data.table
    return float(sum(pc.sum(table.column(name)).as_py() for name in table.column_names))

def _report(kind, total):
    import psutil, torch.distributed as dist
    rank = dist.get_rank()
    # Once every rank has read it all: a shared page one rank alone has touched so far
    # counts in its USS (mapped once), whatever it costs the machine.
    dist.barrier()
    with open(os.path.join(_out, f"{{kind}}-{{rank}}.json"), "w") as file:
        json.dump({{"uss": psutil.Process().memory_full_info().uss, "total": total}}, file)
    dist.barrier()

def _group():
    import torch.distributed as dist
    own = not dist.is_initialized()  # nbaccel's ranks get the group ready-made
    if own:
        dist.init_process_group("gloo")
    return own

def _leave(own):
    import torch.distributed as dist
    if own:
        dist.destroy_process_group()

def use_none():
    own = _group(); _report("none", 0.0); _leave(own)

def use_numpy():
    own = _group(); _report("numpy", _sum_numpy(data)); _leave(own)

def use_pandas():
    own = _group(); _report("pandas", _sum_pandas(data)); _leave(own)

def use_dataset():
    own = _group(); _report("dataset", _sum_dataset(data)); _leave(own)

_SUMS = {{"numpy": _sum_numpy, "pandas": _sum_pandas, "dataset": _sum_dataset}}

def _ranks(kind):
    found = []
    for rank in range(2):
        with open(os.path.join(_out, f"{{kind}}-{{rank}}.json")) as file:
            found.append(json.load(file))
    return found

def _copy_seconds():
    started = time.perf_counter()
    copy = np.copy(_make("numpy"))
    seconds = time.perf_counter() - started
    del copy
    return seconds

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def _loopback_rate(array):
    view = memoryview(array).cast("B")
    server = socket.create_server(("127.0.0.1", 0))
    got = [0]
    def sink():
        conn, _ = server.accept()
        buffer = bytearray(1 << 22)
        with conn:
            while got[0] < view.nbytes:
                n = conn.recv_into(buffer)
                if not n:
                    break
                got[0] += n
    thread = threading.Thread(target=sink)
    thread.start()
    with socket.create_connection(server.getsockname()) as client:
        started = time.perf_counter()
        client.sendall(view)
        thread.join()
        seconds = time.perf_counter() - started
    server.close()
    assert got[0] == view.nbytes
    return view.nbytes / seconds
"""

IMPORTS = {
    "nbaccel": "import nbaccel",
    "accelerate": "os.environ['ACCELERATE_USE_CPU'] = 'true'\nimport accelerate",
    "ipyparallel": "import ipyparallel",
}
LAUNCH = {
    "nbaccel": "nbaccel.notebook_launcher({fn}, num_processes=2, dashboard={dashboard}, "
    "runs_dir=os.path.join(_out, 'runs'))",
    "accelerate": "accelerate.notebook_launcher({fn}, num_processes=2, use_port=str(_free_port()))",
}


def timed_launch(
    kernel: Kernel, way: str, fn: str, dashboard: bool, hung: list[str]
) -> float | None:
    """The launch's seconds; None when it hung (``hung`` says which, the kernel goes on)."""
    call = LAUNCH[way].format(fn=fn, dashboard=dashboard)
    code = f"_t = time.perf_counter()\n{call}\n_s = time.perf_counter() - _t"
    try:
        return float(kernel.cell(code, timeout=LAUNCH_TIMEOUT_S, seconds="_s")["seconds"])
    except TimeoutError:
        hung.append(f"{way} {fn}")
        unhang(kernel)
        return None


def unhang(kernel: Kernel) -> None:
    """End a hung launch: kill what the kernel started, interrupt the cell, wait for idle.
    (Accelerate's fork of a kernel, whose threads may hold a lock at the fork, now and then
    leaves children stuck right after the fork; its parent waits for them for good.)"""
    import psutil

    for child in psutil.Process(kernel.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    kernel.manager.interrupt_kernel()
    with contextlib.suppress(RuntimeError):  # the interrupted cell's error comes first
        kernel.cell("pass", timeout=60)


def warm_memory(size: int) -> None:
    """Touch ``size`` bytes of memory and free them, so the next allocations find pages the
    host already backs. In a VM whose host backs guest memory on first touch (and takes
    freed memory back: free page reporting), writing into memory not touched for a while
    cost 2.8 s/GiB here against 0.38 s/GiB (4 KiB pages) or 0.06 s/GiB (huge pages) into
    memory just freed, whoever writes it: a first launch's shared copy, or ``numpy.copy``
    (docs/benchmarks.md). Done before each kind's data is made, in both ways' rounds."""
    import numpy as np

    block = np.ones(size // 8)
    del block


def launches(
    kernel: Kernel, way: str, warm: int, dashboard: bool, hung: list[str], size: int
) -> dict[str, Any]:
    """One kernel's launches: no data (warm-ups, then timed), then per kind first + warm.
    A launch that hung is left out (None)."""
    found: dict[str, Any] = {}

    def timed(fn: str, times: int) -> list[float | None]:
        return [timed_launch(kernel, way, fn, dashboard, hung) for _ in range(times)]

    timed("use_none", 2)  # the helper and its spares are up, the launch path is warm
    found["no data"] = [s for s in timed("use_none", warm) if s is not None]
    base = kernel.cell("", ranks="_ranks('none')")["ranks"]
    for kind in KINDS:
        warm_memory(3 * size)  # the data, its shared copy, and room to spare
        kernel.cell(f"_kind = {kind!r}\ndata = _make(_kind)\n_expect = _SUMS[_kind](data)")
        [first] = timed(f"use_{kind}", 1)
        rest = [s for s in timed(f"use_{kind}", warm) if s is not None]
        ranks = kernel.cell("", ranks="_ranks(_kind)", expect="_expect")
        assert all(r["total"] == ranks["expect"] for r in ranks["ranks"]), ranks
        private = [r["uss"] - b["uss"] for r, b in zip(ranks["ranks"], base, strict=True)]
        found[kind] = {"first": first, "warm": rest, "private": private}
        kernel.cell("del data")
    return found


PUSH_PULL = """
_n = {size} // 8
_pushes, _repushes, _pulls = [], [], []
with nbaccel.Workers(num_processes=2, dashboard=False, runs_dir=os.path.join(_out, 'runs')) as _w:
    _w.run_cell("import numpy as np", "<setup>")
    for _i in range({repeats}):
        _array = np.full(_n, float(_i + 1))
        _t = time.perf_counter(); _w.push(array=_array); _pushes.append(time.perf_counter() - _t)
        _t = time.perf_counter(); _w.push(array=_array); _repushes.append(time.perf_counter() - _t)
        _w.run_cell(f"out = np.full({{_n}}, {{_i}} + 2.0)", "<make>")
        _t = time.perf_counter(); _got = _w.pull("out"); _pulls.append(time.perf_counter() - _t)
        assert all(float(v[0]) == _i + 2.0 for v in _got.values())
        del _got, _array
_loopback = [_loopback_rate(np.full(_n, 1.0)) for _ in range({repeats})]
"""

IPYPARALLEL = """
_n = {size} // 8
_pushes, _pulls = [], []
_cluster = ipyparallel.Cluster(n=2, log_level=40)
_client = _cluster.start_and_connect_sync()
try:
    _client.wait_for_engines(2, timeout=120)
    _view = _client[:]
    _view.block = True
    _view.execute("import numpy as np")
    for _i in range({repeats}):
        _array = np.full(_n, float(_i + 1))
        _t = time.perf_counter()
        _view.push({{"array": _array}})
        _pushes.append(time.perf_counter() - _t)
        _view.execute(f"out = np.full({{_n}}, {{_i}} + 2.0)")
        _t = time.perf_counter(); _got = _view.pull("out"); _pulls.append(time.perf_counter() - _t)
        assert all(float(v[0]) == _i + 2.0 for v in _got)
        del _got, _array
finally:
    _client.close()
    _cluster.stop_cluster_sync()
"""

RAY = """
import ray
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
@ray.remote
def _read(array):
    return float(array[0])
_n = {size} // 8
_puts = []
for _i in range({repeats}):
    _array = np.full(_n, float(_i + 1))
    _t = time.perf_counter()
    _ref = ray.put(_array)
    assert ray.get(_read.remote(_ref)) == _i + 1
    _puts.append(time.perf_counter() - _t)
ray.shutdown()
"""


def push_pull(kernel: Kernel, size: int, repeats: int) -> dict[str, list[float]]:
    kernel.cell(PUSH_PULL.format(size=size, repeats=repeats), timeout=600)
    values = kernel.cell(
        "", pushes="_pushes", repushes="_repushes", pulls="_pulls", loopback="_loopback"
    )
    return {
        "push": [size / s for s in values["pushes"]],
        "push again": [size / s for s in values["repushes"]],
        "pull": [2 * size / s for s in values["pulls"]],
        "loopback TCP": values["loopback"],
    }


def ipyparallel_rates(kernel: Kernel, size: int, repeats: int) -> dict[str, list[float]]:
    kernel.cell(IPYPARALLEL.format(size=size, repeats=repeats), timeout=900)
    values = kernel.cell("", pushes="_pushes", pulls="_pulls")
    return {
        "ipyparallel push": [size / s for s in values["pushes"]],
        "ipyparallel pull": [2 * size / s for s in values["pulls"]],
    }


def ray_rates(kernel: Kernel, size: int, repeats: int) -> dict[str, list[float]]:
    try:
        kernel.cell(RAY.format(size=size, repeats=repeats), timeout=600)
    except RuntimeError as error:
        progress(f"  Ray skipped: {str(error).splitlines()[0]}")
        return {}
    return {"ray put + task": [size / s for s in kernel.cell("", puts="_puts")["puts"]]}


def one_round(way: str, options: argparse.Namespace, samples: dict[str, Any]) -> None:
    root = Path(tempfile.mkdtemp(prefix=f"data-{way}-"))
    out = root / "out"
    out.mkdir()
    kernel = Kernel(root, {"PYTHONUNBUFFERED": "1"})
    try:
        kernel.cell(SETUP.format(out=str(out), size=options.size))
        kernel.cell(IMPORTS[way], timeout=180)
        if way == "ipyparallel":
            for name, rates in ipyparallel_rates(kernel, options.move, options.moves).items():
                samples["rates"].setdefault(name, []).extend(rates)
            if options.ray:
                for name, rates in ray_rates(kernel, options.move, options.moves).items():
                    samples["rates"].setdefault(name, []).extend(rates)
            return
        time.sleep(3)  # the user writes the next cell: nbaccel's helper starts meanwhile
        found = launches(
            kernel, way, options.warm, options.dashboard, samples["hung"], options.size
        )
        samples["launch"].setdefault(way, []).append(found)
        if way == "nbaccel":
            warm_memory(3 * options.size)  # as before each first launch: the same pages
            samples["copy"].append(kernel.cell("", s="_copy_seconds()")["s"])
            for name, rates in push_pull(kernel, options.move, options.moves).items():
                samples["rates"].setdefault(name, []).extend(rates)
    finally:
        left = kernel.close()
        if left:
            progress(f"  {way}: killed what its kernel left: {left}")


def report(samples: dict[str, Any], size: int) -> list[str]:
    lines: list[str] = []
    launch = samples["launch"]
    copy = median(samples["copy"])
    lines.append(f"data per kind: {size / GIB:.2f} GiB; one copy of it (numpy.copy): {copy:.3f} s")
    lines.append("")
    lines.append("| kind | way | first launch (s) | warm launch (s) | private memory per rank |")
    lines.append("|---|---|---|---|---|")
    figures: dict[tuple[str, str], dict[str, float]] = {}
    for kind in ("no data", *KINDS):
        for way in ("nbaccel", "accelerate"):
            rounds = launch.get(way, [])
            if kind == "no data":
                warm = median([s for r in rounds for s in r[kind]])
                first, private = None, None
            else:
                first = median([r[kind]["first"] for r in rounds if r[kind]["first"] is not None])
                warm = median([s for r in rounds for s in r[kind]["warm"]])
                private = median([p for r in rounds for p in r[kind]["private"]])
            figures[(kind, way)] = {"first": first or 0.0, "warm": warm or 0.0}
            own = "-" if private is None else f"{private / 2**20:.1f} MiB ({private / size:.1%})"
            lines.append(
                f"| {kind} | {way} | {'-' if first is None else f'{first:.3f}'} | "
                f"{'-' if warm is None else f'{warm:.3f}'} | {own} |"
            )
    lines.append("")
    lines.append("| rate | median GB/s |")
    lines.append("|---|---|")
    rates = {name: median(values) for name, values in samples["rates"].items()}
    for name, rate in rates.items():
        lines.append(f"| {name} | {(rate or 0) / 1e9:.2f} |")
    lines.append("")
    lines.append("Goals:")
    for kind in KINDS:
        ours, theirs = figures[(kind, "nbaccel")], figures[(kind, "accelerate")]
        if theirs["warm"]:
            ratio = ours["warm"] / theirs["warm"]
            lines.append(
                f"- {kind}: warm launch {ratio:.2f}x Accelerate's: {verdict(ratio <= 1.0)}"
            )
            allowed = theirs["first"] + (copy or 0)
            lines.append(
                f"- {kind}: first launch {ours['first']:.3f} s <= Accelerate's + one copy "
                f"({allowed:.3f} s): {verdict(ours['first'] <= allowed)}"
            )
        privates = [p for r in launch.get("nbaccel", []) for p in r[kind]["private"]]
        worst = max(privates, default=0) / size
        lines.append(
            f"- {kind}: private memory per rank, worst {worst:.1%}: {verdict(worst <= 0.05)}"
        )
    none_ours, none_theirs = figures[("no data", "nbaccel")], figures[("no data", "accelerate")]
    if none_theirs["warm"]:
        ratio = none_ours["warm"] / none_theirs["warm"]
        lines.append(f"- no data: warm launch {ratio:.2f}x Accelerate's: {verdict(ratio <= 0.5)}")
    tcp = rates.get("loopback TCP")
    for ours, theirs in (("push", "ipyparallel push"), ("pull", "ipyparallel pull")):
        if rates.get(ours) and tcp:
            to_tcp = rates[ours] / tcp
            lines.append(f"- {ours}: {to_tcp:.2f}x loopback TCP: {verdict(to_tcp >= 0.5)}")
        if rates.get(ours) and rates.get(theirs):
            to_ipp = rates[ours] / rates[theirs]
            lines.append(f"- {ours}: {to_ipp:.1f}x ipyparallel's: {verdict(to_ipp >= 5)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", type=int, default=4, help="warm launches per kind and kernel")
    parser.add_argument("--size", type=int, default=GIB, help="bytes of each kind of data")
    parser.add_argument("--move", type=int, default=256 << 20, help="bytes of a push/pull")
    parser.add_argument("--moves", type=int, default=3, help="pushes/pulls per kernel")
    parser.add_argument("--no-ray", dest="ray", action="store_false")
    parser.add_argument("--quick", action="store_true", help="1 round, 2 warm, 256 MiB")
    parser.add_argument("--json", type=Path, help="write every sample here")
    parser.add_argument(
        "--dashboard",
        action="store_true",
        help="nbaccel's launches show the widget dashboard (a kernel without a frontend "
        "still builds it and sends its updates), not the text lines",
    )
    options = parser.parse_args()
    if options.quick:
        options.rounds, options.warm, options.size, options.moves = 1, 2, 256 << 20, 2
    progress(f"load average {os.getloadavg()}, {os.cpu_count()} cores")
    progress(f"huge pages in shared memory ({SHMEM_HUGE_SETTING}): {shmem_huge_mode()}")
    progress(f"nbaccel's display: {'widget dashboard' if options.dashboard else 'text'}")
    samples: dict[str, Any] = {
        "launch": {}, "rates": {}, "copy": [], "failures": [], "hung": []
    }  # fmt: skip
    ways = ["nbaccel", "accelerate", "ipyparallel"]
    for index in range(options.rounds):
        for way in ways if index % 2 == 0 else ways[::-1]:
            progress(f"round {index + 1}/{options.rounds}: {way}")
            try:
                one_round(way, options, samples)
            except (RuntimeError, TimeoutError) as error:  # a kernel's cell failed or hung
                samples["failures"].append(f"round {index + 1} {way}: {error!s:.300}")
                progress(f"  failed: {error!s:.300}")
    if options.json:
        options.json.write_text(json.dumps(samples, indent=1))
    print("\n".join(report(samples, options.size)))
    for failure in samples["failures"]:
        print(f"failed (left out of the medians): {failure}")
    for launch in samples["hung"]:
        print(f"hung, ended after {LAUNCH_TIMEOUT_S:g} s (left out of the medians): {launch}")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    sys.exit(main())
