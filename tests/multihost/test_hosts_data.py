"""The kernel's data crosses to each host once: its agent receives it and shares it with the
host's ranks through one shared-memory segment (nbaccel/launcher/sharing).

Two hosts (127.0.0.2 and 127.0.0.3 behind a real sshd) x 2 ranks: the two ranks of a host map
the same segment (one inode), each host its own, and every rank's data is intact.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

import nbaccel
from tests.multihost.conftest import SshHosts
from tests.multiprocess.test_shared_data import address_of, mapping_of

RUN_TIMEOUT_S = 180.0


def where_the_data_lies(data: np.ndarray) -> tuple[str, int, float]:
    return (*mapping_of(address_of(data)), float(data.sum()))


def test_each_host_receives_the_data_once_and_its_ranks_share_it(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    data = np.arange(1 << 20, dtype="f8")  # 8 MiB
    settings: dict[str, Any] = {
        "hosts": list(ssh_hosts.hosts),
        "ssh_options": shlex.join(ssh_hosts.ssh_options),
        "remote_python": sys.executable,
        "runs_dir": str(tmp_path),
        "use_cpu": True,
    }
    run = nbaccel.launch(
        where_the_data_lies, args=(data,), num_processes=4, dashboard=False, **settings
    )
    assert run.wait(RUN_TIMEOUT_S) is nbaccel.RunState.SUCCEEDED, run.error
    found = run.results()
    assert all("memfd:nbaccel-data" in path for path, _, _ in found.values()), found
    assert {total for _, _, total in found.values()} == {float(data.sum())}
    first_host = {found[rank][1] for rank in (0, 1)}
    second_host = {found[rank][1] for rank in (2, 3)}
    assert len(first_host) == len(second_host) == 1, found  # one segment per host
    assert first_host != second_host, found  # each host its own
