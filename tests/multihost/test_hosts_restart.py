"""Elastic restarts over two "machines" (issue 15, point 4): with ``hosts=[...]`` and
``max_restarts=1``, a rank that fails in the first attempt on the second host has torch
elastic restart every worker on both hosts, and the second attempt's values come back; a
rank that always fails ends the run naming its rank, its host and the restart used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import nbaccel
from tests.multihost.conftest import SshHosts
from tests.multihost.test_hosts_launch import RUN_TIMEOUT_S, on_hosts


class ShardError(Exception):
    pass


def fails_on_rank_3(always: bool) -> dict[str, str]:
    import torch.distributed as dist

    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    dist.barrier()
    if dist.get_rank() == 3 and (always or attempt == "0"):
        raise ShardError(f"bad shard in attempt {attempt}")
    dist.barrier()
    return {"attempt": attempt}


def test_a_failure_on_the_second_host_restarts_both_hosts(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    settings = on_hosts(ssh_hosts, tmp_path)
    run = nbaccel.launch(fails_on_rank_3, args=(False,), num_processes=4, max_restarts=1,
                         dashboard=False, **settings)  # fmt: skip
    assert run.wait(RUN_TIMEOUT_S) is nbaccel.RunState.SUCCEEDED, run.error
    assert run.results() == {rank: {"attempt": "1"} for rank in range(4)}
    records = [json.loads(line) for line in (run.run_dir / "events.jsonl").open()]
    [restart] = [r for r in records if r["event"] == "restarted"]
    assert (restart["attempt"], restart["rank"]) == (1, 3)
    assert restart["reason"] == "raised ShardError: bad shard in attempt 0"
    assert restart["host"] in ssh_hosts.hosts


def test_restarts_used_up_end_the_run_naming_rank_host_and_restarts(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    with pytest.raises(ShardError) as caught:
        nbaccel.notebook_launcher(fails_on_rank_3, (True,), num_processes=4, max_restarts=1,
                                  **on_hosts(ssh_hosts, tmp_path))  # fmt: skip
    message = str(caught.value)
    host = message.split(" on host ", 1)[1].split(" ", 1)[0]
    assert host in ssh_hosts.hosts
    assert message == (
        f"[rank 3 on host {host} in attempt 2 of 2, after 1 restart] bad shard in attempt 1"
    )
