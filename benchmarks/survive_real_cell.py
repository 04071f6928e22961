"""Runs that outlive the machine, from a real cell: a transformers GPT-2 built from its config
in the cell, its token data held in the kernel, launched from a real Jupyter kernel (the widget
dashboard, as a notebook has it).

1. **Step rate** in that kernel: ``checkpoint_every="10s"`` (background saves) against
   ``"off"``, launches alternated, rank 0's steps/s after a warm-up, median of the rounds.
2. **SIGKILL of everything** (the kernel, nbaccel's helper, the workers) after a periodic
   save; the same cell in a fresh kernel with ``resume="auto"``: the step it resumed at, and
   whether the final parameters are bit-identical (sha256) to an uninterrupted run's.

Usage::

    python benchmarks/survive_real_cell.py            # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import ast
import json
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from bench_util import progress, wait_until
from jupyter_client import KernelManager

CELL = """
import hashlib, time, numpy as np, nbaccel
tokens = np.random.default_rng(0).integers(0, 256, size=(512, 32))  # the data, in the kernel

def train(data, total, warmup=20):
    import torch, transformers
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(0)
    acc = nbaccel.Accelerator()
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loader = DataLoader(TensorDataset(torch.as_tensor(data)), batch_size=8, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    first, started = acc.completed_steps, None
    while acc.completed_steps < total:
        for (x,) in loader:
            loss = model(input_ids=x, labels=x).loss
            acc.backward(loss); opt.step(); opt.zero_grad()
            if acc.completed_steps % 20 == 0:
                acc.log({"loss": loss.item()})
            if acc.completed_steps == first + warmup:
                started = time.perf_counter()
            if acc.completed_steps >= total:
                break
    rate = (total - first - warmup) / (time.perf_counter() - started) if started else None
    digest = hashlib.sha256()
    for p in acc.unwrap_model(model).parameters():
        digest.update(p.detach().numpy().tobytes())
    return first, digest.hexdigest(), rate
"""


class Kernel:
    """A python3 kernel in ``cwd``; ``run(code)`` returns the cell's printed text."""

    def __init__(self, cwd: Path) -> None:
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(cwd))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 900) -> str:
        out: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(msg["content"]["traceback"]))

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        assert reply["content"]["status"] == "ok", "".join(out)
        return "".join(out)

    def value(self, code: str) -> Any:
        return ast.literal_eval(self.run(f"print({code})").strip().splitlines()[-1])

    def kill_everything(self) -> None:
        kernel = psutil.Process(self.km.provisioner.process.pid)  # type: ignore[union-attr]
        family = [kernel, *kernel.children(recursive=True)]
        for process in family:
            process.send_signal(signal.SIGKILL)
        psutil.wait_procs(family, timeout=30)
        self.close()

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def saved_step(root: Path) -> int:
    latest = root / "LATEST"
    if not latest.exists():
        return -1
    meta = json.loads((root / latest.read_text().strip() / "meta.json").read_text())
    return int(meta["progress"]["completed_steps"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000, help="steps of each step-rate launch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="survive-cell-") as folder:
        scratch = Path(folder)
        kernel = Kernel(scratch)
        kernel.run(CELL)
        rates: dict[str, list[float]] = {"off": [], "10s": []}
        for round_ in range(args.rounds):
            for every in ("off", "10s") if round_ % 2 == 0 else ("10s", "off"):
                progress(f"round {round_ + 1}: checkpoint_every={every}")
                place = f", checkpoint_dir={str(scratch / every)!r}" if every != "off" else ""
                rates[every].append(
                    kernel.value(
                        f"nbaccel.notebook_launcher(train, args=(tokens, {args.steps}), "
                        f"num_processes=2, checkpoint_every={every!r}{place})[2]"
                    )
                )
        total, root = 400, scratch / "ckpt"
        reference = kernel.value(
            f"nbaccel.notebook_launcher(train, args=(tokens, {total}), num_processes=2)"
        )
        launch = (
            f"run = nbaccel.launch(train, args=(tokens, {total}), num_processes=2, "
            f"checkpoint_dir={str(root)!r}, checkpoint_every='50 steps', resume='auto')"
        )
        kernel.run(launch)
        wait_until(lambda: saved_step(root) >= 100, timeout=600, poll=0.05)
        kernel.kill_everything()
        last = saved_step(root)
        fresh = Kernel(scratch)
        fresh.run(CELL)
        started = time.perf_counter()
        first, digest, _ = fresh.value(launch.replace("run = ", "") + ".result()")
        resumed_in = time.perf_counter() - started
        fresh.close()
    off, saving = statistics.median(rates["off"]), statistics.median(rates["10s"])
    print("A real cell: GPT-2 (2 layers, 64 wide) built in the cell, tokens held in the kernel,")
    print("2 CPU processes, launched from a real Jupyter kernel (widget dashboard)")
    print(f"steps/s off     {off:8.1f}   per round {[round(r, 1) for r in rates['off']]}")
    print(f"steps/s 10s     {saving:8.1f}   per round {[round(r, 1) for r in rates['10s']]}")
    print(f"ratio 10s / off {saving / off:8.3f}   goal >= 0.99")
    print(f"SIGKILL of everything after the save at step {last}; fresh kernel resumed at {first}")
    print(f"bit-identical to the uninterrupted run: {digest == reference[1]}")
    print(f"the resumed launch, call to its end ({total - first} steps): {resumed_in:.1f} s")


if __name__ == "__main__":
    main()
