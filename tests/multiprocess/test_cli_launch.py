"""`nbaccel launch`: scripts and modules on one machine; two launchers as two machines."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

SCRIPT = """\
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")                      # torchrun-style: the script does it
t = torch.ones(1)
dist.all_reduce(t)
rank = dist.get_rank()
print(f"rank {rank} of {dist.get_world_size()} sum {t.item():g} args {sys.argv[1:]}", flush=True)
open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}"), "w").write(str(t.item()))
if "--fail" in sys.argv and rank == 1:
    sys.exit(7)
"""


def nbaccel_cli(*args: str, cwd: Path, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT_DIR": str(cwd), "HOME": str(cwd)}
    return subprocess.run(
        [sys.executable, "-m", "nbaccel.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "trainmod.py").write_text(SCRIPT)
    return tmp_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_script_runs_on_every_rank_with_labels_and_args(workdir: Path) -> None:
    result = nbaccel_cli("launch", "--num-processes", "2", "train.py", "--lr", "3", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "rank 0 of 2 sum 2 args ['--lr', '3']" in result.stdout
    assert "[rank 1] rank 1 of 2 sum 2 args ['--lr', '3']" in result.stdout


def test_module_form(workdir: Path) -> None:
    result = nbaccel_cli("launch", "--num_processes", "2", "-m", "trainmod", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert (workdir / "rank0").read_text() == (workdir / "rank1").read_text() == "2.0"


def test_exit_code_and_traceback_of_the_failing_rank(workdir: Path) -> None:
    result = nbaccel_cli("launch", "--num_processes", "2", "train.py", "--fail", cwd=workdir)
    assert result.returncode == 7
    assert "rank 1 called sys.exit(7)" in result.stdout + result.stderr
    assert 'File "train.py", line 9, in <module>' in result.stderr
    assert "runpy" not in result.stderr  # the traceback starts in the user's script


def test_env_and_files_beat_the_launch_defaults(workdir: Path) -> None:
    # The script does not initialise torch.distributed; NBACCEL_INIT_PROCESS_GROUP asks
    # nbaccel to, although `nbaccel launch` defaults to leaving it to the script.
    (workdir / "uses_group.py").write_text(
        "import torch, torch.distributed as dist\n"
        "t = torch.ones(1); dist.all_reduce(t); print('sum', t.item())\n"
    )
    env = {
        **os.environ,
        "HOME": str(workdir),
        "NBACCEL_INIT_PROCESS_GROUP": "true",
        "NBACCEL_LOG_RANKS": "0",
    }
    result = subprocess.run(
        [sys.executable, "-m", "nbaccel.cli", "launch", "--num_processes", "2", "uses_group.py"],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=workdir,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "sum 2.0" in result.stdout and "[rank 1]" not in result.stdout


def test_bad_input_is_refused_before_anything_runs(workdir: Path) -> None:
    bad = nbaccel_cli("launch", "--mixed_precision", "fp64", "train.py", cwd=workdir)
    assert bad.returncode == 2 and "'no', 'fp16', 'bf16'" in bad.stderr
    missing = nbaccel_cli("launch", "absent.py", cwd=workdir)
    assert missing.returncode == 2 and "no script at 'absent.py'" in missing.stderr
    assert not (workdir / "nbaccel_runs").exists()


def test_two_launchers_as_two_machines(workdir: Path) -> None:
    port = str(free_port())
    common = [
        "launch",
        "--num_machines",
        "2",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        port,
        "--use_cpu",
        "true",
        "--rdzv_timeout",
        "120",
    ]
    # The same job said both ways: 4 processes in all (Accelerate's meaning), or 2 per
    # machine (torchrun's flag). Each machine must start 2 for the world to be 4.
    counts = [["--num_processes", "4"], ["--nproc_per_node", "2"]]
    env = {**os.environ, "OUT_DIR": str(workdir), "HOME": str(workdir)}
    machines = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nbaccel.cli",
                *common,
                *counts[rank],
                "--machine_rank",
                str(rank),
                "train.py",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=workdir,
            env=env,
        )
        for rank in (0, 1)
    ]
    outputs = [m.communicate(timeout=200) for m in machines]
    caches = ("compile_cache", "checkpoints")  # beside the runs, not runs
    folders = [p for p in (workdir / "nbaccel_runs").iterdir() if p.name not in caches]
    runs = sorted(p.name.rsplit("-", 1)[-1] for p in folders)
    assert runs == ["m0", "m1"]  # each machine keeps its own logs
    for machine, (_out, err) in zip(machines, outputs, strict=True):
        assert machine.returncode == 0, err  # 0, not 134: no SIGABRT at worker exit
    printed = "".join(out for out, _ in outputs)
    for rank in range(4):
        assert f"[rank {rank}] rank {rank} of 4 sum 4" in printed
        assert (workdir / f"rank{rank}").read_text() == "4.0"


def test_a_machine_that_never_comes_times_out_clearly(workdir: Path) -> None:
    result = nbaccel_cli(
        "launch",
        "--num_machines",
        "2",
        "--machine_rank",
        "0",
        "--main_process_port",
        str(free_port()),
        "--num_processes",
        "2",
        "--use_cpu",
        "true",
        "--rdzv_timeout",
        "5",
        "train.py",
        cwd=workdir,
        timeout=120,
    )
    assert result.returncode == 1
    assert "did not complete within 5 s: not all 2 machines joined" in result.stderr
    assert not list(workdir.glob("rank*"))
