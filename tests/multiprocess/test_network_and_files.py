"""What a one-machine run exposes: sockets on loopback only, a run folder only its owner
reads, and the user's checkpoints left with the user's umask."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

import nbaccel

pytestmark = pytest.mark.timeout(180)


def listening_addresses() -> list[str]:
    """Every address this worker listens on (gloo's pairs, rank 0's store)."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))  # the gloo connections are up
    me = psutil.Process()
    return sorted(
        {c.laddr.ip for c in me.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    )


def test_workers_listen_on_loopback_only(runs_dir: str) -> None:
    run = nbaccel.launch(listening_addresses, num_processes=2, runs_dir=runs_dir)
    results = run.results(timeout=120)
    assert results[0], "rank 0 serves the store: it must listen somewhere"
    for addresses in results.values():
        assert all(ip in ("127.0.0.1", "::1") for ip in addresses), results


def lan_address() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


LAN_HOSTNAME_SCRIPT = """
import socket, sys, nbaccel

def listening_addresses():
    import psutil, torch, torch.distributed as dist
    dist.all_reduce(torch.ones(1))
    conns = psutil.Process().net_connections(kind="inet")
    return sorted({c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN})

print("RESOLVES", socket.gethostbyname(socket.gethostname()))
run = nbaccel.launch(listening_addresses, num_processes=2, runs_dir=sys.argv[1])
print("LISTENING", run.results(timeout=120))
"""


def test_loopback_even_when_the_host_name_resolves_to_a_lan_address(tmp_path: Path) -> None:
    # gloo binds to the address the host name resolves to. Here it resolves to 127.0.0.1, so
    # the test makes it resolve to this machine's LAN address, as on many real machines: a
    # private UTS namespace (its own host name) and /etc/hosts bind-mounted in a mount
    # namespace. Needs root (CI runs as root) and util-linux's unshare.
    address = lan_address()
    if os.geteuid() != 0 or shutil.which("unshare") is None or address is None:
        pytest.skip("needs root, unshare and a non-loopback IPv4 address")
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{address} nbaccel-lan-host\n")
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(LAN_HOSTNAME_SCRIPT))
    inner = (
        f"hostname nbaccel-lan-host && mount --bind {hosts} /etc/hosts && "
        f"exec {sys.executable} {script} {tmp_path / 'runs'}"
    )
    result = subprocess.run(
        ["unshare", "--uts", "--mount", "sh", "-c", inner],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=Path(__file__).parents[2],
    )
    assert f"RESOLVES {address}" in result.stdout, result.stdout + result.stderr
    listening = result.stdout.split("LISTENING", 1)[1]
    assert address not in listening, listening
    assert "127.0.0.1" in listening, listening


def save_a_checkpoint(directory: str) -> int:
    import torch

    accelerator = nbaccel.Accelerator()
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.save_state(directory)
    accelerator.save_model(model, directory + "-model")
    return os.umask(0o022)  # reading the umask means setting it: put back what it was


def test_run_folder_is_private_and_checkpoints_keep_the_umask(
    runs_dir: str, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "ckpt"
    run = nbaccel.launch(save_a_checkpoint, args=(str(checkpoints),), runs_dir=runs_dir)
    umask = run.result(timeout=120)
    assert stat.S_IMODE(run.run_dir.stat().st_mode) == 0o700
    # runs_dir itself, made by this launch: its listing of run ids is private too.
    assert stat.S_IMODE(Path(runs_dir).stat().st_mode) == 0o700
    files = list(run.run_dir.iterdir())
    assert {f.name for f in files} >= {"config.json", "events.jsonl", "rank0.log"}
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    written = [p for p in [*checkpoints.rglob("*"), *Path(f"{checkpoints}-model").rglob("*")]]
    assert written
    for path in written:
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == expected, (path, oct(umask))
