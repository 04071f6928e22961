"""The parent never imports torch, also not by reading what a worker, an agent, the helper or
a supervisor sends (DESIGN.md §7): after every launch kind, in a fresh interpreter, torch is
not in ``sys.modules``. Each launch returns a value and then fails (a worker's ValueError),
so both the result's and the error's way back are read. The several-hosts launch (``hosts=``,
over a real sshd) is tests/multihost/test_hosts_torch_free.py.

Also the rule itself: a frame that names a class of a module not imported here (a
``TorchVersion``, as the agents' first message once held) is refused, not imported.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

# One launch kind in a fresh interpreter: its result, its failure, then what torch left.
KERNEL = """
import sys
import nbaccel

def train():
    import torch
    import torch.distributed as dist

    total = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(total)
    return int(total.item())

def fails():
    raise ValueError("bad batch")

options = dict(num_processes=2, runs_dir={runs!r}, dashboard=False, **{options!r})
assert "torch" not in sys.modules, "import nbaccel imported torch"
run = nbaccel.launch(train, **options)
assert run.wait(timeout=240) is nbaccel.RunState.SUCCEEDED, run.error
print("RESULT", run.result())
try:
    nbaccel.launch(fails, **options).result(timeout=240)
except ValueError as error:
    print("RAISED", error)
print("TORCH_MODULES", [m for m in sys.modules if m == "torch" or m.startswith("torch.")])
"""


def kernel(tmp_path: Path, name: str, **options: Any) -> subprocess.Popen[str]:
    code = textwrap.dedent(KERNEL.format(runs=str(tmp_path / name), options=options))
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )


def assert_torch_free(process: subprocess.Popen[str], result: int) -> None:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    assert f"RESULT {result}\n" in out, out
    assert "RAISED [rank " in out and "bad batch" in out, out  # the worker's own ValueError
    assert "TORCH_MODULES []\n" in out, out


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="one-machine"),
        pytest.param({"max_restarts": 1}, id="max_restarts"),  # an agent on this machine
        pytest.param({"detach": True}, id="detached"),  # the supervisor's events and error
    ],
)
def test_a_launch_leaves_the_parent_free_of_torch(tmp_path: Path, options: dict[str, Any]) -> None:
    assert_torch_free(kernel(tmp_path, "runs", **options), result=3)


@pytest.mark.timeout(600)
def test_each_machine_of_a_per_node_job_stays_free_of_torch(tmp_path: Path) -> None:
    # Accelerate's num_nodes=/node_rank= form: two processes stand for two machines, each
    # with an agent of its own (one rank each); machine 1 gets rank 0's value.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    job = {"num_machines": 2, "main_process_port": port}
    machines = [kernel(tmp_path, f"m{rank}", machine_rank=rank, **job) for rank in range(2)]
    for machine in machines:
        assert_torch_free(machine, result=3)


REFUSE = """
import sys
from nbaccel.frames import FrameDecoder, UnreadableFrame, encode_frame
[message] = FrameDecoder().feed(bytes.fromhex({frame!r}))
assert isinstance(message, UnreadableFrame), message
print("REASON", message.reason)
print("TORCH", "torch" in sys.modules)
"""


def test_a_frame_naming_a_torch_class_is_refused_not_imported(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    frame = encode({"op": "agent", "torch": torch.__version__})  # what agents once sent
    code = textwrap.dedent(REFUSE.format(frame=frame.hex()))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "TORCH False\n" in result.stdout
    assert "ImportRefused: a message from another nbaccel process holds a " in result.stdout
    assert "torch.torch_version.TorchVersion object" in result.stdout


def encode(message: dict[str, Any]) -> bytes:
    from nbaccel.frames import encode_frame

    return encode_frame(message)
