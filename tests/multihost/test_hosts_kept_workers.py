"""``keep_workers`` on two "machines" over real SSH: the ranks an agent started on each host
connect back over TCP once the function returned, serve the next calls with what they held,
send the model's weights (inside the reply: no shared memory across machines) and predictions
in order, and end with the group. The hosts are 127.0.0.2 and 127.0.0.3 (conftest.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import psutil
import pytest

import nbaccel
from tests.multihost.conftest import SshHosts
from tests.multihost.test_hosts_launch import on_hosts

pytestmark = pytest.mark.timeout(300)


def train() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    from nbaccel import Accelerator

    acc = Accelerator()
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Linear(8, 2))
    whole = acc.get_state_dict(model)
    digest = hashlib.sha256(b"".join(whole[k].numpy().tobytes() for k in sorted(whole)))
    return {"rank": dist.get_rank(), "pid": os.getpid(), "weights": digest.hexdigest()}


def test_kept_workers_on_two_hosts_serve_weights_and_predictions_then_end(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    import torch

    value = nbaccel.notebook_launcher(
        train, num_processes=4, keep_workers=True, dashboard="text", **on_hosts(ssh_hosts, tmp_path)
    )
    workers = nbaccel.last_workers()
    assert workers is not None
    pids = workers.pids
    try:
        assert pids[0] == value["pid"]
        assert sorted(r["rank"] for r in workers.pull("result").values()) == [0, 1, 2, 3]
        state = workers.state_dict()
        digest = hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state)))
        assert digest.hexdigest() == value["weights"]
        data = torch.arange(50.0).reshape(25, 2)
        assert torch.equal(workers.map(lambda b: b + 1, data, batch_size=4), data + 1)
    finally:
        workers.close()
    _, alive = psutil.wait_procs(
        [psutil.Process(p) for p in pids.values() if psutil.pid_exists(p)], 30
    )
    assert not alive, f"kept workers left after close: {alive}"
