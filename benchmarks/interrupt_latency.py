"""How fast a kernel interrupt stops 2 training workers and their DataLoader workers.

What is measured
----------------
A fresh *driver* process (this script with ``--driver WAY``; torch imported first, as in a
kernel) launches 2 CPU workers (gloo). Each starts a DataLoader with ``num_workers=1,
persistent_workers=True``, writes its pid and its children's pids to a file, then loops on
``all_reduce`` + the next batch. This script sends SIGINT to the driver only (as Jupyter's
interrupt does) and polls with psutil every 10 ms until all those pids are gone. Per sample:

* **stop**: SIGINT -> every worker and grandchild gone (a *timeout* past ``--timeout`` s);
* **back** / **driver got**: SIGINT -> the launch call raised, and what it raised;
* **next**: did the driver's next launch (one all_reduce, returns 42) work, how long it took;
* **end** / **left**: the driver's last report -> every process of the sample gone (the
  driver just returns from its script), and how many were still alive 10 s later. The
  driver's process group, then all this script (a child subreaper) inherited, is then
  killed: no sample leaks into the next.

Ways: ``nbaccel-cold`` (``nbaccel.notebook_launcher``, the driver's first launch: it starts
the helper), ``nbaccel-warm`` (one quick launch first), ``accelerate``
(``accelerate.notebook_launcher``, ``ACCELERATE_USE_CPU=true``: forks through torch elastic)
and ``spawn`` (``torch.multiprocessing.spawn``, the plain-torch reference); their workers
call ``init_process_group("gloo")`` themselves. Samples are interleaved across ways. Ratio:
median stop / nbaccel-cold's (also a fresh driver's first launch). Goal: nbaccel's median
stop <= 3 s, cold and warm, no timeout (the tests assert 15 s). Expect noise.

Usage::

    .venv/bin/python benchmarks/interrupt_latency.py              # 7 nbaccel, 3 peer samples
    .venv/bin/python benchmarks/interrupt_latency.py --ways nbaccel-cold,spawn --timeout 30
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
from bench_util import (
    become_subreaper,
    median,
    progress,
    seconds,
    start_driver,
    sweep_descendants,
    tail,
    verdict,
    wait_until,
)

SCRIPT = str(Path(__file__).resolve())
WAYS = ("nbaccel-cold", "nbaccel-warm", "accelerate", "spawn")
PEERS = frozenset({"accelerate", "spawn"})
BASE = "nbaccel-cold"
WORLD_SIZE = 2
MARKER = "@@interrupt_latency@@ "
GOAL_S = 3.0
POLL_S = 0.01
START_TIMEOUT_S = 120.0  # driver start -> every rank wrote its pids
SPIN_S = 0.5  # let the loop run before the interrupt
NEXT_TIMEOUT_S = 60.0  # the driver's next launch, on top of --timeout
EXIT_GRACE_S = 10.0  # after the driver's last report, before its process group is killed

# --------------------------------------------------------------------------- workers


def worker(pids_prefix: str, spinning: bool) -> int:
    """Spinning: DataLoader worker up, pids to a file, all_reduce forever. Else one all_reduce."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    own_group = not dist.is_initialized()
    if own_group:  # accelerate: RANK, WORLD_SIZE, MASTER_* come from the environment
        dist.init_process_group("gloo")
    if not spinning:
        dist.all_reduce(torch.ones(1))
        if own_group:
            dist.destroy_process_group()
        return 42
    loader = DataLoader(
        TensorDataset(torch.arange(10_000)), batch_size=1, num_workers=1, persistent_workers=True
    )
    batches = iter(loader)
    next(batches)  # the DataLoader worker is up
    rank = dist.get_rank()
    kids = [p.pid for p in psutil.Process().children(recursive=True)]
    Path(f"{pids_prefix}.{rank}.tmp").write_text(" ".join(map(str, [os.getpid(), *kids])))
    os.rename(f"{pids_prefix}.{rank}.tmp", f"{pids_prefix}.{rank}")
    while True:
        dist.all_reduce(torch.ones(1))
        try:
            next(batches)
        except StopIteration:
            batches = iter(loader)


def spawn_worker(rank: int, world_size: int, pids_prefix: str, spinning: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # MASTER_* from env
    worker(pids_prefix, spinning)


# --------------------------------------------------------------------------- driver


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(way: str, spinning: bool, pids_prefix: str, runs_dir: str) -> Any:
    """One blocking launch of ``worker`` on 2 processes; rank 0's value where the way has one."""
    args = (pids_prefix, spinning)
    if way.startswith("nbaccel"):
        import nbaccel

        return nbaccel.notebook_launcher(
            worker, args=args, num_processes=WORLD_SIZE, runs_dir=runs_dir, log_ranks="0"
        )
    if way == "accelerate":
        from accelerate import notebook_launcher  # type: ignore[import-untyped]

        notebook_launcher(worker, args=args, num_processes=WORLD_SIZE, use_port=str(free_port()))
        return 42  # accelerate returns None
    from torch.multiprocessing.spawn import spawn

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    context = spawn(  # type: ignore[no-untyped-call]
        spawn_worker, args=(WORLD_SIZE, *args), nprocs=WORLD_SIZE, join=False
    )
    deadline = time.monotonic() + (math.inf if spinning else NEXT_TIMEOUT_S)
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            raise TimeoutError("spawn: workers still running")
    return 42


def emit(report: dict[str, Any]) -> None:
    print(MARKER + json.dumps(report), flush=True)


def run_driver(way: str, pids_prefix: str) -> None:
    """Spin until interrupted, report what the launch raised, then launch once more."""
    import torch  # noqa: F401 - a notebook kernel has torch imported before it launches

    runs_dir = os.path.join(os.getcwd(), "runs")  # cwd: the sample's scratch directory
    if way == "nbaccel-warm":
        launch(way, False, pids_prefix, runs_dir)
    try:
        launch(way, True, pids_prefix, runs_dir)
        caught = "(returned)"
    except BaseException as error:  # noqa: BLE001 - what the interrupt raises is the result
        caught = type(error).__name__
    emit({"caught": caught, "caught_at": time.time()})
    started = time.perf_counter()
    try:
        value = launch(way, False, pids_prefix, runs_dir)
        emit({"next_ok": value == 42, "next_s": time.perf_counter() - started})
    except Exception as error:  # noqa: BLE001 - a failed launch is a result
        emit({"next_ok": False, "next_error": f"{type(error).__name__}: {error}"[:200]})


# --------------------------------------------------------------------------- process care


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def descendants_alive(grace: float) -> list[int]:
    """Pids under this process still running after ``grace`` s (zombies reaped)."""
    _, running = psutil.wait_procs(psutil.Process().children(recursive=True), timeout=grace)
    return [p.pid for p in running if alive(p.pid)]


def describe(pid: int) -> str:
    with contextlib.suppress(psutil.Error):
        return f"{pid} {' '.join(psutil.Process(pid).cmdline())[:100]}"
    return f"{pid} (gone)"


def reports(log_path: Path) -> dict[str, Any]:
    """Every marker line the driver wrote so far, merged."""
    merged: dict[str, Any] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        if MARKER in line:
            with contextlib.suppress(json.JSONDecodeError):
                merged.update(json.loads(line[line.index(MARKER) + len(MARKER) :]))
    return merged


# --------------------------------------------------------------------------- orchestrator


def measure(way: str, timeout: float) -> dict[str, Any]:
    """One fresh driver: spin, SIGINT, time until every worker and grandchild is gone."""
    with tempfile.TemporaryDirectory(prefix="interrupt_latency-") as scratch:
        prefix, log_path = os.path.join(scratch, "pids"), Path(scratch, "driver.log")
        env = {**os.environ, "ACCELERATE_USE_CPU": "true"} if way == "accelerate" else None
        driver = start_driver(
            [sys.executable, SCRIPT, "--driver", way, "--pids", prefix], log_path, env, scratch
        )
        try:
            files = [Path(f"{prefix}.{rank}") for rank in range(WORLD_SIZE)]
            ready = wait_until(
                lambda: all(f.exists() for f in files) or driver.poll() is not None,
                START_TIMEOUT_S,
            )
            if not ready or driver.poll() is not None:
                why = "exited" if ready else f"wrote no pids in {START_TIMEOUT_S:.0f} s"
                return {"error": f"driver {why}:\n{tail(log_path.read_text(errors='replace'))}"}
            pids = [int(pid) for f in files for pid in f.read_text().split()]
            time.sleep(SPIN_S)
            interrupted = time.time()
            driver.send_signal(signal.SIGINT)
            stopped = wait_until(lambda: not any(alive(pid) for pid in pids), timeout)
            stop = time.time() - interrupted if stopped else None
            left_s = timeout + NEXT_TIMEOUT_S - (time.time() - interrupted)
            wait_until(lambda: "next_ok" in reports(log_path) or driver.poll() is not None, left_s)
            reported = time.monotonic()
            ended = wait_until(lambda: not descendants_alive(0.0), EXIT_GRACE_S)
            end = time.monotonic() - reported if ended else None
            report = reports(log_path)
            back = report["caught_at"] - interrupted if "caught_at" in report else None
            return {
                "processes": len(pids),
                "stop": stop,
                "driver_back": back,
                "caught": report.get("caught", "(no report)"),
                "next_ok": bool(report.get("next_ok")),
                "next_s": report.get("next_s"),
                "next_error": report.get("next_error"),
                "end": end,
                "left": [describe(pid) for pid in descendants_alive(0.0)],
            }
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(driver.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                driver.wait(10)
            sweep_descendants(grace=0.0)


def collect(ways: list[str], repeats: int, peer_repeats: int, timeout: float) -> dict[str, Any]:
    samples: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
    for index in range(max(repeats, peer_repeats)):
        for way in ways:
            if index < (peer_repeats if way in PEERS else repeats):
                progress(f"{way} {index + 1}")
                sample = measure(way, timeout)
                progress(f"  {json.dumps(sample)[:300]}")
                samples[way].append(sample)
    return samples


def summarize(samples: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for way, group in samples.items():
        kept = [s for s in group if "error" not in s]
        stops = [s["stop"] for s in kept if s["stop"] is not None]
        nexts = [s["next_s"] for s in kept if s["next_ok"]]
        rows[way] = {
            "n": len(kept),
            "fail": len(group) - len(kept),
            # A timeout counts as infinitely slow, so it moves the median honestly.
            "stop": median([math.inf if s["stop"] is None else s["stop"] for s in kept]),
            "min": min(stops, default=None),
            "max": max(stops, default=None),
            "timeouts": len(kept) - len(stops),
            "back": median([s["driver_back"] for s in kept if s["driver_back"] is not None]),
            "caught": dict(Counter(s["caught"] for s in kept)),
            "next_ok": len(nexts),
            "next": median(nexts),
            "end": median([math.inf if s["end"] is None else s["end"] for s in kept]),
            "left": sum(len(s["left"]) for s in kept),
            "errors": sorted({s["error"].splitlines()[0] for s in group if "error" in s})
            + sorted({s["next_error"] for s in kept if s.get("next_error")}),
        }
    return rows


def capped(value: float | None, timeout: float) -> str:
    return f">{timeout:.0f}" if value is not None and math.isinf(value) else seconds(value)


def format_table(rows: dict[str, dict[str, Any]], timeout: float) -> list[str]:
    base = rows.get(BASE, {}).get("stop")
    lines = [
        f"{'way':<14}{'n':>3}{'fail':>5}{'stop s':>8}{'min s':>8}{'max s':>8}{'t/o':>5}"
        f"{'back s':>8}  {'driver got':<26}{'next ok':>8}{'next s':>8}{'end s':>7}{'left':>5}"
        f"  stop / {BASE}",
        "-" * 135,
    ]
    for way, row in rows.items():
        ratio = "-"
        if way != BASE and base and row["stop"] is not None and math.isfinite(base):
            ratio = f">{timeout / base:.0f}x" if math.isinf(row["stop"]) else ""
            ratio = ratio or f"{row['stop'] / base:.1f}x"
        got = ", ".join(f"{name} x{count}" for name, count in row["caught"].items()) or "-"
        lines.append(
            f"{way:<14}{row['n']:>3}{row['fail']:>5}{capped(row['stop'], timeout):>8}"
            f"{seconds(row['min']):>8}{seconds(row['max']):>8}{row['timeouts']:>5}"
            f"{seconds(row['back']):>8}  {got:<26}{row['next_ok']:>4}/{row['n']:<3}"
            f"{seconds(row['next']):>8}{capped(row['end'], EXIT_GRACE_S):>7}"
            f"{row['left']:>5}  {ratio}"
        )
    lines.append(
        f"(stop = SIGINT -> every worker and DataLoader worker gone, timeout {timeout:.0f} s;"
        " back = SIGINT -> the launch call raised; end = the driver's last report -> all its"
        f" processes gone; left = still alive {EXIT_GRACE_S:.0f} s after it, all samples)"
    )
    for way, row in rows.items():
        lines.extend(f"{way} error: {error}" for error in row["errors"])
    return lines


def format_goal(rows: dict[str, dict[str, Any]]) -> str:
    ours = {way: row for way, row in rows.items() if way.startswith("nbaccel") and row["n"]}
    if not ours:
        return "goal nbaccel interrupt <= 3 s: not checked (no nbaccel samples)"
    ok = all(row["stop"] <= GOAL_S and row["timeouts"] == 0 for row in ours.values())
    parts = [
        f"{way} median {capped(row['stop'], math.inf)} s (max {seconds(row['max'])},"
        f" timeouts {row['timeouts']})"
        for way, row in ours.items()
    ]
    return f"goal nbaccel interrupt <= {GOAL_S:.0f} s: {'; '.join(parts)}  {verdict(ok)}"


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="samples per nbaccel way (7)")
    parser.add_argument(
        "--peer-repeats", type=int, default=3, help="samples for accelerate and spawn (3)"
    )
    parser.add_argument("--timeout", type=float, default=90.0, help="stop timeout, s (90)")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma list of {', '.join(WAYS)}")
    parser.add_argument("--driver", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--pids", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    ways = [way.strip() for way in args.ways.split(",") if way.strip()]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        parser.error(f"unknown way(s) {', '.join(unknown)}; choose from {', '.join(WAYS)}")
    args.ways = [way for way in WAYS if way in ways]
    if min(args.repeats, args.peer_repeats) < 0 or args.timeout <= 0:
        parser.error("--repeats and --peer-repeats must be >= 0, --timeout > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.driver:
        run_driver(args.driver, args.pids)
        return 0
    become_subreaper()
    started = time.monotonic()
    samples = collect(args.ways, args.repeats, args.peer_repeats, args.timeout)
    rows = summarize(samples)
    print(
        f"Interrupt latency, {WORLD_SIZE} CPU workers (gloo), each with a persistent DataLoader"
        f" worker; SIGINT to the driver. Medians in seconds ({time.monotonic() - started:.0f} s)."
    )
    print("\n".join(format_table(rows, args.timeout)))
    print(format_goal(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
