"""The ``ssh_hosts`` fixture: a real sshd on 127.0.0.2 and 127.0.0.3 (``sshd.py``), started
once per session, its throwaway keys and files in a temporary folder removed at the end.
The tests' launches share the agents kept between launches, as a kernel's would; they are
ended with the server.

The ``slurm_cluster`` fixture: a real two-node Slurm cluster on the same two addresses
(``slurm_cluster.py``: slurmctld, two slurmd, its own munged), started once per session
(about 1 s) and stopped with everything of its jobs at the end."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nbaccel.launcher.remote.agent_link import AGENTS
from tests.multihost import slurm_cluster as slurm
from tests.multihost.slurm_cluster import SlurmCluster
from tests.multihost.sshd import SSHD, SshHosts, keygen, serve

__all__ = ["SlurmCluster", "SshHosts", "keygen", "slurm_cluster", "ssh_hosts"]


def _missing(message: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def ssh_hosts() -> Iterator[SshHosts]:
    if not os.access(SSHD, os.X_OK):
        _missing(f"{SSHD} not found: run .ci/install-browser (Debian's openssh-server)")
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-sshd-"))
    try:
        with serve(folder) as hosts:
            try:
                yield hosts
            finally:
                AGENTS.close_all()  # the agents kept between the tests' launches
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    if not slurm.installed():
        _missing(
            f"{slurm.SLURMCTLD}, {slurm.SLURMD} or {slurm.MUNGED} not found: run "
            ".ci/install-browser (Debian's slurmctld, slurmd, slurm-client and munge)"
        )
    if os.geteuid() != 0:
        _missing("the Slurm test cluster runs its daemons as root (SlurmUser=root)")
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-slurm-"))
    try:
        with slurm.serve(folder) as cluster:
            yield cluster
    finally:
        shutil.rmtree(folder, ignore_errors=True)
