"""The debugger through the agents: ``run.stacks()`` of a two-host run over the test sshd
names the function and the collective each rank is in, and a ``breakpoint()`` on a rank of
the second host opens pdb in the kernel's thread that waits for the run."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import nbaccel
from nbaccel.launcher.debug.console import DebugConsole
from tests.multihost.conftest import SshHosts

pytestmark = pytest.mark.timeout(300)
RUN_TIMEOUT_S = 180.0


def on_hosts(ssh_hosts: SshHosts, runs_dir: Path) -> dict[str, Any]:
    return {
        "hosts": list(ssh_hosts.hosts),
        "ssh_options": shlex.join(ssh_hosts.ssh_options),
        "remote_python": sys.executable,
        "runs_dir": str(runs_dir),
        "use_cpu": True,
    }


def rank_3_holds_the_rest(flag_file: str) -> int:
    import pathlib
    import time

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 3:
        while not pathlib.Path(flag_file).exists():
            time.sleep(0.01)
    dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def test_stacks_of_a_two_host_run_name_where_each_rank_is(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    flag = tmp_path / "release"
    settings = on_hosts(ssh_hosts, tmp_path / "runs")
    run = nbaccel.launch(
        rank_3_holds_the_rest, args=(str(flag),), num_processes=4, dashboard=False, **settings
    )
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            stacks = run.stacks() if run.state is nbaccel.RunState.RUNNING else {}
            waiting = [r for r in (0, 1, 2) if "waiting in all_reduce" in stacks.get(r, "")]
            if len(waiting) == 3 and "in rank_3_holds_the_rest (" in stacks.get(3, ""):
                break
            assert run.state is nbaccel.RunState.RUNNING, run.error
            assert time.monotonic() < deadline, stacks
        second = ssh_hosts.hosts[1]
        assert stacks[3].startswith(f"rank 3 on {second}: in rank_3_holds_the_rest (")
        assert ", in rank_3_holds_the_rest\n" in stacks[3]  # its frame, in its stack
        assert stacks[0].startswith(f"rank 0 on {ssh_hosts.hosts[0]}: ")
    finally:
        flag.touch()
    assert run.results(timeout=RUN_TIMEOUT_S) == {0: 0, 1: 1, 2: 2, 3: 3}


def stop_on_rank_2(n: int) -> float:
    import torch
    import torch.distributed as dist

    x = float(n)
    if dist.get_rank() == 2:
        breakpoint()
        x = x * 10
    total = torch.tensor([x])
    dist.all_reduce(total)
    return float(total.item())


def test_a_breakpoint_on_another_host_is_typed_into_here(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    settings = on_hosts(ssh_hosts, tmp_path / "runs")
    run = nbaccel.launch(stop_on_rank_2, args=(1,), num_processes=4, dashboard=False, **settings)
    lines, shown = ["p x", "n", "p x", "c"], []

    def prompt(text: str) -> str:
        line = lines.pop(0)
        shown.append(f"{text}{line}\n")
        return line

    run._console = DebugConsole(
        run._debug, prompt=prompt, write=shown.append, can_type=lambda: None
    )  # type: ignore[arg-type]
    assert run.result(timeout=RUN_TIMEOUT_S) == 13.0
    text = "".join(shown)
    assert "--- pdb on rank 2 (" in text
    assert "(Pdb) p x\n1.0\n" in text and "(Pdb) p x\n10.0\n" in text


def test_workers_on_two_hosts_post_mortem_and_stacks(
    ssh_hosts: SshHosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nbaccel.launcher.interactive.workers as workers_module

    monkeypatch.setattr(workers_module, "nobody_to_type", lambda: None)  # a scripted typist
    settings = on_hosts(ssh_hosts, tmp_path / "runs")
    with nbaccel.Workers(num_processes=4, dashboard="text", **settings) as workers:
        cell = "import torch.distributed as dist\nrank = dist.get_rank()\nif rank == 3:\n"
        cell += "    kept = rank * 11\n    raise ValueError('bad')\n"
        with pytest.raises(ValueError, match="bad"):
            workers.run_cell(cell, "<c1>")
        lines, shown = ["p kept", "c"], []

        def prompt(text: str) -> str:
            line = lines.pop(0)
            shown.append(f"{text}{line}\n")
            return line

        run = workers._run
        assert run is not None
        console = DebugConsole(run._debug, prompt=prompt, write=shown.append, can_type=lambda: None)  # type: ignore[arg-type]
        run._console = console
        workers.debug()  # rank 3, on the second host, through its agent
        assert "(Pdb) p kept\n33\n" in "".join(shown)
        stacks = workers.stacks()
        assert sorted(stacks) == [0, 1, 2, 3]
        assert stacks[3].startswith(f"rank 3 on {ssh_hosts.hosts[1]}")
        assert workers.pull("rank") == {0: 0, 1: 1, 2: 2, 3: 3}
