"""A several-hosts launch (``hosts=``, over the real sshd of conftest.py) leaves the kernel
free of torch: the agents' messages are read without importing anything (their first once
carried ``torch.__version__``, a ``TorchVersion``, which imported torch into the kernel).
The other launch kinds: tests/multiprocess/test_torch_free_parent.py."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from tests.multihost.conftest import SshHosts
from tests.multiprocess.test_torch_free_parent import assert_torch_free, kernel


@pytest.mark.timeout(600)
def test_a_launch_on_two_hosts_leaves_the_kernel_free_of_torch(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    process = kernel(
        tmp_path,
        "runs",
        hosts=list(ssh_hosts.hosts),
        ssh_options=shlex.join(ssh_hosts.ssh_options),
        remote_python=sys.executable,
        use_cpu=True,
    )
    assert_torch_free(process, result=3)
