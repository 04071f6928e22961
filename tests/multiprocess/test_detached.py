"""Detached runs (``detach=True``) outlive the process that launched them and are found again.

"Kernel A" is a separate Python process that launches and is then SIGKILLed; this test
process plays "kernel B" and attaches. The training function waits on a gate file (with
a bound) between its steps, so the test decides when new steps happen: no sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import nbaccel
from nbaccel.events import Metric

pytestmark = pytest.mark.timeout(180)

SUPERVISOR = "nbaccel.launcher.detached.supervisor_main"


@pytest.fixture(autouse=True)
def _no_detached_run_outlives_its_test() -> Iterator[None]:
    """A detached run outlives whoever launched it, by design; a test that fails half way
    must not leave one behind (its rank waiting for good, its helper and spares idle): every
    supervisor started during the test is ended with its whole tree afterwards."""
    before = {p.pid for p in psutil.process_iter() if _is_supervisor(p)}
    yield
    for process in psutil.process_iter():
        if process.pid in before or not _is_supervisor(process):
            continue
        try:
            tree = [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for member in tree:
            try:
                member.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=10)


def _is_supervisor(process: psutil.Process) -> bool:
    try:
        return SUPERVISOR in " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


TRAIN = """
import os, time
import nbaccel

def train(gate, steps_before, steps_after):
    for step in range(steps_before):
        nbaccel.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    deadline = time.monotonic() + 120  # bounded: the test opens the gate
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError("the test never opened the gate")
        time.sleep(0.02)
    for step in range(steps_before, steps_before + steps_after):
        nbaccel.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    return {"pid": os.getpid(), "steps": steps_before + steps_after}
"""


def start_kernel_a(tmp_path: Path, gate: Path, runs: str, **options: object) -> subprocess.Popen:
    """A launching process that prints its run's id once rank 0 logged step 2, then waits."""
    code = TRAIN + textwrap.dedent(
        f"""
        import signal, sys, threading
        # A shell's background job starts with SIGINT ignored (Python keeps that): the
        # handler a terminal or a Jupyter kernel has, whatever started the tests.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        seen = threading.Event()
        run = nbaccel.launch(train, args=({str(gate)!r}, 3, 3), num_processes=2,
                             detach=True, runs_dir={runs!r}, dashboard=False, **{options!r})
        run.subscribe(lambda e: seen.set() if getattr(e, "step", None) == 2 else None)
        if any(m["step"] == 2 for m in run.metrics):
            seen.set()
        assert seen.wait(120), "rank 0 never logged step 2"
        print("RUN", run.run_id, run.supervisor_pid, flush=True)
        sys.stdin.read()  # kernel A idles until it is killed
        """
    )
    (tmp_path / "kernel_a.py").write_text(code)
    return subprocess.Popen(
        [sys.executable, str(tmp_path / "kernel_a.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )


def read_run_line(kernel_a: subprocess.Popen) -> tuple[str, int]:
    assert kernel_a.stdout is not None
    line = kernel_a.stdout.readline()  # bounded by the test's timeout
    while line.startswith("nbaccel: "):  # what the launch said while it started
        line = kernel_a.stdout.readline()
    assert line.startswith("RUN "), line
    _, run_id, pid = line.split()
    return run_id, int(pid)


def family(pid: int) -> list[psutil.Process]:
    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


def test_a_detached_run_survives_its_kernel_and_reattaches(tmp_path: Path) -> None:
    gate, runs = tmp_path / "gate", str(tmp_path / "runs")
    kernel_a = start_kernel_a(tmp_path, gate, runs)
    run_id, supervisor_pid = read_run_line(kernel_a)
    kernel_a.kill()  # SIGKILL: no goodbye, as when a kernel dies
    kernel_a.wait(timeout=30)
    processes = family(supervisor_pid)
    assert len(processes) >= 4  # supervisor, its helper, two workers
    assert all(p.is_running() for p in processes)

    run = nbaccel.attach(run_id, runs_dir=runs, dashboard=False)
    live: list[int] = []
    run.subscribe(lambda e: live.append(e.step) if isinstance(e, Metric) else None)
    assert run.state is nbaccel.RunState.RUNNING
    gate.touch()  # only now do steps 3-5 happen: they can only reach us live
    result = run.result(timeout=120)
    assert result["steps"] == 6
    assert [m["step"] for m in run.metrics] == [0, 1, 2, 3, 4, 5]
    assert {3, 4, 5} <= set(live)
    assert set(run.results()) == {0, 1} and run.exit_code == 0
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert not alive, f"left running: {alive}"

    # After the end, from yet another "kernel": everything read back from the run folder.
    again = nbaccel.attach("latest", runs_dir=runs, dashboard=False)
    assert again.result(10) == result and again.state is nbaccel.RunState.SUCCEEDED
    assert [m["step"] for m in again.metrics] == [0, 1, 2, 3, 4, 5]
    listed = nbaccel.runs(runs)
    assert [(r.run_id, r.state, r.world_size) for r in listed] == [(run_id, "succeeded", 2)]
    assert listed[0].last_metrics == {"loss": pytest.approx(1 / 6), "step": 5}


def test_stop_from_another_kernel_ends_every_process(tmp_path: Path) -> None:
    gate, runs = tmp_path / "gate", str(tmp_path / "runs")  # the gate never opens
    kernel_a = start_kernel_a(tmp_path, gate, runs)
    run_id, supervisor_pid = read_run_line(kernel_a)
    processes = family(supervisor_pid)
    run = nbaccel.attach(run_id, runs_dir=runs, dashboard=False)
    assert run.stop(timeout=60) is nbaccel.RunState.CANCELLED
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert not alive, f"left running: {alive}"
    with pytest.raises(nbaccel.RunCancelled):
        run.result()
    assert nbaccel.runs(runs)[0].state == "cancelled"
    kernel_a.kill()
    kernel_a.wait(timeout=30)


def test_max_duration_stops_a_detached_run(tmp_path: Path) -> None:
    namespace: dict[str, object] = {}
    exec(compile(TRAIN, "<train>", "exec"), namespace)  # the gate never opens
    runs = str(tmp_path / "runs")
    run = nbaccel.launch(
        namespace["train"],  # type: ignore[arg-type]
        args=(str(tmp_path / "gate"), 3, 3),
        num_processes=2,
        detach=True,
        max_duration=2.0,
        runs_dir=runs,
        dashboard=False,
    )
    processes = family(run.supervisor_pid)  # type: ignore[attr-defined]
    assert run.wait(60) is nbaccel.RunState.CANCELLED and run.exit_code == 130
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert not alive, f"left running: {alive}"
    log = (Path(runs) / run.run_id / "supervisor.log").read_text()
    assert "max_duration=2 s passed" in log


def test_a_failure_is_raised_in_the_kernel_that_attaches(tmp_path: Path) -> None:
    def fails() -> None:
        raise KeyError("missing column")

    runs = str(tmp_path / "runs")
    run = nbaccel.launch(fails, num_processes=2, detach=True, runs_dir=runs, dashboard=False)
    supervisor = psutil.Process(run.supervisor_pid)  # type: ignore[attr-defined]
    with pytest.raises(KeyError, match="missing column"):
        run.result(60)
    _, alive = psutil.wait_procs([supervisor], timeout=30)  # it leaves once its run ended
    assert not alive
    again = nbaccel.attach(run.run_id, runs_dir=runs, dashboard=False)
    with pytest.raises(KeyError, match="missing column"):
        again.result(10)
    assert again.exit_code not in (0, None)


def test_an_error_at_the_supervisors_start_is_raised_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    runs = tmp_path / "runs"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(nbaccel.ConfigError, match=f"main_process_port={port} "):
            nbaccel.launch(
                sum,
                args=([1],),
                num_processes=1,
                detach=True,
                main_process_port=port,
                runs_dir=str(runs),
                dashboard=False,
            )
    assert not runs.exists() or not any(runs.iterdir())
    mine = psutil.Process().children(recursive=True)
    assert not [p for p in mine if "supervisor_main" in " ".join(p.cmdline())]


def test_the_attach_channel_is_private(tmp_path: Path) -> None:
    gate, runs = tmp_path / "gate", str(tmp_path / "runs")
    kernel_a = start_kernel_a(tmp_path, gate, runs)
    run_id, _ = read_run_line(kernel_a)
    run_dir = Path(runs) / run_id
    assert run_dir.stat().st_mode & 0o777 == 0o700
    assert (run_dir / "supervisor.json").stat().st_mode & 0o777 == 0o600
    assert _listening_on_tcp(run_dir) == []  # the attach channel is a Unix socket
    gate.touch()
    nbaccel.attach(run_id, runs_dir=runs, dashboard=False).wait(60)
    kernel_a.kill()
    kernel_a.wait(timeout=30)


def _listening_on_tcp(run_dir: Path) -> list[object]:
    pid = json.loads((run_dir / "supervisor.json").read_text())["pid"]
    return [c for c in psutil.Process(pid).net_connections("inet") if c.status == "LISTEN"]


def test_interrupting_the_launching_process_leaves_a_detached_run_going(tmp_path: Path) -> None:
    gate, runs = tmp_path / "gate", str(tmp_path / "runs")
    kernel_a = start_kernel_a(tmp_path, gate, runs)
    run_id, supervisor_pid = read_run_line(kernel_a)
    kernel_a.send_signal(signal.SIGINT)  # what the kernel's interrupt sends
    kernel_a.wait(timeout=30)
    assert psutil.Process(supervisor_pid).is_running()
    gate.touch()
    assert nbaccel.attach(run_id, runs_dir=runs, dashboard=False).result(60)["steps"] == 6


def test_the_command_line_launches_detached_lists_and_follows(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    (tmp_path / "train.py").write_text(
        TRAIN + f"train({str(gate)!r}, 2, 2)\nprint('finished', flush=True)\n"
    )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "nbaccel.cli", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={**os.environ, "HOME": str(tmp_path)},
        )

    launched = cli("launch", "--detach", "--num_processes", "2", "train.py")
    assert launched.returncode == 0, launched.stderr  # returned while the run waits at the gate
    run_id = launched.stdout.split("detached run ")[1].split()[0]
    assert run_id in cli("runs").stdout
    gate.touch()
    followed = cli("attach", run_id)
    assert followed.returncode == 0, followed.stderr
    assert "finished" in followed.stdout
    listed = cli("runs", "--prune", "0")
    assert f"pruned 1 run folder(s): {run_id}" in listed.stdout
    assert not (tmp_path / "nbaccel_runs" / run_id).exists()


def test_stacks_of_a_detached_run_from_another_kernel(tmp_path: Path) -> None:
    gate, runs = tmp_path / "gate", str(tmp_path / "runs")
    kernel_a = start_kernel_a(tmp_path, gate, runs)
    run_id, _ = read_run_line(kernel_a)
    kernel_a.kill()
    kernel_a.wait(timeout=30)
    run = nbaccel.attach(run_id, runs_dir=runs, dashboard=False)
    stacks = run.stacks()  # asked of the supervisor, over the attach channel
    assert sorted(stacks) == [0, 1]
    for rank, text in stacks.items():
        assert text.startswith(f"rank {rank}: in train ("), text  # both wait at the gate
    assert run.state is nbaccel.RunState.RUNNING  # nothing was stopped
    gate.touch()
    assert run.result(timeout=120)["steps"] == 6
    with pytest.raises(RuntimeError, match="has ended"):
        run.stacks()


def stops_at_a_breakpoint() -> int:
    breakpoint()
    return 7


def test_a_breakpoint_in_a_detached_run_is_skipped_and_said(tmp_path: Path) -> None:
    run = nbaccel.launch(
        stops_at_a_breakpoint, num_processes=1, detach=True, runs_dir=str(tmp_path / "runs"),
        dashboard=False,
    )  # fmt: skip
    assert run.result(timeout=120) == 7  # nobody can type into a detached run: it goes on
    assert "skipped: a detached run has no cell to type into" in run.logs(0)
