"""The ``ssh_hosts`` fixture: a real sshd on 127.0.0.2 and 127.0.0.3 (``sshd.py``), started
once per session, its throwaway keys and files in a temporary folder removed at the end.
The tests' launches share the agents kept between launches, as a kernel's would; they are
ended with the server."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nbaccel.launcher.remote.agent_link import AGENTS
from tests.multihost.sshd import SSHD, SshHosts, keygen, serve

__all__ = ["SshHosts", "keygen", "ssh_hosts"]


@pytest.fixture(scope="session")
def ssh_hosts() -> Iterator[SshHosts]:
    if not os.access(SSHD, os.X_OK):
        message = f"{SSHD} not found: run .ci/install-browser (Debian's openssh-server)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-sshd-"))
    try:
        with serve(folder) as hosts:
            try:
                yield hosts
            finally:
                AGENTS.close_all()  # the agents kept between the tests' launches
    finally:
        shutil.rmtree(folder, ignore_errors=True)
