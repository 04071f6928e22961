"""How long it takes to start 2 distributed CPU workers: nbaccel beside the usual ways.

What is measured
----------------
Each *way* starts 2 worker processes (gloo on CPU). Every worker does one ``all_reduce``,
records ``time.time()`` right after it and writes that stamp to a file. Per launch:

* **ready**: from the start of the call until every rank has finished its all_reduce
  (the latest rank's stamp minus the call's start time);
* **whole**: from the start of the call until the call returned (workers reaped).

Ways: ``nbaccel`` (``nbaccel.notebook_launcher``), ``fork``
(``torch.multiprocessing.start_processes(..., start_method="fork")``), ``spawn``
(``torch.multiprocessing.spawn``), ``torchrun`` (``python -m torch.distributed.run`` started
from the driver) and ``accelerate`` (``accelerate.notebook_launcher`` with
``ACCELERATE_USE_CPU=true``). The workers of fork, spawn, torchrun and accelerate call
``init_process_group("gloo")`` themselves and ``destroy_process_group()`` before leaving;
nbaccel's workers get the group ready-made.

Each way runs in its own fresh driver process (this script with ``--driver WAY``), so ways
never share state. A driver imports torch first, as a notebook kernel would have. Where a
way has a "first launch" (nbaccel starts its helper process then; fork and accelerate warm
up), the driver makes one launch first and reports it apart from the later launches.
nbaccel's first launch is measured in several fresh drivers, interleaved with fresh
interpreters that run ``import torch``: the import is the reference for the first launch
(both the import statement alone and the whole ``python -c "import torch"`` wall time).

In a Jupyter kernel ``import nbaccel`` starts the helper at once, in the background
(``nbaccel.launcher.prewarm``; off with ``NBACCEL_PREWARM=0`` and in scripts). Each round
therefore runs nbaccel's first launch in three fresh drivers (scenarios):

* **cold**: no prewarm (a script): the launch starts the helper;
* **prewarmed**: the helper started at import as in a kernel, the launch 2 s after the
  ``import nbaccel`` (``--prewarm-delay``), as a user who imports, then writes the next cell;
* **at import**: the helper started at import as in a kernel, the launch right after it;
  ready and whole are counted from the start of the ``import nbaccel`` statement.

A driver is not a kernel, so it calls ``prewarm(os.environ, in_kernel=True)`` right after
``import nbaccel`` and then imports ``nbaccel.launching``: what the import does in a kernel,
with the kernel check answered (no fake IPython, no switch in the product). Outside a kernel
``import nbaccel`` loads its names on first use, so the cold driver's launch loads the launch
path itself, as a script's does.

Reading the output
------------------
The table gives, per way, the median ready and whole times in seconds, the number of
launches (``n``; failed launches are counted under ``fail`` and left out of the medians)
and each way's median whole time divided by nbaccel's later-launch median whole time. The
``import torch`` row shows the import statement under "ready" and the whole
``python -c`` under "whole". Target lines follow, each PASS or MISS with its numbers:

* nbaccel later launches: ready median <= 0.03 s;
* nbaccel later launches: whole-call median <= 0.06 s;
* nbaccel first launch (cold): ready median <= 1.1 x the ``import torch`` statement median;
* nbaccel prewarmed first launch: at most 1.1 x a warm launch, ready and whole. Each prewarmed
  driver makes 5 more launches after its first: the ratio is its first over the median of its
  own later ones, and the target takes the median of those ratios over the drivers (same
  process, same helper: the machine's drift between drivers stays out). The ratio against
  the cold driver's later launches is printed beside it;
* nbaccel launch at import: ready median (from ``import nbaccel``) <= 1.1 x the
  ``import torch`` statement median.

``import nbaccel`` itself is timed in the drivers (with and without the prewarm call) and, each
round, in the first cell of two fresh ipykernels (jupyter_client; ``NBACCEL_PREWARM=1`` and
``0``): what the prewarm adds to the import where it really runs.

The machine may be noisy: compare ratios rather than absolute seconds, and rerun.

Usage::

    python benchmarks/launch_latency.py                 # 15 later, 5 first launches
    python benchmarks/launch_latency.py --quick         # smoke run: 3 later, 2 first
    python benchmarks/launch_latency.py --ways nbaccel,fork --json samples.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_util import (
    later_samples,
    launch_folders,
    median,
    progress,
    run_command,
    seconds,
    tail,
    verdict,
)
from first_launch import (
    PAIRED_LATER,
    PREWARM_DELAY_S,
    SCENARIOS,
    import_nbaccel,
    import_rows,
    kernel_import_rows,
    paired_ratios,
    prewarm_targets,
    probe_kernel_import,
)

SCRIPT = str(Path(__file__).resolve())
WAYS = ("nbaccel", "fork", "spawn", "torchrun", "accelerate")
WARM_UP_WAYS = frozenset({"nbaccel", "fork", "accelerate"})  # ways with a "first launch"
PACKAGES = {"nbaccel": "nbaccel", "accelerate": "accelerate"}
WORLD_SIZE = 2
MARKER = "@@launch_latency@@ "
LAUNCH_TIMEOUT_S = 60.0
IMPORT_TIMEOUT_S = 120.0

TARGET_LATER_READY_S = 0.03
TARGET_LATER_WHOLE_S = 0.06
TARGET_FIRST_OVER_IMPORT = 1.1

Sample = dict[str, Any]  # {"ready": s, "whole": s} or {"error": text, "whole": s}
Launcher = Callable[[str], None]  # starts the workers for one launch, blocks until reaped


# --------------------------------------------------------------------------- workers


def _all_reduce_and_record(out_dir: str) -> None:
    """One all_reduce on the current group, then this rank's time stamp into out_dir."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
    stamp = time.time()
    Path(out_dir, f"rank{dist.get_rank()}").write_text(repr(stamp))


def _own_group_worker(out_dir: str, rank: int = -1, world_size: int = -1) -> None:
    """A worker that sets up and tears down its own process group (MASTER_* from env)."""
    import torch.distributed as dist

    # rank and world_size -1: read RANK and WORLD_SIZE from the environment.
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _all_reduce_and_record(out_dir)
    finally:
        dist.destroy_process_group()


def mp_worker(rank: int, world_size: int, out_dir: str) -> None:
    """Worker for fork and spawn: torch.multiprocessing passes the rank first."""
    _own_group_worker(out_dir, rank, world_size)


def env_worker(out_dir: str) -> None:
    """Worker for torchrun and Accelerate: the launcher sets RANK, WORLD_SIZE, MASTER_*."""
    _own_group_worker(out_dir)


def nbaccel_worker(out_dir: str) -> None:
    """Worker for nbaccel: the process group is already initialised."""
    _all_reduce_and_record(out_dir)


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    """A TCP port that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------- launchers


def join_processes(context: Any, timeout: float) -> None:
    """Join a torch.multiprocessing ProcessContext; kill its processes past the timeout."""
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"workers still running after {timeout:.0f} s")


def torch_mp_launcher(start_method: str) -> Launcher:
    """fork: torch.multiprocessing.start_processes(start_method="fork"); spawn: mp.spawn."""
    from torch.multiprocessing.spawn import spawn, start_processes

    def launch(out_dir: str) -> None:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
        args = (WORLD_SIZE, out_dir)
        if start_method == "spawn":
            context = spawn(  # type: ignore[no-untyped-call]
                mp_worker, args=args, nprocs=WORLD_SIZE, join=False
            )
        else:
            context = start_processes(  # type: ignore[no-untyped-call]
                mp_worker, args=args, nprocs=WORLD_SIZE, join=False, start_method=start_method
            )
        join_processes(context, LAUNCH_TIMEOUT_S)

    return launch


def torchrun_launcher() -> Launcher:
    def launch(out_dir: str) -> None:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(WORLD_SIZE),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            SCRIPT,
            "--torchrun-worker",
            out_dir,
        ]
        done = run_command(command, LAUNCH_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"torchrun exited with {done.returncode}:\n{tail(done.stderr)}")

    return launch


def accelerate_launcher() -> Launcher:
    from accelerate import notebook_launcher  # type: ignore[import-untyped]

    def launch(out_dir: str) -> None:
        # A free port instead of the default 29500, which may be taken on a shared machine.
        notebook_launcher(
            env_worker, args=(out_dir,), num_processes=WORLD_SIZE, use_port=str(free_port())
        )

    return launch


def nbaccel_launcher(runs_dir: str) -> Launcher:
    import nbaccel  # imported already by run_driver, which times it

    def launch(out_dir: str) -> None:
        nbaccel.notebook_launcher(
            nbaccel_worker,
            args=(out_dir,),
            num_processes=WORLD_SIZE,
            runs_dir=runs_dir,
            log_ranks="0",
        )

    return launch


def make_launcher(way: str, scratch: str) -> Launcher:
    if way == "nbaccel":
        return nbaccel_launcher(os.path.join(scratch, "runs"))
    if way in ("fork", "spawn"):
        return torch_mp_launcher(way)
    if way == "torchrun":
        return torchrun_launcher()
    if way == "accelerate":
        return accelerate_launcher()
    raise ValueError(f"unknown way {way!r}")


# --------------------------------------------------------------------------- driver


def measure_once(
    launch: Launcher, out_dir: str, since: tuple[float, float] | None = None
) -> Sample:
    """One launch: ready = latest rank's stamp - call start; whole = call duration.

    ``since``: (time.time(), time.perf_counter()) to count both from instead of the call.
    """
    os.makedirs(out_dir)
    started_wall, started = since or (time.time(), time.perf_counter())
    try:
        launch(out_dir)
    except Exception as error:  # noqa: BLE001 - a failed launch is a result, not a crash
        return {"error": f"{type(error).__name__}: {error}", "whole": time.perf_counter() - started}
    whole = time.perf_counter() - started
    stamps = [Path(out_dir, f"rank{rank}") for rank in range(WORLD_SIZE)]
    missing = [path.name for path in stamps if not path.exists()]
    if missing:
        return {"error": f"no time stamp from {', '.join(missing)}", "whole": whole}
    latest = max(float(path.read_text()) for path in stamps)
    return {"ready": latest - started_wall, "whole": whole}


def run_driver(
    way: str, repeats: int, scenario: str = "cold", delay: float = PREWARM_DELAY_S
) -> dict[str, Any]:
    """Measure one way in this (fresh) process: warm-up launch where it applies, then more."""
    started = time.perf_counter()
    import torch  # noqa: F401 - a notebook kernel has torch imported before it launches

    result: dict[str, Any] = {"way": way, "import_torch_s": time.perf_counter() - started}
    since = None
    if way == "nbaccel":
        since, result["import_nbaccel_s"] = import_nbaccel(scenario)
        result["scenario"] = scenario
    with tempfile.TemporaryDirectory(prefix="launch_latency-") as scratch:
        try:
            launch = make_launcher(way, scratch)
        except ImportError as error:
            return {**result, "skipped": f"cannot import: {error}"}
        paths = launch_folders(scratch, repeats + 1)
        result["first"] = []
        if since is not None and scenario == "prewarmed":
            # The user's pause between the import and the launch: the scenario, not a wait.
            time.sleep(max(0.0, since[1] + delay - time.perf_counter()))
        if way in WARM_UP_WAYS:
            origin = since if scenario == "at import" else None
            result["first"].append(measure_once(launch, next(paths), origin))
        failures = sum("error" in sample for sample in result["first"])
        measure = functools.partial(measure_once, launch)
        result["later"] = later_samples(measure, paths, repeats, failures)
    return result


def torchrun_worker_main(out_dir: str) -> None:
    env_worker(out_dir)


# --------------------------------------------------------------------------- orchestrator


def driver_env(way: str) -> dict[str, str]:
    env = dict(os.environ)
    if way == "accelerate":
        env["ACCELERATE_USE_CPU"] = "true"  # else each CPU rank runs non-distributed
    return env


def run_way(
    way: str, repeats: int, scenario: str = "cold", delay: float = PREWARM_DELAY_S
) -> dict[str, Any]:
    """Run one driver process for a way and return its parsed JSON report."""
    missing = PACKAGES.get(way)
    if missing and importlib.util.find_spec(missing) is None:
        return {"way": way, "skipped": f"{missing} is not installed"}
    command = [sys.executable, SCRIPT, "--driver", way, "--repeats", str(repeats)]
    command += ["--scenario", scenario, "--prewarm-delay", str(delay)]
    timeout = 120.0 + 30.0 * (repeats + 1)
    try:
        done = run_command(command, timeout, driver_env(way))
    except subprocess.TimeoutExpired:
        return {"way": way, "failed": f"driver timed out after {timeout:.0f} s"}
    reports = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    if done.returncode != 0 or not reports:
        return {
            "way": way,
            "failed": f"driver exited with {done.returncode}:\n{tail(done.stderr)}",
        }
    report: dict[str, Any] = json.loads(reports[-1][len(MARKER) :])
    return report


def probe_import_torch() -> dict[str, float]:
    """A fresh interpreter imports torch: the statement alone and the whole process."""
    code = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
    started = time.perf_counter()
    done = run_command([sys.executable, "-c", code], IMPORT_TIMEOUT_S)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"import torch failed:\n{tail(done.stderr)}")
    return {"statement": float(done.stdout.split()[-1]), "process": wall}


def collect(
    ways: list[str], repeats: int, first_repeats: int, delay: float = PREWARM_DELAY_S
) -> dict[str, Any]:
    """Every measurement of one benchmark run (raw samples, by way)."""
    data: dict[str, Any] = {"import_torch": [], "reports": {}, "prewarm_delay_s": delay}
    rounds = max(first_repeats, 1)
    for index in range(rounds):
        progress(f"import torch probe {index + 1}/{rounds}")
        data["import_torch"].append(probe_import_torch())
        if "nbaccel" in ways:
            last = index == rounds - 1
            progress(f"import nbaccel in fresh ipykernels, prewarm on/off {index + 1}/{rounds}")
            data.setdefault("kernel_import", []).append(probe_kernel_import())
            for scenario in SCENARIOS:
                name = "nbaccel" if scenario == "cold" else f"nbaccel {scenario}"
                with_later = last and scenario == "cold"
                note = " (with later launches)" * with_later
                progress(f"{name} driver {index + 1}/{rounds}{note}")
                later = repeats if with_later else PAIRED_LATER * (scenario == "prewarmed")
                report = run_way("nbaccel", later, scenario, delay)
                data["reports"].setdefault(name, []).append(report)
    for way in ways:
        if way != "nbaccel":
            progress(f"{way} driver")
            data["reports"][way] = [run_way(way, repeats)]
    return data


def good(samples: list[Sample]) -> list[Sample]:
    return [sample for sample in samples if "error" not in sample]


def summarize(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rows of the table: name -> medians, n, failures, or why the way is missing."""
    rows: dict[str, dict[str, Any]] = {}
    probes = data["import_torch"]
    rows["import torch"] = {
        "ready": median([probe["statement"] for probe in probes]),
        "whole": median([probe["process"] for probe in probes]),
        "n": len(probes),
        "fail": 0,
    }
    for way, reports in data["reports"].items():
        broken = [r for r in reports if "skipped" in r or "failed" in r]
        if broken:
            reason = broken[0].get("skipped") or broken[0].get("failed")
            rows[way] = {"note": ("skipped: " if "skipped" in broken[0] else "failed: ") + reason}
            continue
        if way == "nbaccel":
            groups = {
                "nbaccel first": [s for r in reports for s in r["first"]],
                "nbaccel later": [s for r in reports for s in r["later"]],
            }
        elif way.startswith("nbaccel "):  # a first-launch scenario: its one launch per driver
            groups = {way: [s for r in reports for s in r["first"]]}
            paired = paired_ratios(reports)  # prewarmed: beside the same driver's later ones
        else:
            groups = {way: [s for r in reports for s in r["later"]]}
            groups[f"{way} first"] = [s for r in reports for s in r["first"]]
        for name, samples in groups.items():
            if name.endswith(" first") and way != "nbaccel" and not samples:
                continue
            kept = good(samples)
            rows[name] = {
                "ready": median([s["ready"] for s in kept]),
                "whole": median([s["whole"] for s in kept]),
                "n": len(kept),
                "fail": len(samples) - len(kept),
                "errors": sorted({s["error"] for s in samples if "error" in s}),
            }
            if way.startswith("nbaccel ") and paired is not None:
                rows[name]["paired"] = paired
    rows.update(import_rows(data["reports"]))
    rows.update(kernel_import_rows(data.get("kernel_import", [])))
    return rows


def format_table(rows: dict[str, dict[str, Any]], delay: float = PREWARM_DELAY_S) -> list[str]:
    base = rows.get("nbaccel later", {}).get("whole")
    lines = [
        f"{'way':<18}{'ready s':>9}{'whole s':>9}{'n':>4}{'fail':>5}  whole / nbaccel later",
        "-" * 70,
    ]
    for name, row in rows.items():
        if "note" in row:
            lines.append(f"{name:<18}{row['note'].splitlines()[0]}")
            continue
        ratio = "-"
        if base and row["whole"] is not None and not name.startswith("import"):
            ratio = f"{row['whole'] / base:.2f}x"
        lines.append(
            f"{name:<18}{seconds(row['ready']):>9}{seconds(row['whole']):>9}"
            f"{row['n']:>4}{row['fail']:>5}  {ratio}"
        )
    lines.append(
        "(import torch: 'ready' = the import statement, 'whole' = python -c wall time;"
        " '<way> first' = the driver's one warm-up launch; 'nbaccel prewarmed': first launch"
        f" {delay:g} s after import nbaccel + prewarm; 'nbaccel at import': first"
        " launch right after them, counted from the import; 'import nbaccel' /"
        " 'import + prewarm': the statement (and the prewarm call) in the drivers, 'kernel import'"
        " / 'kernel import+pw': the statement in a fresh ipykernel, prewarm off / on, under"
        " 'ready')"
    )
    for name, row in rows.items():
        if "\n" in row.get("note", ""):
            lines.append(f"{name} {row['note']}")
        for error in row.get("errors", []):
            lines.append(f"{name} error: {error.splitlines()[0]}")
    return lines


def format_targets(rows: dict[str, dict[str, Any]], delay: float = PREWARM_DELAY_S) -> list[str]:
    later = rows.get("nbaccel later", {})
    first = rows.get("nbaccel first", {})
    if later.get("ready") is None or first.get("ready") is None:
        return ["targets: not checked (no nbaccel measurements)"]
    lines = [
        f"target nbaccel later launch, ready: median {later['ready']:.3f} s"
        f" <= {TARGET_LATER_READY_S:.3f} s  {verdict(later['ready'] <= TARGET_LATER_READY_S)}"
    ]
    accelerate = rows.get("accelerate", {}).get("whole")
    reference = "" if accelerate is None else f"  (accelerate whole call here: {accelerate:.3f} s)"
    lines.append(
        f"target nbaccel later launch, whole call: median {later['whole']:.3f} s"
        f" <= {TARGET_LATER_WHOLE_S:.3f} s  {verdict(later['whole'] <= TARGET_LATER_WHOLE_S)}"
        + reference
    )
    torch_row = rows["import torch"]
    limit = TARGET_FIRST_OVER_IMPORT * torch_row["ready"]
    lines.append(
        f"target nbaccel first launch, ready: median {first['ready']:.3f} s"
        f" <= {TARGET_FIRST_OVER_IMPORT} x import torch {torch_row['ready']:.3f} s"
        f" = {limit:.3f} s (ratio {first['ready'] / torch_row['ready']:.2f})"
        f"  {verdict(first['ready'] <= limit)}"
    )
    lines.append(
        f"  (for reference: first launch, whole call {first['whole']:.3f} s; whole"
        f" python -c 'import torch' {torch_row['whole']:.3f} s;"
        f" ready ratio to it {first['ready'] / torch_row['whole']:.2f})"
    )
    targets = (TARGET_LATER_READY_S, TARGET_LATER_WHOLE_S, TARGET_FIRST_OVER_IMPORT)
    return lines + prewarm_targets(rows, delay, *targets)


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, help="later launches per way (default 15)")
    parser.add_argument(
        "--first-repeats", type=int, help="fresh processes for nbaccel's first launch (default 5)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 later, 2 first")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma list of {', '.join(WAYS)}")
    parser.add_argument("--json", metavar="PATH", help="write every raw sample here")
    parser.add_argument(
        "--prewarm-delay",
        type=float,
        default=PREWARM_DELAY_S,
        help=f"seconds from import nbaccel to the prewarmed launch (default {PREWARM_DELAY_S:g})",
    )
    parser.add_argument("--driver", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--scenario", choices=SCENARIOS, default="cold", help=argparse.SUPPRESS)
    parser.add_argument("--torchrun-worker", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 15
    if args.first_repeats is None:
        args.first_repeats = 2 if args.quick else 5
    ways = [way.strip() for way in args.ways.split(",") if way.strip()]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        parser.error(f"unknown way(s) {', '.join(unknown)}; choose from {', '.join(WAYS)}")
    args.ways = [way for way in WAYS if way in ways]
    if args.repeats < 1 and not args.driver:
        parser.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.torchrun_worker:
        torchrun_worker_main(args.torchrun_worker)
        return 0
    if args.driver:
        report = run_driver(args.driver, args.repeats, args.scenario, args.prewarm_delay)
        print(MARKER + json.dumps(report), flush=True)
        return 0
    data = collect(args.ways, args.repeats, args.first_repeats, args.prewarm_delay)
    rows = summarize(data)
    print(
        f"Launch latency, {WORLD_SIZE} CPU processes (gloo): ready = call -> every rank past"
        " one all_reduce; whole = call -> returned. Medians in seconds."
    )
    print("\n".join(format_table(rows, args.prewarm_delay)))
    print("\n".join(format_targets(rows, args.prewarm_delay)))
    if args.json:
        record = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}
        Path(args.json).write_text(json.dumps({**record, **data}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
