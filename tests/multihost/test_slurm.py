"""``hosts="slurm"`` on a real two-node Slurm cluster (issue 23, point 9): a cell in a
kernel inside an allocation starts one nbaccel agent per node through ``srun``, and torch
elastic joins them at the nodes' NodeAddr.

The cluster (conftest.py's ``slurm_cluster``, ``slurm_cluster.py``) has nodes ``n1`` at
127.0.0.2 and ``n2`` at 127.0.0.3 whose names resolve nowhere, as on a cluster whose DNS
knows only addresses. Each test runs a driver script under ``salloc -N2 -n2``, as a kernel
in an allocation would run (SLURM_JOB_NODELIST and the rest set by salloc), and reads its
last line: JSON. After each, nothing of the job may be left: no srun, no agent, no worker,
no step daemon.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil

from tests.multihost.conftest import SlurmCluster

DRIVER_TIMEOUT_S = 120.0  # a first launch took 7-13 s on a loaded 2-core machine
GONE_WITHIN_S = 30.0  # the job's processes after the driver's end (measured: < 1 s)
FAILS_WITHIN_S = 15.0  # an unresolvable node; c10d retried for minutes before (0.6 s now)

LAUNCH = """
import json, os, sys, time
import nbaccel

def where():
    import torch
    import torch.distributed as dist

    total = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(total)
    mine = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": int(total.item()),
            "node": os.environ.get("SLURMD_NODENAME"), "agent": os.getppid()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every

def launch():
    return nbaccel.notebook_launcher(
        where, num_processes=2, hosts="slurm", remote_python=sys.executable, use_cpu=True,
        runs_dir=sys.argv[1], dashboard=False)
"""


def in_allocation(cluster: SlurmCluster, tmp_path: Path, body: str) -> dict[str, Any]:
    """Run ``LAUNCH`` + ``body`` as a script under ``salloc -N2 -n2``; the JSON it printed
    last. Then wait until nothing of its job is left (asserted)."""
    script = tmp_path / "driver.py"
    script.write_text(LAUNCH + textwrap.dedent(body))
    salloc = subprocess.Popen(
        ["salloc", "--nodes=2", "--ntasks=2", sys.executable, str(script), str(tmp_path)],
        env=cluster.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = salloc.communicate(timeout=DRIVER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _end_the_job(cluster, salloc)
        out, err = salloc.communicate(timeout=30)
        logs = "".join(
            f"--- {log}:\n{log.read_text(errors='replace')[-2000:]}\n"
            for log in sorted(tmp_path.glob("*/agent-*.log"))
        )
        message = f"the driver did not end within {DRIVER_TIMEOUT_S:g} s:\n{err}\n{logs}"
        raise AssertionError(message) from None
    assert salloc.returncode == 0, f"salloc exit code {salloc.returncode}:\n{out}\n{err}"
    assert_nothing_left(cluster)
    lines = out.strip().splitlines()
    assert lines, f"the driver printed nothing:\n{err}"
    answer: dict[str, Any] = json.loads(lines[-1])
    return answer


def assert_nothing_left(cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while left := cluster.processes():
        if time.monotonic() > deadline:
            names = [f"{p.pid} {p.name()}" for p in left if p.is_running()]
            raise AssertionError(f"left {GONE_WITHIN_S:g} s after the driver: {names}")
        psutil.wait_procs(left, timeout=0.1)
    queue = cluster.run("squeue", "--noheader")
    assert not queue.strip(), f"the job is still queued or running:\n{queue}"


def _end_the_job(cluster: SlurmCluster, salloc: subprocess.Popen[str]) -> None:
    for process in [psutil.Process(salloc.pid), *psutil.Process(salloc.pid).children(True)]:
        try:
            process.kill()
        except psutil.Error:
            pass
    subprocess.run(["scancel", "--user=root"], env=cluster.env(), timeout=30, check=False)


def test_a_launch_runs_a_rank_on_each_node_and_a_relaunch_keeps_their_agents(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    answer = in_allocation(
        slurm_cluster,
        tmp_path,
        """
        times, values = [], []
        for _ in range(2):
            start = time.monotonic()
            values.append(launch())
            times.append(time.monotonic() - start)
        print(json.dumps({"values": values, "times": times,
                          "nodelist": os.environ["SLURM_JOB_NODELIST"]}))
        """,
    )
    assert answer["nodelist"] == "n[1-2]"
    first, second = answer["values"]
    # Rank 0 on the first node, rank 1 on the second (the static rendezvous keeps the order
    # of the allocation's nodes), each all-reducing with the other: 1 + 2.
    for value in (first, second):
        assert [(r["rank"], r["world"], r["node"], r["sum"]) for r in value] == [
            (0, 2, "n1", 3),
            (1, 2, "n2", 3),
        ]
    # The agents are kept between launches through srun as over ssh: the same two agent
    # processes (the workers' parent) ran both launches, one per node.
    agents = [r["agent"] for r in first]
    assert len(set(agents)) == 2
    assert [r["agent"] for r in second] == agents
    print(f"srun launch, first {answer['times'][0]:.2f} s, warm {answer['times'][1]:.2f} s")


def test_a_node_whose_address_does_not_resolve_fails_at_once_and_starts_nothing(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    # In the allocation, n2's NodeAddr becomes its name, which resolves nowhere (what a
    # cluster without NodeAddr and without DNS for its names has); put back before the job
    # ends, so that slurmctld reaches n2 again to end it.
    answer = in_allocation(
        slurm_cluster,
        tmp_path,
        """
        import subprocess
        import psutil

        def node_addr(value):
            subprocess.run(["scontrol", "update", "NodeName=n2", f"NodeAddr={value}"],
                           check=True, timeout=30)

        node_addr("n2")
        try:
            start = time.monotonic()
            try:
                launch()
                error = None
            except Exception as raised:
                error = f"{type(raised).__name__}: {raised}"
            took = time.monotonic() - start
            started = [p.name() for p in psutil.Process().children(recursive=True)]
        finally:
            node_addr("127.0.0.3")
        print(json.dumps({"error": error, "took": took, "started": started}))
        """,
    )
    error = answer["error"]
    assert error is not None and error.startswith("ConfigError: "), error
    assert "node n2: its NodeAddr n2: it does not resolve" in error  # what and why
    assert "node n1" not in error  # the node that works is not blamed
    assert "NodeAddr that resolves on every node" in error  # the fix
    assert answer["took"] < FAILS_WITHIN_S
    assert answer["started"] == []  # no srun step, hence no agent, was started


def test_a_killed_kernel_ends_its_agents_steps_while_the_allocation_goes_on(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    # The allocation's own script starts a "kernel" that launches and is SIGKILLed (a
    # kernel restart in a Jupyter job): its agents must end with their srun steps, by their
    # channel's end, while the job goes on (the job's end would end them anyway).
    answer = in_allocation(
        slurm_cluster,
        tmp_path,
        """
        import signal, subprocess

        def steps():
            listed = subprocess.run(["squeue", "--steps", "--noheader", "--format=%i"],
                                    capture_output=True, text=True, check=True, timeout=30)
            return listed.stdout.split()

        if sys.argv[2:] == ["kernel"]:
            launch()
            print("launched", flush=True)
            sys.stdin.read()  # until killed
        else:
            kernel = subprocess.Popen([sys.executable, __file__, sys.argv[1], "kernel"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            said = kernel.stdout.readline().strip()  # the test's timeout bounds this wait
            before = steps()
            kernel.send_signal(signal.SIGKILL)
            kernel.wait(30)
            start = time.monotonic()
            while (after := steps()) and time.monotonic() - start < 30:
                time.sleep(0.05)  # polls slurmctld; bounded
            print(json.dumps({"said": said, "before": before, "after": after,
                              "took": time.monotonic() - start}))
        """,
    )
    assert answer["said"] == "launched"
    assert len(answer["before"]) == 2  # the two kept agents' steps
    assert answer["after"] == [], answer
    print(f"agents' steps gone {answer['took']:.2f} s after the kernel's SIGKILL")


def test_stacks_of_ranks_on_slurm_nodes_come_through_their_agents(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    answer = in_allocation(
        slurm_cluster,
        tmp_path,
        """
        def hold(flag):
            import pathlib, time
            import torch
            import torch.distributed as dist

            if dist.get_rank() == 1:
                while not pathlib.Path(flag).exists():
                    time.sleep(0.01)
            dist.all_reduce(torch.ones(1))
            return dist.get_rank()

        flag = os.path.join(sys.argv[1], "release")
        run = nbaccel.launch(
            hold, args=(flag,), num_processes=2, hosts="slurm", remote_python=sys.executable,
            use_cpu=True, runs_dir=sys.argv[1], dashboard=False)
        deadline = time.monotonic() + 60
        while True:
            stacks = run.stacks() if not run.state.done else {}
            if "waiting in all_reduce" in stacks.get(0, "") and "in hold (" in stacks.get(1, ""):
                break
            assert time.monotonic() < deadline and not run.state.done, (stacks, run.error)
        open(flag, "w").close()
        heads = {rank: text.splitlines()[0] for rank, text in stacks.items()}
        print(json.dumps({"heads": heads, "results": run.results(timeout=60)}))
        """,
    )
    heads = answer["heads"]
    assert heads["0"].startswith("rank 0 on ") and heads["0"].endswith("waiting in all_reduce")
    assert heads["1"].startswith("rank 1 on ") and " in hold (" in heads["1"]
    assert answer["results"] == {"0": 0, "1": 1}
