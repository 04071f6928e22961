"""Interactive workers on two "machines" over real SSH (``nbaccel.Workers(hosts=[...])``):
the ranks connect back to the kernel over TCP, checked with the launch's secret; state is
kept between calls on the same processes, a failing rank on the second host is named, an
interrupt stops the code and not the workers, and a stranger cannot take a rank's place.

The hosts are 127.0.0.2 and 127.0.0.3 of this machine, behind a real sshd (conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import nbaccel
from nbaccel.launcher.interactive import connect as connect_module
from nbaccel.launcher.interactive import ending as ending_module
from nbaccel.launcher.interactive.connect import accept_ranks
from nbaccel.launcher.interactive.wire import connect, recv_frame, send_frame
from tests.multihost.conftest import SshHosts
from tests.multihost.test_hosts_launch import GONE_WITHIN_S, on_hosts

pytestmark = pytest.mark.timeout(300)


def where() -> tuple[int, int, str]:
    import torch.distributed as dist

    return dist.get_rank(), os.getpid(), os.environ.get("LOCAL_WORLD_SIZE", "")


def test_workers_on_two_hosts_keep_state_name_failures_and_take_interrupts(
    ssh_hosts: SshHosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ending_module, "INTERRUPT_GRACE", 2.0)
    with nbaccel.Workers(num_processes=4, dashboard="text", **on_hosts(ssh_hosts, tmp_path)) as w:
        first = w.run(where)
        assert sorted(first) == [0, 1, 2, 3] and {v[2] for v in first.values()} == {"2"}
        w.run_cell("import torch, torch.distributed as dist\nt = torch.ones(1)\n", "<c1>")
        w.run_cell("dist.all_reduce(t)\n", "<c2>")
        assert w.pull("t") and [v.item() for v in w.pull("t").values()] == [4.0] * 4
        w.run_cell("print('sum', t.item(), 'on', dist.get_rank())\n", "<c2b>")
        # Through the agents too, a log holds what the rank printed and nothing else.
        assert [w.logs(r) for r in range(4)] == [f"sum 4.0 on {r}\n" for r in range(4)]
        with pytest.raises(ValueError, match=r"\[rank 3 on host 127\.0\.0\.3\] bad") as raised:
            w.run_cell("if dist.get_rank() == 3:\n    raise ValueError('bad')\n", "<c3>")
        assert 'File "<c3>", line 2' in str(raised.value.__cause__)

        started = tmp_path / "started"
        code = f"import time, pathlib\npathlib.Path({str(started)!r}).touch()\ntime.sleep(600)"

        def interrupt_when_started() -> None:
            deadline = time.monotonic() + 60
            while not started.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGINT)

        thread = threading.Thread(target=interrupt_when_started)
        thread.start()
        with pytest.raises(KeyboardInterrupt):
            w.run_cell(code, "<long>")
        thread.join()
        assert w.run(where) == first  # the same processes, after an error and an interrupt
        pids = [pid for _, pid, _ in first.values()]
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], 30)
    assert not alive, f"workers left after close: {alive}"


def test_a_peer_without_the_secret_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connect_module, "START_TIMEOUT", 3.0)
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"tcp:127.0.0.1:{listener.getsockname()[1]}"
    heard: list[bytes | None] = []

    def stranger() -> None:
        with connect(address) as sock:  # answers the challenge without the secret
            challenge = recv_frame(sock)
            assert challenge is not None
            send_frame(sock, bytes(64))
            heard.append(recv_frame(sock))  # None: the kernel hung up, having read no more

    class NeverStarted:  # a run whose workers never come: only the stranger connects
        world_size, run_dir = 1, tmp_path
        state = nbaccel.RunState.RUNNING
        processes_ended = False

    thread = threading.Thread(target=stranger)
    thread.start()
    try:
        with pytest.raises(nbaccel.WorkersEnded, match="only 0 of 1 workers connected"):
            accept_ranks(listener, NeverStarted(), "ab" * 32)  # type: ignore[arg-type]
    finally:
        thread.join(10)
        listener.close()
    assert heard == [None]


KERNEL = """
import json, sys, nbaccel
workers = nbaccel.Workers(num_processes=4, dashboard="text", **json.loads(sys.argv[1]))
print("PIDS", *workers.pids.values(), flush=True)
sys.stdin.read()  # until killed
"""


def test_a_kernel_that_dies_takes_its_workers_on_every_host(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    settings = json.dumps(on_hosts(ssh_hosts, tmp_path))
    kernel = subprocess.Popen(
        [sys.executable, "-c", KERNEL, settings],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[2],
        text=True,
    )
    try:
        assert kernel.stdout is not None
        line = next(line for line in kernel.stdout if line.startswith("PIDS "))
        workers = [psutil.Process(int(pid)) for pid in line.split()[1:]]
        assert len(workers) == 4
        kernel.send_signal(signal.SIGKILL)  # no clean-up of its own
        kernel.wait(timeout=30)
        _, alive = psutil.wait_procs(workers, GONE_WITHIN_S)
        assert not alive, f"left running on the hosts after the kernel died: {alive}"
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait(timeout=30)
