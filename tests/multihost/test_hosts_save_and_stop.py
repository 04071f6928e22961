"""SIGTERM to one host's agent (a scheduler's notice for that machine) saves every rank of
every host at one step, and the run ends ``stopped``: 2 hosts x 2 ranks over real SSH."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import psutil
import pytest

import nbaccel
from nbaccel.events import RunState
from tests.multihost.conftest import SshHosts
from tests.multihost.test_hosts_launch import on_hosts
from tests.multiprocess.test_long_runs import train, wait_until_stepping

pytestmark = pytest.mark.timeout(300)


def test_sigterm_to_one_hosts_agent_saves_every_rank_at_one_step(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "ckpt"
    run = nbaccel.launch(
        train,
        args=(10**9,),
        num_processes=4,
        dashboard="text",
        checkpoint_dir=str(checkpoints),
        **on_hosts(ssh_hosts, tmp_path / "runs"),
    )
    wait_until_stepping(run, timeout=150)
    workers = [psutil.Process(pid) for pid in run.worker_pids.values()]
    # A worker is a fork of its host's agent (torch elastic's): one agent per host.
    hosts = list({w.ppid(): psutil.Process(w.ppid()) for w in workers}.values())
    assert len(hosts) == 2, hosts
    hosts[-1].send_signal(signal.SIGTERM)
    assert run.wait(150) is RunState.STOPPED and run.exit_code == 0
    records = [json.loads(line) for line in (Path(run.run_dir) / "events.jsonl").open()]
    stops = {(e["rank"], e["step"]) for e in records if e.get("event") == "stopped"}
    assert {rank for rank, _ in stops} == {0, 1, 2, 3}
    assert {step for _, step in stops} == {run.saved_step}
    meta = checkpoints / (checkpoints / "LATEST").read_text().strip() / "meta.json"
    assert json.loads(meta.read_text())["progress"]["completed_steps"] == run.saved_step
    assert all(agent.is_running() for agent in hosts)  # kept for the next launch
