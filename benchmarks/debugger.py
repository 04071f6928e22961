"""What the debugger channel costs: a breakpoint's prompt, a pdb command, stacks, a run's steps.

What is measured
----------------
* **prompt**: from ``breakpoint()`` called on rank 1 of 2 (its ``time.time()`` just before,
  read back with ``p``) to the kernel's ``input()`` being called with the pdb prompt: the
  rank asks the kernel, the kernel answers, pdb starts, its first output and prompt travel
  back. The launch's own start is not in it. One launch per repetition; in a Jupyter
  kernel ``input()`` then sends the frontend its ``input_request`` (not measured here).
* **command round trip**: ``p 1`` typed, and the next prompt reached (``input()`` called
  again): the line to the rank, pdb's command, its output and the prompt back.
* **stacks of 8 ranks**: ``run.stacks()`` of a launch of 8 CPU ranks, 7 of them waiting in a
  barrier for the 8th (which sleeps in a loop): every rank's channel answers, nothing stops.
* **step rate**: a run that never stops. ``step_overhead.py``'s raw DDP loop (its MLP,
  AdamW, batch 32, 2 ranks) timed on rank 0 in blocks of 25 steps between barriers (a
  launch's rate: the median block), in launches of three arms taken in rounds (order
  rotated): **on** (as every launch is: the channel's thread parked in ``recv``, the
  breakpoint hook installed), **off** (the worker closes its channel and puts Python's own
  hook back before the loop), and **on again** (a null test: two identical arms, whose
  difference shows what whole launches can resolve on this machine). Each arm's steps/s is
  compared with the other arms' of the same round: paired medians of the log ratio, with a
  95 % bootstrap interval.

Medians over the repetitions. The machine's load average is printed before and after: on a
shared 2-core machine the figures move with it.

Usage::

    python benchmarks/debugger.py               # 10 repetitions, 12 step-rate rounds, ~3 min
    python benchmarks/debugger.py --quick       # smoke run, < 40 s
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from step_overhead import Interval

GOALS = {"prompt": 0.5, "round trip": 0.050, "stacks of 8 ranks": 1.0}
COMMANDS = 50  # p 1, typed this many times per repetition
STEP_ARMS = ("on", "off", "on again")
BLOCK = 25  # steps per timed block of a step-rate launch


# --------------------------------------------------------------------------- worker side


def stop_on_rank_1() -> int:
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        reached = time.time()  # noqa: F841 - read with ``p`` from the kernel
        breakpoint()
    dist.barrier()
    return dist.get_rank()


def wait_for_rank_0(flag: str) -> int:
    import pathlib
    import time

    import torch.distributed as dist

    if dist.get_rank() == 0:
        while not pathlib.Path(flag).exists():
            time.sleep(0.01)
    dist.barrier()
    return dist.get_rank()


def step_rate(arm: str, steps: int, warmup: int, hidden: int) -> float:
    """Rank 0's steps/s of step_overhead's raw DDP loop, with the channel on or off."""
    import statistics
    import sys
    import time

    import torch.distributed as dist
    from step_overhead import dataset, make_variant

    from nbaccel import active_session

    if arm == "off":  # what a worker without the debugger channel would be
        session = active_session()
        assert session is not None
        session.debugger.close()
        sys.breakpointhook = sys.__breakpointhook__
    data = dataset(warmup + steps)
    step, batches, _info, _timer = make_variant("raw DDP", data, hidden)
    for index in range(warmup):
        step(*next(batches), index)
    rates = []  # per block of BLOCK steps: a hiccup of the machine moves one block, not all
    for block in range(steps // BLOCK):
        dist.barrier()
        started = time.perf_counter()
        for index in range(BLOCK):
            step(*next(batches), warmup + block * BLOCK + index)
        dist.barrier()
        rates.append(BLOCK / (time.perf_counter() - started))
    return statistics.median(rates)


# --------------------------------------------------------------------------- kernel side


def prompts_and_round_trips(repeats: int, runs_dir: str) -> tuple[list[float], list[float]]:
    import nbaccel
    from nbaccel.launcher.debug.console import DebugConsole

    latencies: list[float] = []
    round_trips: list[float] = []
    for _ in range(repeats):
        run = nbaccel.launch(stop_on_rank_1, num_processes=2, runs_dir=runs_dir, dashboard=False)
        typed: list[str] = ["p reached", *["p 1"] * COMMANDS, "c"]
        called: list[float] = []
        shown: list[str] = []

        def prompt(text: str, typed: list[str] = typed, called: list[float] = called) -> str:
            called.append(time.time())
            return typed.pop(0)

        console = DebugConsole(run._debug, prompt=prompt, write=shown.append, can_type=lambda: None)  # type: ignore[arg-type]
        run._console = console
        run.wait(120)
        reached = float(next(line for line in "".join(shown).splitlines() if _is_float(line)))
        latencies.append(called[0] - reached)
        round_trips += [b - a for a, b in itertools.pairwise(called[1:])]  # the p 1s
    return latencies, round_trips


def _is_float(text: str) -> bool:
    try:
        return float(text) > 1e9
    except ValueError:
        return False


def stacks_of_8(repeats: int, runs_dir: str) -> list[float]:
    import nbaccel

    with tempfile.TemporaryDirectory() as folder:
        flag = Path(folder) / "release"
        run = nbaccel.launch(
            wait_for_rank_0, args=(str(flag),), num_processes=8, runs_dir=runs_dir,
            dashboard=False, use_cpu=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while sum("waiting in barrier" in t for t in run.stacks().values()) < 7:
                if time.monotonic() > deadline:
                    raise TimeoutError("the 8 ranks did not reach their barrier in 120 s")
            seconds = []
            for _ in range(repeats):
                started = time.perf_counter()
                stacks = run.stacks()
                seconds.append(time.perf_counter() - started)
                assert len(stacks) == 8 and "in wait_for_rank_0" in stacks[0]
        finally:
            flag.touch()
        run.wait(120)
    return seconds


def step_rates(rounds: int, steps: int, runs_dir: str, hidden: int) -> dict[str, list[float]]:
    import nbaccel

    rates: dict[str, list[float]] = {arm: [] for arm in STEP_ARMS}
    arms = list(STEP_ARMS)
    for turn in range(rounds):
        shift = turn % len(arms)
        for arm in arms[shift:] + arms[:shift]:
            rate = nbaccel.notebook_launcher(
                step_rate, args=(arm, steps, 20, hidden), num_processes=2, runs_dir=runs_dir,
                dashboard=False, use_cpu=True,
            )  # fmt: skip
            rates[arm].append(rate)
    return rates


def report(args: argparse.Namespace) -> list[str]:
    runs_dir = tempfile.mkdtemp(prefix="nbaccel-debugger-bench-")
    lines = [f"load average before: {os.getloadavg()}, {os.cpu_count()} cores"]
    import nbaccel

    nbaccel.notebook_launcher(len, args=([1],), num_processes=2, runs_dir=runs_dir)  # warm
    latencies, round_trips = prompts_and_round_trips(args.repeats, runs_dir)
    stacks = stacks_of_8(args.repeats * 2, runs_dir)
    figures = {
        "prompt": latencies,
        "round trip": round_trips,
        "stacks of 8 ranks": stacks,
    }
    for name, values in figures.items():
        median = statistics.median(values)
        goal = GOALS[name]
        verdict = "PASS" if median <= goal else "MISS"
        lines.append(
            f"{name:>18}: median {median * 1000:8.3f} ms  (min {min(values) * 1000:.3f}, "
            f"max {max(values) * 1000:.3f}, n={len(values)}); goal <= {goal * 1000:g} ms: "
            f"{verdict}"
        )
    rates = step_rates(args.rounds, args.steps, runs_dir, args.hidden)
    for arm in STEP_ARMS:
        values = rates[arm]
        lines.append(
            f"{'steps/s, ' + arm:>18}: median {statistics.median(values):8.1f}  "
            f"(min {min(values):.1f}, max {max(values):.1f}, n={len(values)})"
        )
    cost = Interval([math.log(a / b) for a, b in zip(rates["off"], rates["on"], strict=True)])
    null = Interval([math.log(a / b) for a, b in zip(rates["on again"], rates["on"], strict=True)])
    lines.append(f"step rate, off vs on (the channel's cost): {cost.change()}")
    lines.append(f"step rate, on again vs on (null test):     {null.change()}")
    inside = null.low - 1e-9 <= cost.median <= null.high + 1e-9 or (cost.low <= 0 <= cost.high)
    lines.append(
        "no cost to a run that never stops: "
        + ("PASS (within the noise)" if inside else "MISS (outside the null test's interval)")
    )
    lines.append(f"load average after: {os.getloadavg()}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, help="launches with a breakpoint (10)")
    parser.add_argument("--rounds", type=int, help="rounds of the step-rate arms (12)")
    parser.add_argument("--steps", type=int, help="timed steps per step-rate launch (300)")
    parser.add_argument("--hidden", type=int, default=256, help="MLP width (256)")
    parser.add_argument("--quick", action="store_true", help="smoke run")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 10)
    args.rounds = args.rounds or (2 if args.quick else 12)
    args.steps = args.steps or (60 if args.quick else 300)
    return args


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    for line in report(parse_args(argv)):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
