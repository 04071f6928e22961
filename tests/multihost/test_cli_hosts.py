"""`nbaccel launch --hosts ...`: a torchrun-style script on every host, from one terminal.

The schema's fields are the CLI's flags, so ``--hosts``, ``--ssh_options`` and
``--remote_python`` reach the same launch path as ``hosts=`` in a notebook.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.multihost.sshd import SshHosts

SCRIPT = """
import torch.distributed as dist
dist.init_process_group("gloo")  # from the environment torch elastic set
print(f"hello from {dist.get_rank()} of {dist.get_world_size()}", flush=True)
dist.destroy_process_group()
"""


def test_a_script_runs_on_both_hosts_with_host_labelled_output(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "nbaccel.cli",
            "launch",
            "--hosts",
            ",".join(ssh_hosts.hosts),
            f"--ssh_options={' '.join(ssh_hosts.ssh_options)}",
            "--remote_python",
            sys.executable,
            "--num_processes",
            "4",
            "--use_cpu",
            "true",
            "--runs_dir",
            str(tmp_path / "runs"),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(4):
        assert f"hello from {rank} of 4" in done.stdout
