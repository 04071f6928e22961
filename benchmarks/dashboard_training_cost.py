"""Does showing the dashboard (its memory sampler, frames and text) slow the training?

The same 2-process CPU training (an MLP's forward, backward and SGD step in a tight loop,
``OMP_NUM_THREADS=1`` per rank, a metric logged and a line printed every step) runs for a fixed
time with ``dashboard=True`` (widgets built in this process, memory sampled every second from
the parent with psutil, curve and memory frames at 2 Hz, text at 10 Hz; they are not shown,
as outside a kernel, but every update is computed) and with ``dashboard="text"``, the variants
and a third variant, the dashboard with its memory sampler replaced by one that never reads
(what sampling alone costs), the variants alternating launch by launch (order rotated each
round). Rank 0 counts its steps between two barriers; the result is steps/s per launch,
medians over the rounds, and the paired ratios against text of each round (the same minute
of machine load).

On a 2-core machine the parent competes with the two ranks for the cores, so this is the
worst case; on a GPU machine the training runs on the GPUs and the parent's work matters less.
Launch-to-launch drift on a shared machine is about +-10 %, larger than what sampling could
cost, so the script also times the sampler itself: the parent CPU of one reading of two
processes (psutil RSS + /proc VmHWM), times the sampling rate, is the most of one core it can
take from training. The goal is checked on that bound.

Usage::

    python benchmarks/dashboard_training_cost.py            # 5 rounds x 2 x 5 s, ~1 min
    python benchmarks/dashboard_training_cost.py --rounds 8 --seconds 8
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from typing import Any

import nbaccel

GOAL = 0.98  # "sampling must not slow training": within the noise of this machine


def train(seconds: float) -> float:
    import time

    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))
    dist.barrier()
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        nbaccel.log_metrics({"loss": loss.item()}, step=steps)
        print(f"step {steps} loss {loss.item():.4f}")
    elapsed = time.perf_counter() - start
    dist.barrier()
    return steps / elapsed


class _NoSampling:
    """Stands in for MemorySampler: the dashboard without memory readings."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def start(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def stop(self, timeout: float = 2.0) -> None:
        pass


def measure(variant: Any, seconds: float, runs_dir: str) -> float:
    import nbaccel.ui.attach as attach

    sampler = attach.MemorySampler
    if variant == "no-sampling":
        attach.MemorySampler = _NoSampling  # type: ignore[misc,assignment]
    try:
        return _launch(True if variant == "no-sampling" else variant, seconds, runs_dir)
    finally:
        attach.MemorySampler = sampler  # type: ignore[misc]


def _launch(variant: Any, seconds: float, runs_dir: str) -> float:
    value = nbaccel.notebook_launcher(
        train,
        args=(seconds,),
        num_processes=2,
        runs_dir=runs_dir,
        dashboard=variant,
        log_ranks="0",
    )
    return float(value)


def sampler_share_of_a_core(readings: int = 300) -> tuple[float, float]:
    """(CPU ms per reading of 2 processes, % of one core at the dashboard's 1 Hz)."""
    import os
    import time

    from nbaccel.ui.dashboard.memory import ProcessMemory

    source = ProcessMemory(lambda: {0: os.getpid(), 1: os.getppid()})
    costs = []
    for _ in range(readings):
        start = time.process_time()
        source.read()
        costs.append(time.process_time() - start)
    per_reading = statistics.median(costs)
    return per_reading * 1e3, per_reading * 1.0 * 100  # 1 reading per second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    variants: dict[str, Any] = {
        "dashboard": True,
        "dashboard, no memory sampling": "no-sampling",
        "text": "text",
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as runs_dir, open("/dev/null", "w") as sink:
        measure(True, 1.0, runs_dir)  # warm-up: the helper, matplotlib, the figures
        for round_index in range(args.rounds):
            names = list(variants)
            order = names[round_index % 3 :] + names[: round_index % 3]  # rotate
            got = {}
            for name in order:
                with contextlib.redirect_stdout(sink):  # text mode prints every step
                    got[name] = measure(variants[name], args.seconds, runs_dir)
                rates[name].append(got[name])
            for name in variants:
                ratios.setdefault(name, []).append(got[name] / got["text"])
            print(
                f"round {round_index + 1}/{args.rounds}: "
                + ", ".join(f"{name} {rate:.0f} steps/s" for name, rate in got.items()),
                flush=True,
            )
    print()
    for name, values in rates.items():
        ratio = statistics.median(ratios[name])
        print(
            f"{name:30s} {statistics.median(values):7.1f} steps/s "
            f"(min {min(values):.1f}, max {max(values):.1f})  vs text {ratio:.3f}"
        )
    with_sampling, without = ratios["dashboard"], ratios["dashboard, no memory sampling"]
    effect = statistics.median(a / b for a, b in zip(with_sampling, without, strict=True))
    print(f"dashboard / dashboard without sampling, paired median: {effect:.3f} (drift-bound)")
    per_reading_ms, share = sampler_share_of_a_core()
    print(f"memory sampling: {per_reading_ms:.3f} ms CPU per reading, {share:.3f} % of a core")
    verdict = "PASS" if share <= (1 - GOAL) * 100 else "MISS"
    print(f"goal: sampling takes <= {(1 - GOAL) * 100:.0f} % of a core from training: {verdict}")


if __name__ == "__main__":
    main()
