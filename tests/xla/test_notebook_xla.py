"""torch_xla launches from a real Jupyter kernel on XLA's CPU device (CPU_NUM_DEVICES=1).

A notebook executed by nbclient trains through the Accelerator, gets rank 0's value back
and shows a worker's exception as the cell's error; then, in a kernel driven directly with
jupyter_client, an interrupt (the user's ■) ends the supervisor and torch_xla's worker
within 3 s and the next launch works.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest

if importlib.util.find_spec("torch_xla") is None:
    pytest.skip("torch_xla is not installed (see requirements/xla.txt)", allow_module_level=True)

from jupyter_client import BlockingKernelClient, KernelManager
from nbclient import NotebookClient

pytestmark = pytest.mark.timeout(300)

TRAIN_CELL = """
import json, nbaccel

def train(epochs):
    import torch
    from nbaccel import Accelerator
    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision="bf16")
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _ in range(epochs):
        for xb, yb in loader:
            with accelerator.autocast():
                loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    accelerator.print(f"trained {len(losses)} steps on {accelerator.device}")
    return {"losses": losses, "device": str(accelerator.device)}

RESULT = nbaccel.notebook_launcher(train, args=(3,), dashboard="text")
print("RESULT " + json.dumps(RESULT))
"""

ERROR_CELL = """
def broken():
    raise KeyError("no column 'label' in this batch")

nbaccel.notebook_launcher(broken, dashboard="text")
"""

CHECK_CELL = """
import sys
print("RUNTIME_IN_KERNEL", "torch_xla" in sys.modules and
      sys.modules["torch_xla"]._XLAC._xla_runtime_is_initialized())
"""


@pytest.fixture
def kernel_env(tmp_path: Path) -> Iterator[Path]:
    """A private TMPDIR / Jupyter runtime dir, and the XLA CPU device for the kernel."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("TMPDIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"):
            path = tmp_path / name.lower()
            path.mkdir()
            patch.setenv(name, str(path))
        patch.setenv("PJRT_DEVICE", "CPU")
        patch.setenv("CPU_NUM_DEVICES", "1")
        patch.delenv("MPLBACKEND", raising=False)
        yield tmp_path


def test_a_notebook_trains_on_xla_and_shows_worker_errors(kernel_env: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(textwrap.dedent(c)) for c in (TRAIN_CELL, ERROR_CELL)]
    nb.cells.append(nbformat.v4.new_code_cell(CHECK_CELL))
    NotebookClient(
        nb,
        timeout=240,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(kernel_env)}},
    ).execute()
    train_out = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    result = json.loads(train_out.split("RESULT ", 1)[1])
    assert result["device"] == "xla:0"
    assert len(result["losses"]) == 12 and result["losses"][-1] < result["losses"][0]
    assert "trained 12 steps on xla:0" in train_out  # rank 0's output streamed into the cell
    [error] = [o for o in nb.cells[1].outputs if o.output_type == "error"]
    assert error.ename == "KeyError"
    assert "[rank 0]" in error.evalue and "no column 'label'" in error.evalue
    check_out = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    assert "RUNTIME_IN_KERNEL False" in check_out


SPIN_CELL = """
import nbaccel

def spin(pid_file):
    import os, psutil, torch, torch_xla
    x = torch.zeros(4, device=torch_xla.device())
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))  # one device: torch_xla runs it in our supervisor
    os.rename(pid_file + ".tmp", pid_file)
    while True:
        x = x + 1
        torch_xla.sync()

nbaccel.notebook_launcher(spin, args=({pid_file!r},), dashboard="text")
"""


def _reply(kc: BlockingKernelClient, msg_id: str, timeout: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_shell_msg(timeout=0.2)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_reply":
            return dict(msg["content"])
    return None


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_interrupting_the_kernel_ends_every_xla_process_within_3s(kernel_env: Path) -> None:
    pid_file = kernel_env / "pids"
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(kernel_env), env=dict(os.environ))
    kc = km.client()
    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        msg_id = kc.execute(SPIN_CELL.format(pid_file=str(pid_file)), stop_on_error=False)
        deadline = time.monotonic() + 180
        while not pid_file.exists():
            assert time.monotonic() < deadline, "the XLA worker did not start within 180 s"
            assert _reply(kc, msg_id, 0.1) is None, "the cell ended before the worker spun"
        pids = [int(pid_file.read_text())]
        km.interrupt_kernel()
        interrupted = time.monotonic()
        while any(_running(p) for p in pids) and time.monotonic() < interrupted + 30:
            time.sleep(0.01)
        elapsed = time.monotonic() - interrupted
        assert not any(_running(p) for p in pids), "XLA processes outlived the interrupt by 30 s"
        assert elapsed <= 3.0, f"the XLA processes took {elapsed:.2f} s to stop"
        reply = _reply(kc, msg_id, 60)
        assert reply is not None and reply["ename"] == "KeyboardInterrupt", reply
        again = kc.execute("print('NEXT', nbaccel.notebook_launcher(lambda: 42, dashboard='text'))")
        reply = _reply(kc, again, 180)
        assert reply is not None and reply["status"] == "ok", reply
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
