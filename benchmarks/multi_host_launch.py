"""How long one cell takes to start 2 hosts x 2 CPU ranks (issue 15): nbaccel beside torchrun.

What is measured
----------------
Two "hosts" behind a real sshd (Debian's openssh-server on 127.0.0.2 and 127.0.0.3 of this
machine, started by this script with ``tests/multihost/sshd.py``, the tests' own server: a
throwaway host and user key, ``ssh -F config``). Every way starts 4 ranks, 2 per host, gloo
on CPU; every rank does one ``all_reduce``, records ``time.time()`` right after it and writes
that stamp to a file (both hosts are this machine: one clock, one file system). Per launch:

* **ready**: from the start of the call until every rank has finished its all_reduce;
* **whole**: from the start of the call until it returned (every process on both hosts gone).

Ways, each measured in this run:

* ``nbaccel 2 hosts``: ``nbaccel.launch(f, num_processes=4, hosts=[...], ssh_options="-F ..",
  remote_python=sys.executable, use_cpu=True, dashboard=False)``, then ``run.wait()`` and
  ``run.result()`` (what ``notebook_launcher`` does). Each driver (a fresh process that has
  imported torch and nbaccel, as a kernel would) makes one launch ("first": it checks each
  host over SSH, opens an SSH connection per host and each host's agent imports torch) and
  then more ("warm": the same agents and SSH connections, kept between launches as a
  kernel keeps them; no host is checked again);
* ``torchrun 2 hosts`` (the peer): the driver starts at once, on each host over ssh,
  ``python -m torch.distributed.run --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d
  --rdzv_endpoint 127.0.0.2:PORT`` with this script as the worker (``init_process_group``,
  one all_reduce, ``destroy_process_group``). ``--rdzv_conf is_host=1|0`` says which node
  hosts the store: both addresses are loopback here, so torch's own guess would pick both;
  on real machines it picks node 0 alone, as here. Every torchrun launch is a first launch;
* ``nbaccel 1 host``: ``nbaccel.launch(f, num_processes=4, use_cpu=True)`` on this machine,
  after one warm-up launch in the same driver (the helper is then running): the
  single-machine warm launch, the reference of the "<= 3x" goal;
* references: a fresh ``python -c "import torch"`` (wall time; the statement alone under
  "ready"), one SSH connection (``ssh -F config host true``), and ``ssh host python -c
  "import torch"`` (then ``os._exit``, as an agent never exits) on both hosts at once (until
  both end): what two cold agents cannot beat on this machine, where both "hosts" share its
  cores (on two real machines each imports alone, as the single ``import torch`` does).

Where an nbaccel 2-host launch spends its time: the driver times the phases from marks it
takes around nbaccel's own steps (it wraps ``api.place_on_hosts`` and
``RemoteHosts._on_message`` in the driver process; nothing in nbaccel changes), the
workers' ``started`` events and the ranks' stamps. All marks count from the call's start:

* preflight: one SSH connection per host with a one-line Python probe (versions); in a
  warm launch, planning alone (no host is probed);
* agents up: the agents' SSH connections, Python start and ``import torch`` (the agent's
  ``agent`` message, the later host); none in a warm launch;
* rendezvous: node 0 picks the port, torch elastic's static rendezvous, workers forked (the
  later rank's ``started`` event);
* process group: the payload is read and ``init_process_group`` returns (function entered);
* first all_reduce: function entered until every rank is past its all_reduce (ready);
* teardown on hosts: barrier, destroy, elastic collects the workers, the agents say
  ``done``; then the SSH channels close and the run ends (the call returns).

Reading the output
------------------
The table gives, per way, median ready and whole times in seconds, the number of launches
(``n``; failures under ``fail``, left out of the medians) and each whole time divided by
torchrun's. Then the phase breakdown (median duration of each phase and its share of the
whole call, first and warm launches apart) and the target lines of issue 15, PASS or MISS
with their numbers:

* first launch: nbaccel 2 hosts, ready median <= 1.2 x (import torch + one SSH connection),
  both measured here;
* warm relaunch on 2 machines: nbaccel 2 hosts warm-launch median <= 3 x nbaccel 1 host
  warm-launch median (ready and whole);
* peer: nbaccel 2 hosts / torchrun 2 hosts, ready and whole (<= 1: at least as fast).

The machine may be noisy (and here both hosts share its cores): compare ratios, rerun.

Usage::

    python benchmarks/multi_host_launch.py                  # 3 rounds, 3 warm launches each
    python benchmarks/multi_host_launch.py --quick          # smoke run: 1 round, 1 warm
    python benchmarks/multi_host_launch.py --json samples.json
    python benchmarks/multi_host_launch.py --remote-python /path/to/python  # on the hosts
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench_util import later_samples, launch_folders, progress, run_command, tail
from multi_host_report import (
    Sample,
    breakdown,
    format_breakdown,
    format_table,
    format_targets,
    summarize,
)

SCRIPT = str(Path(__file__).resolve())
REPO = Path(__file__).resolve().parents[1]
MARKER = "@@multi_host_launch@@ "
PER_HOST = 2
WORLD_SIZE = 2 * PER_HOST
LAUNCH_TIMEOUT_S = 120.0
PROBE_TIMEOUT_S = 120.0

# --------------------------------------------------------------------------- workers


def record_stamps(out_dir: str, rank: int, **stamps: float) -> None:
    Path(out_dir, f"rank{rank}").write_text(json.dumps(stamps))


def nbaccel_worker(out_dir: str) -> None:
    """nbaccel's workers get the process group ready-made: one all_reduce, then stamps."""
    import torch
    import torch.distributed as dist

    entered = time.time()
    dist.all_reduce(torch.ones(1))
    record_stamps(out_dir, dist.get_rank(), entered=entered, ready=time.time())


def torchrun_worker_main(out_dir: str) -> None:
    """torchrun's worker (this script, a fresh interpreter per rank): its own group."""
    started = time.time()
    import torch
    import torch.distributed as dist

    imported = time.time()
    dist.init_process_group("gloo")
    try:
        entered = time.time()
        dist.all_reduce(torch.ones(1))
        stamps = {"started": started, "imported": imported, "entered": entered}
        stamps["ready"] = time.time()
        record_stamps(out_dir, dist.get_rank(), **stamps)
    finally:
        dist.destroy_process_group()


def read_stamps(out_dir: str) -> dict[int, dict[str, float]] | str:
    """Every rank's stamps, or what is missing."""
    paths = {rank: Path(out_dir, f"rank{rank}") for rank in range(WORLD_SIZE)}
    missing = [path.name for path in paths.values() if not path.exists()]
    if missing:
        return f"no time stamp from {', '.join(missing)}"
    return {rank: json.loads(path.read_text()) for rank, path in paths.items()}


# --------------------------------------------------------------------------- nbaccel drivers


class PhaseClock:
    """Marks of one nbaccel launch, taken in the driver around nbaccel's own steps: the
    preflight's end, each agent's messages, each worker's ``started`` event."""

    def __init__(self) -> None:
        from nbaccel.launcher import api
        from nbaccel.launcher.remote import remote_hosts

        self.marks: dict[str, list[float]] = {}
        place, on_message = api.place_on_hosts, remote_hosts.RemoteHosts._on_message

        def timed_place(*args: Any, **kwargs: Any) -> Any:
            placement = place(*args, **kwargs)
            self.mark("preflight", time.time())
            return placement

        def timed_message(hosts: Any, index: int, message: dict[str, Any]) -> bool:
            if message["op"] in ("agent", "endpoint", "done"):
                self.mark(message["op"], time.time())
            return bool(on_message(hosts, index, message))

        api.place_on_hosts = timed_place  # type: ignore[assignment]
        remote_hosts.RemoteHosts._on_message = timed_message  # type: ignore[method-assign]

    def mark(self, name: str, when: float) -> None:
        self.marks.setdefault(name, []).append(when)

    def on_event(self, event: Any) -> None:
        from nbaccel.events import WorkerStarted

        if isinstance(event, WorkerStarted):
            self.mark("started", event.time)


def measure_nbaccel(settings: dict[str, Any], out_dir: str, clock: PhaseClock | None) -> Sample:
    """One launch, as notebook_launcher makes it: launch, wait, rank 0's result."""
    import nbaccel

    os.makedirs(out_dir)
    if clock is not None:
        clock.marks = {}
    started_wall, started = time.time(), time.perf_counter()
    try:
        run = nbaccel.launch(nbaccel_worker, args=(out_dir,), dashboard=False, **settings)
        if clock is not None:
            run.subscribe(clock.on_event)  # the workers start seconds after launch returns
        try:
            run.wait(LAUNCH_TIMEOUT_S)
        except TimeoutError:
            run.stop()
            raise
        run.result()
    except Exception as error:  # noqa: BLE001 - a failed launch is a result, not a crash
        return {"error": f"{type(error).__name__}: {error}", "whole": time.perf_counter() - started}
    whole = time.perf_counter() - started
    stamps = read_stamps(out_dir)
    if isinstance(stamps, str):
        return {"error": stamps, "whole": whole}
    ready = max(stamp["ready"] for stamp in stamps.values()) - started_wall
    sample: Sample = {"ready": ready, "whole": whole}
    if clock is not None:
        # The later host or rank ends each phase; both hosts' clocks are this machine's.
        marks = {name: max(times) - started_wall for name, times in clock.marks.items()}
        if "agent" not in marks and "preflight" in marks:  # agents kept: up before the call
            marks["agent"] = marks["preflight"]
        marks["entered"] = max(stamp["entered"] for stamp in stamps.values()) - started_wall
        sample["marks"] = {**marks, "call": 0.0, "ready": ready, "whole": whole}
    return sample


def run_driver(way: str, repeats: int, ssh: dict[str, Any]) -> dict[str, Any]:
    """One fresh driver: import torch and nbaccel (a kernel's state), a first launch, then
    ``repeats`` later ones (warm: the agents of the first are kept)."""
    started = time.perf_counter()
    import torch  # noqa: F401 - a notebook kernel has torch imported before it launches

    import nbaccel  # noqa: F401

    report: dict[str, Any] = {"way": way, "import_s": time.perf_counter() - started}
    with tempfile.TemporaryDirectory(prefix="multi_host_launch-") as scratch:
        settings: dict[str, Any] = {
            "num_processes": WORLD_SIZE,
            "use_cpu": True,
            "runs_dir": os.path.join(scratch, "runs"),
        }
        clock = None
        if way == "hosts":
            settings.update(
                hosts=ssh["hosts"], ssh_options=ssh["options"], remote_python=ssh["python"]
            )
            clock = PhaseClock()
        paths = launch_folders(scratch, repeats + 1)
        report["first"] = [measure_nbaccel(settings, next(paths), clock)]
        failures = sum("error" in sample for sample in report["first"])
        measure = functools.partial(measure_nbaccel, settings, clock=clock)
        report["later"] = later_samples(measure, paths, repeats, failures)
    return report


def run_way(way: str, repeats: int, ssh: dict[str, Any]) -> dict[str, Any]:
    """Run a fresh driver process for a way; its parsed JSON report."""
    command = [sys.executable, SCRIPT, "--driver", way, "--repeats", str(repeats)]
    command += ["--ssh", json.dumps(ssh)]
    timeout = 120.0 + LAUNCH_TIMEOUT_S * (repeats + 1)
    try:
        done = run_command(command, timeout)
    except subprocess.TimeoutExpired:
        return {"way": way, "failed": f"driver timed out after {timeout:.0f} s"}
    reports = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    if done.returncode != 0 or not reports:
        return {"way": way, "failed": f"driver exited with {done.returncode}:\n{tail(done.stderr)}"}
    report: dict[str, Any] = json.loads(reports[-1][len(MARKER) :])
    return report


# --------------------------------------------------------------------------- torchrun, probes


def free_port(address: str) -> int:
    """A TCP port that was free on ``address`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def ssh_argv(ssh: dict[str, Any], host: str, remote: list[str]) -> list[str]:
    return ["ssh", *shlex.split(ssh["options"]), "-T", host, "--", shlex.join(remote)]


def measure_torchrun(ssh: dict[str, Any], out_dir: str, index: int) -> Sample:
    """torchrun on each host over ssh, both started at once; whole = both ssh ended."""
    os.makedirs(out_dir)
    hosts = ssh["hosts"]
    endpoint = f"{hosts[0]}:{free_port(hosts[0])}"
    started_wall, started = time.time(), time.perf_counter()
    processes = []
    for node, host in enumerate(hosts):
        remote = [ssh["python"], "-m", "torch.distributed.run", "--nnodes", str(len(hosts))]
        remote += ["--nproc_per_node", str(PER_HOST), "--rdzv_backend", "c10d"]
        remote += ["--rdzv_endpoint", endpoint, "--rdzv_id", f"bench{os.getpid()}-{index}"]
        remote += ["--rdzv_conf", f"is_host={int(node == 0)}", "--local_addr", host]
        remote += ["--max_restarts", "0", SCRIPT, "--torchrun-worker", out_dir]
        processes.append(
            subprocess.Popen(
                ssh_argv(ssh, host, remote),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    errors = []
    for host, process in zip(hosts, processes, strict=True):
        try:
            _, stderr = process.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
        if process.returncode != 0:
            errors.append(f"torchrun on {host} exited with {process.returncode}:\n{tail(stderr)}")
    whole = time.perf_counter() - started
    if errors:
        return {"error": "\n".join(errors), "whole": whole}
    stamps = read_stamps(out_dir)
    if isinstance(stamps, str):
        return {"error": stamps, "whole": whole}
    marks = {
        name: max(stamp[name] for stamp in stamps.values()) - started_wall
        for name in ("started", "imported", "entered", "ready")
    }
    return {"ready": marks["ready"], "whole": whole, "marks": {**marks, "whole": whole}}


def probe(*commands: list[str]) -> tuple[float, str]:
    """Wall time of the commands, all started at once, until the last ends; the first's
    stdout."""
    started = time.perf_counter()
    with ThreadPoolExecutor(len(commands)) as pool:
        done = list(pool.map(lambda command: run_command(command, PROBE_TIMEOUT_S), commands))
    wall = time.perf_counter() - started
    for command, result in zip(commands, done, strict=True):
        if result.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} failed:\n{tail(result.stderr)}")
    return wall, done[0].stdout


def probe_references(ssh: dict[str, Any], agent_floor: bool) -> dict[str, float]:
    """import torch (statement and process), one ssh connection and, with ``agent_floor``,
    ssh + import torch on both hosts at once, as the two agents do on this machine's shared
    cores (left out of --quick runs, which have no time for it)."""
    code = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
    wall, out = probe([sys.executable, "-c", code])
    found = {"import_statement": float(out.split()[-1]), "import_process": wall}
    found["ssh"], _ = probe(ssh_argv(ssh, ssh["hosts"][1], ["true"]))
    if agent_floor:
        # os._exit: the agent never exits after its import, so neither does its floor
        # (an interpreter's exit after import torch takes most of a second here).
        remote = [ssh["python"], "-c", "import torch, os; os._exit(0)"]
        found["ssh_import"], _ = probe(*(ssh_argv(ssh, host, remote) for host in ssh["hosts"]))
    return found


# --------------------------------------------------------------------------- orchestrator


def collect(
    rounds: int, repeats: int, ssh: dict[str, Any], scratch: str, quick: bool = False
) -> dict[str, Any]:
    """Every raw sample of one benchmark run; the ways interleaved round by round."""
    data: dict[str, Any] = {"probes": [], "reports": {"hosts": [], "one": []}, "torchrun": []}
    for index in range(rounds):
        step = f"{index + 1}/{rounds}"
        progress(f"import torch and ssh probes {step}")
        data["probes"].append(probe_references(ssh, agent_floor=not quick))
        progress(f"nbaccel 2 hosts driver: 1 first + {repeats} warm launches {step}")
        data["reports"]["hosts"].append(run_way("hosts", repeats, ssh))
        progress(f"torchrun 2 hosts over ssh: {repeats} launches {step}")
        for launch in range(repeats):
            out_dir = os.path.join(scratch, f"torchrun{index}-{launch}")
            data["torchrun"].append(measure_torchrun(ssh, out_dir, index * repeats + launch))
        progress(f"nbaccel 1 host driver: warm-up + {repeats} launches {step}")
        data["reports"]["one"].append(run_way("one", repeats, ssh))
    return data


# --------------------------------------------------------------------------- command line


def start_sshd(folder: Path) -> Any:
    """The tests' two-address sshd (tests/multihost/sshd.py), as a context manager."""
    sys.path.insert(0, str(REPO))  # tests/ is the repo's own, not an installed package
    from tests.multihost.sshd import SSHD, serve

    if not os.access(SSHD, os.X_OK):
        raise SystemExit(f"{SSHD} not found: run .ci/install-browser (Debian's openssh-server)")
    return serve(folder)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, help="fresh drivers per way (default 3)")
    parser.add_argument("--repeats", type=int, help="warm launches per driver (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 1 warm")
    parser.add_argument("--json", metavar="PATH", help="write every raw sample here")
    parser.add_argument(
        "--remote-python",
        default=sys.executable,
        help="the interpreter the hosts run over ssh (default: this one)",
    )
    parser.add_argument("--driver", choices=("hosts", "one"), help=argparse.SUPPRESS)
    parser.add_argument("--ssh", help=argparse.SUPPRESS)
    parser.add_argument("--torchrun-worker", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.torchrun_worker:
        torchrun_worker_main(args.torchrun_worker)
        return 0
    if args.driver:
        report = run_driver(args.driver, args.repeats, json.loads(args.ssh))
        print(MARKER + json.dumps(report), flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="multi_host_launch-") as scratch:
        progress("starting sshd on 127.0.0.2 and 127.0.0.3")
        with start_sshd(Path(scratch)) as server:
            ssh = {"hosts": list(server.hosts), "options": shlex.join(server.ssh_options)}
            ssh["python"] = args.remote_python
            data = collect(args.rounds, args.repeats, ssh, scratch, args.quick)
    rows = summarize(data)
    phases = breakdown(data)
    print(
        f"Launch on 2 hosts x {PER_HOST} CPU ranks (gloo) over a real sshd on this machine:"
        " ready = call -> every rank past one all_reduce; whole = call -> returned."
        " Medians in seconds."
    )
    print("\n".join(format_table(rows)))
    print("\n".join(format_breakdown(data, phases)))
    print("\n".join(format_targets(rows)))
    if args.json:
        record = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}
        Path(args.json).write_text(json.dumps({**record, "phases": phases, **data}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
