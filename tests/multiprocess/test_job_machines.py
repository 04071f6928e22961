"""A job whose machines each launch from their own process (Accelerate's ``num_nodes=``).

Two Python processes stand for two machines, each with one rank: ``nbaccel.launch`` with
``num_machines=2`` and its own ``machine_rank`` (the schema's names for Accelerate's
``num_nodes``/``node_rank``). What each side's ``Run`` holds is its machine's ranks; a
machine whose peers never come fails with the reason and the fix, and leaves nothing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import nbaccel

MACHINE = """
import json, pickle, sys
import nbaccel


def train():
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    print(f"rank {{dist.get_rank()}} says {{total.item():g}}")
    return dist.get_rank()


run = nbaccel.launch(
    train,
    num_processes=2,
    num_machines=2,
    machine_rank={machine},
    main_process_port={port},
    runs_dir={runs!r},
    dashboard=False,
)
run.wait(timeout=120)
try:
    run.logs({other})
    other_logs = "readable"
except ValueError as error:
    other_logs = str(error)
print(json.dumps({{
    "state": run.state.value,
    "ranks": list(run.ranks),
    "result": run.result(),
    "results": {{str(k): v for k, v in run.results().items()}},
    "own_log": run.logs({machine}),
    "other_logs": other_logs,
    "rank0_saved": pickle.loads((run.run_dir / "result-rank0.pkl").read_bytes()),
}}))
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.timeout(300)
def test_each_machine_runs_and_shows_its_own_ranks_and_gets_rank_0s_value(
    tmp_path: Path,
) -> None:
    port = _free_port()
    machines = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(
                    MACHINE.format(
                        machine=machine,
                        other=1 - machine,
                        port=port,
                        runs=str(tmp_path / f"m{machine}"),
                    )
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for machine in range(2)
    ]
    outputs = [process.communicate(timeout=240) for process in machines]
    for machine, (out, err) in enumerate(outputs):
        assert machines[machine].returncode == 0, err
        # The text shown by default (log_ranks "0"): machine 1 has no rank 0, so its own rank.
        assert f"rank {machine} says 3" in out, out
        report = json.loads(out.strip().splitlines()[-1])
        assert report["state"] == "succeeded" and report["ranks"] == [machine], report
        assert report["result"] == 0, report  # rank 0's value, on both machines
        assert report["rank0_saved"] == 0, report  # and in each machine's run folder
        assert report["results"] == {str(machine): machine}, report
        assert f"rank {machine} says 3" in report["own_log"], report
        assert report["other_logs"] == (
            f"rank {1 - machine} runs on another machine: the cell there shows its output"
        ), report


def test_a_machine_whose_peers_never_come_fails_clearly_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    port = _free_port()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.monotonic()
    with pytest.raises(nbaccel.HelperError) as caught:
        nbaccel.notebook_launcher(
            sum,
            args=([1],),
            num_processes=1,
            num_nodes=2,
            node_rank=0,
            master_addr="127.0.0.1",
            use_port=str(port),
            rdzv_timeout=2,
            runs_dir=str(tmp_path / "runs"),
            dashboard=False,
        )
    message = str(caught.value)
    assert f"did not all meet within 2 s at 127.0.0.1:{port}" in message, message
    assert "node_rank 0 of 2" in message and "raise rdzv_timeout" in message, message
    assert time.monotonic() - started < 60  # the join timeout, not a hang
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not {pid for pid in left if psutil.pid_exists(pid)}, left
    with socket.socket() as again:  # machine 0's store gave its port back
        again.bind(("", port))
    assert os.listdir(tmp_path / "runs")  # the run folder records the failed run
