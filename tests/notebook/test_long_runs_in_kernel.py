"""Runs that outlive the machine, from real kernels: everything SIGKILLed, then the same cell
in a fresh kernel resumes bit for bit; SIGTERM / SIGUSR1 to the kernel save first."""

from __future__ import annotations

import ast
import json
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client import KernelManager

pytestmark = pytest.mark.timeout(420)

TRAIN = """
import hashlib, nbaccel

def train(total):
    import numpy as np, torch
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(0); np.random.seed(0)
    acc = nbaccel.Accelerator()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(200, 8, generator=g), torch.randn(200, 1, generator=g))
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=8, shuffle=True))
    first = acc.completed_steps
    while acc.completed_steps < total:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y) + 1e-3 * float(np.random.rand())
            acc.backward(loss); opt.step(); opt.zero_grad()
            if acc.completed_steps % 50 == 0:
                acc.log({"loss": loss.item()})
            if acc.completed_steps >= total:
                break
    digest = hashlib.sha256()
    for p in acc.unwrap_model(model).parameters():
        digest.update(p.detach().numpy().tobytes())
    return first, digest.hexdigest()
"""


# Until the loop is stepping (its first metric): from then on its ranks answer a stop.
STEPPING = """
import time
deadline = time.monotonic() + 120
while not run.metrics and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def run_cell(kc: Any, code: str, timeout: float = 300) -> str:
    """Execute ``code``; its stdout (raises on an error in the cell)."""
    out: list[str] = []

    def take(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=take)
    text = "".join(out)
    assert reply["content"]["status"] == "ok", text
    return text


def wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def saved_step(root: Path) -> int:
    latest = root / "LATEST"
    if not latest.exists():
        return -1
    meta = root / latest.read_text().strip() / "meta.json"
    return int(json.loads(meta.read_text())["progress"]["completed_steps"])


def fresh_kernel(cwd: Path) -> tuple[KernelManager, Any]:
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(cwd))
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    return km, kc


def test_everything_sigkilled_then_the_same_cell_in_a_fresh_kernel_resumes_bit_for_bit(
    kernel_dirs: Path, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "ckpt"
    launch = (
        f"run = nbaccel.launch(train, args=(2500,), num_processes=2, dashboard='text', "
        f"checkpoint_dir={str(checkpoints)!r}, checkpoint_every='40 steps', resume='auto')"
    )
    km, kc = fresh_kernel(tmp_path)
    try:
        run_cell(kc, TRAIN)
        reference = run_cell(
            kc, "print(nbaccel.launch(train, args=(2500,), num_processes=2).result())"
        )
        run_cell(kc, launch)
        wait_for(lambda: saved_step(checkpoints) >= 80, 200, "a periodic save past step 80")
        # The machine goes away: the kernel, the helper and every worker at once.
        kernel = psutil.Process(km.provisioner.process.pid)  # type: ignore[union-attr]
        family = [kernel, *kernel.children(recursive=True)]
        for process in family:
            process.send_signal(signal.SIGKILL)
        psutil.wait_procs(family, timeout=30)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    last = saved_step(checkpoints)
    assert 80 <= last < 2500

    km, kc = fresh_kernel(tmp_path)
    try:
        run_cell(kc, TRAIN)
        text = run_cell(kc, launch + "\nprint(run.result())")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert f"resuming at step {last:,} from" in text
    first, digest = ast.literal_eval(text.strip().splitlines()[-1])
    assert first == last
    assert digest == ast.literal_eval(reference.strip().splitlines()[-1])[1]


def test_sigusr1_to_the_kernel_saves_and_stops_its_run_and_sigterm_saves_before_it_ends(
    kernel_dirs: Path, tmp_path: Path
) -> None:
    km, kc = fresh_kernel(tmp_path)
    try:
        run_cell(kc, TRAIN)
        run_cell(
            kc,
            "run = nbaccel.launch(train, args=(10**9,), num_processes=2, dashboard='text', "
            f"checkpoint_dir={str(tmp_path / 'a')!r})\n" + STEPPING,
        )
        pid = km.provisioner.process.pid  # type: ignore[union-attr]
        psutil.Process(pid).send_signal(signal.SIGUSR1)
        out = run_cell(kc, "print(run.wait(120).value, run.saved_step)")
        state, step = out.split()[-2:]
        assert state == "stopped" and saved_step(tmp_path / "a") == int(step) > 0
        assert psutil.Process(pid).is_running()  # SIGUSR1 stops the run, not the kernel

        run_cell(
            kc,
            "run = nbaccel.launch(train, args=(10**9,), num_processes=2, dashboard='text', "
            f"checkpoint_dir={str(tmp_path / 'b')!r})\n" + STEPPING,
        )
        run_dir = Path(run_cell(kc, "print(run.run_dir)").strip())
        kernel = psutil.Process(pid)
        kernel.send_signal(signal.SIGTERM)
        kernel.wait(timeout=180)  # it ends as asked, once the run has saved
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert saved_step(tmp_path / "b") > 0
    records = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    stops = {(e["rank"], e["step"]) for e in records if e.get("event") == "stopped"}
    assert {rank for rank, _ in stops} == {0, 1} and len({step for _, step in stops}) == 1
