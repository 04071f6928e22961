"""Per-step cost of nbaccel's Accelerator against a raw DDP loop and Hugging Face Accelerate.

What is measured
----------------
The same MLP (256 -> hidden x3 -> 10, default hidden 256, AdamW, batch 32 per rank,
cross-entropy on fixed random data) is trained on 2 CPU processes (gloo) started by
``nbaccel.notebook_launcher(num_processes=2)``, in these variants:

* **raw DDP**: plain torch: ``DistributedDataParallel``, ``DistributedSampler``, a manual loop
  (forward, backward, step, zero_grad) on the process group nbaccel set up;
* **nbaccel**: ``nbaccel.Accelerator``: ``prepare``, ``with acc.accumulate(model)``,
  ``acc.backward``, ``opt.step``/``zero_grad`` and ``acc.log({"loss": loss.item()})`` every step,
  which sends a metric to the parent (``run.metrics``); **nbaccel, no log** leaves ``log`` out;
* **accelerate**: the same code with ``accelerate.Accelerator()`` (the worker checks that it
  reports MULTI_CPU with 2 processes and the launch's accumulation steps);
* **nbaccel, breakdown off**: **nbaccel** with the step-time breakdown switched off
  (``acc.strategy.step_timer.enabled = False``); it is on in every launched worker, so the
  other nbaccel rows include it. The report gives its cost two ways: the paired median of
  (on - off) / off per turn, and directly: rank 0 runs the marks of one step (a batch
  requested and handed out, ``backward`` with the reduction watch, clipping, ``step``,
  ``zero_grad``) around a tiny backward on a timer switched on and off, in thread CPU time
  (min of 9 runs of 2,000 steps), as a share of the median nbaccel step. Goal <= 1 % of a
  step (issue 16).

Gradient accumulation 4 (the launch's ``gradient_accumulation_steps``; steps are micro-steps)
is measured with and without DDP's ``no_sync`` on the 3 micro-steps that do not step: raw DDP
with ``model.no_sync()`` / without it, ``acc.accumulate(model)`` / ``acc.accumulate()`` (no model
given, so every micro-step all-reduces) and Accelerate's ``accumulate(model)``.

One launch per section and repetition. In it every variant has its own model, optimizer and
loader (same seeds, same data); after ``--warmup`` steps each, the variants take turns in
blocks of ``--block`` steps (order rotated every round), each block timed on rank 0 between two
barriers, until each variant has run ``--steps`` timed steps. Turns of 0.1-0.3 s cancel
the drift of a shared machine far better than whole runs in turn. Set-up is not timed.

Reading the output
------------------
Steps/s are medians over the repetitions (min-max beside them: the machine's drift). "vs raw"
is the median, over every turn of every repetition, of the raw DDP reference's time for its
turn divided by the variant's time for its turn in the same round (throughput ratio, > 1 is
faster than raw); "+us/step" is the median extra time per step against that same turn. Paired
turns seconds apart cancel the drift that the min-max column shows. The accumulation section
adds the speed-up of no_sync (same paired median). The goal line checks nbaccel >= 0.98 x raw
DDP. On a shared 2-core machine one run's ratios still move by about +-0.02: compare runs.

Usage::

    python benchmarks/step_overhead.py               # 400 steps x 10 repetitions, 4-8 min
    python benchmarks/step_overhead.py --quick       # smoke run, < 60 s
    python benchmarks/step_overhead.py --steps 600 --repeats 10 --hidden 512
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GOAL = 0.98
BREAKDOWN_GOAL = 0.01  # the step-time breakdown costs at most 1 % of a step
WORLD_SIZE = 2
IN, CLASSES, BATCH = 256, 10, 32
# name -> (framework, accumulation steps, no_sync on non-stepping micro-steps, log every step)
VARIANTS: dict[str, tuple[str, int, bool, bool]] = {
    "raw DDP": ("raw", 1, False, False),
    "nbaccel": ("nbaccel", 1, False, True),
    "nbaccel, no log": ("nbaccel", 1, False, False),
    "accelerate": ("accelerate", 1, False, True),
    "raw DDP, sync every micro-step": ("raw", 4, False, False),
    "raw DDP, no_sync": ("raw", 4, True, False),
    "nbaccel, accumulate() (syncs)": ("nbaccel", 4, False, True),
    "nbaccel, accumulate(model)": ("nbaccel", 4, True, True),
    "accelerate, accumulate(model)": ("accelerate", 4, True, True),
    "nbaccel, breakdown off": ("nbaccel", 1, False, True),
}
BREAKDOWN_OFF = {"nbaccel, breakdown off"}  # variants that switch the step timer off
REFERENCE = {1: "raw DDP", 4: "raw DDP, no_sync"}
NO_SYNC_PAIRS = (
    ("raw DDP, sync every micro-step", "raw DDP, no_sync"),
    ("nbaccel, accumulate() (syncs)", "nbaccel, accumulate(model)"),
)
Step = Callable[[Any, Any, int], None]


# --------------------------------------------------------------------------- worker side


def make_variant(name: str, data: Any, hidden: int) -> tuple[Step, Any, str]:
    """The step function, batch iterator and self-report of one variant, freshly built."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    framework, accumulation, use_no_sync, log = VARIANTS[name]
    torch.manual_seed(0)
    widths = (IN, hidden, hidden)
    layers = [m for w in widths for m in (nn.Linear(w, hidden), nn.ReLU())]
    model: Any = nn.Sequential(*layers, nn.Linear(hidden, CLASSES))
    optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if framework == "raw":
        model = nn.parallel.DistributedDataParallel(model)
        sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
        loader = DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)

        def raw_step(x: Any, y: Any, index: int) -> None:
            steps_now = (index + 1) % accumulation == 0
            with model.no_sync() if use_no_sync and not steps_now else contextlib.nullcontext():
                loss = F.cross_entropy(model(x), y)
                (loss / accumulation if accumulation > 1 else loss).backward()
            if steps_now:
                optimizer.step()
                optimizer.zero_grad()

        return raw_step, iter(loader), ""
    if framework == "nbaccel":
        from nbaccel import Accelerator
    else:
        from accelerate import Accelerator  # type: ignore[import-untyped]
    acc = Accelerator()  # accumulation steps come from the launch, as in a notebook
    if name in BREAKDOWN_OFF:
        acc.strategy.step_timer.enabled = False
    elif framework == "nbaccel" and not acc.strategy.step_timer.enabled:
        raise RuntimeError(f"{name}: the step-time breakdown should be on in a launched worker")
    kind = str(getattr(acc.distributed_type, "value", acc.distributed_type))
    seen = (kind, acc.num_processes, acc.gradient_accumulation_steps)
    if seen != ("MULTI_CPU", WORLD_SIZE, accumulation):
        raise RuntimeError(f"{name}: Accelerator reports {seen}")
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    synced = (model,) if use_no_sync else ()

    def step(x: Any, y: Any, index: int) -> None:
        with acc.accumulate(*synced):
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if log:
            acc.log({"loss": loss.item()})

    return step, iter(loader), "{}, {} processes, accumulation {}".format(*seen)


def train(names: list[str], steps: int, warmup: int, block: int, hidden: int) -> dict[str, Any]:
    """All ``names`` in turns of ``block`` steps; rank 0's seconds per variant and turn."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(0)
    samples = (warmup + steps) * BATCH * WORLD_SIZE
    data = TensorDataset(
        torch.randn(samples, IN, generator=generator),
        torch.randint(0, CLASSES, (samples,), generator=generator),
    )
    built = {name: make_variant(name, data, hidden) for name in names}
    done = dict.fromkeys(names, 0)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}  # rank 0's thread CPU time

    def run(name: str, count: int) -> None:
        step, batches = built[name][:2]
        for _ in range(count):
            x, y = next(batches)
            step(x, y, done[name])
            done[name] += 1

    for name in names:
        run(name, warmup)
    cost = marks_cost() if any(name in BREAKDOWN_OFF for name in names) else None
    for turn in range(steps // block):
        shift = turn % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            started, cpu_started = time.perf_counter(), time.thread_time()
            run(name, block)
            cpu[name].append(time.thread_time() - cpu_started)
            dist.barrier()
            seconds[name].append(time.perf_counter() - started)
    info = {name: built[name][2] for name in names}
    return {"seconds": seconds, "cpu": cpu, "info": info, "marks_us": cost}


def marks_cost(runs: int = 9, steps: int = 2000) -> float:
    """Microseconds of CPU time the step timer's marks add to one DDP step (see above)."""
    import torch

    from nbaccel.accel.step_timing import BACKWARD, OPTIMIZER, StepTimer

    batch = (torch.zeros(BATCH, IN), torch.zeros(BATCH, dtype=torch.long))
    weight = torch.ones(4, requires_grad=True)

    def per_step(enabled: bool) -> float:
        timer = StepTimer(enabled=enabled, send=lambda _window: None, distributed=True)
        loader = object()
        started = time.thread_time()
        timer.begin_data(loader)
        for _ in range(steps):
            timer.end_data(batch)
            loss = (weight * 2).sum()
            previous = timer.enter(BACKWARD)
            if previous is not None:
                timer.watch_reduction(loss)
            loss.backward()
            timer.leave(previous)
            for _call in range(3):  # clipping, step, zero_grad
                timer.leave(timer.enter(OPTIMIZER))
            timer.begin_data(loader)
        timer.loop_ended(loader)
        return (time.thread_time() - started) / steps * 1e6

    on = min(per_step(True) for _ in range(runs))
    off = min(per_step(False) for _ in range(runs))
    return on - off


# --------------------------------------------------------------------------- driver


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Per variant, the seconds of each turn, repetition after repetition; self-reports."""
    import nbaccel

    seconds: dict[str, list[list[float]]] = {name: [] for name in args.variants}
    info: dict[str, str] = {}
    marks_us: list[float] = []
    cpu: dict[str, list[list[float]]] = {name: [] for name in args.variants}
    sections = sorted({VARIANTS[name][1] for name in args.variants})
    with tempfile.TemporaryDirectory(prefix="step_overhead-") as runs_dir:
        for repeat in range(args.repeats):
            for accumulation in sections:
                names = [n for n in args.variants if VARIANTS[n][1] == accumulation]
                print(
                    f"repetition {repeat + 1}/{args.repeats}, accumulation {accumulation}",
                    file=sys.stderr,
                    flush=True,
                )
                result = nbaccel.notebook_launcher(
                    train,
                    args=(names, args.steps, args.warmup, args.block, args.hidden),
                    num_processes=WORLD_SIZE,
                    runs_dir=runs_dir,
                    log_ranks="0",
                    gradient_accumulation_steps=accumulation,
                )
                for name in names:
                    seconds[name].append(result["seconds"][name])
                    cpu[name].append(result["cpu"][name])
                info.update(result["info"])
                if result["marks_us"] is not None:
                    marks_us.append(result["marks_us"])
    return {"seconds": seconds, "cpu": cpu, "info": info, "marks_us": marks_us}


def paired(a: list[list[float]], b: list[list[float]], how: Callable[..., float]) -> float:
    """Median of ``how(a_turn, b_turn)`` over every turn of every repetition."""
    turns = zip(itertools.chain(*a), itertools.chain(*b), strict=True)
    return statistics.median(how(x, y) for x, y in turns)


def format_report(data: dict[str, Any], steps: int, block: int) -> list[str]:
    seconds: dict[str, list[list[float]]] = data["seconds"]
    lines: list[str] = []
    for accumulation, unit in ((1, "steps/s"), (4, "micro/s")):
        names = [n for n in seconds if VARIANTS[n][1] == accumulation]
        if not names:
            continue
        base = REFERENCE[accumulation] if REFERENCE[accumulation] in seconds else None
        what = "steps" if accumulation == 1 else "micro-steps"
        lines += [
            "",
            f"accumulation {accumulation} ({steps} timed {what} per repetition)",
            f"{'variant':<34}{unit:>9}{'min-max':>15}{'vs raw':>8}{'+us/step':>10}",
            "-" * 76,
        ]
        for name in names:
            rates = [steps / sum(turns) for turns in seconds[name]]
            ratio = overhead = "-"
            if base is not None and name != base:
                ratio = f"{paired(seconds[base], seconds[name], lambda b, s: b / s):.3f}"
                extra = paired(seconds[base], seconds[name], lambda b, s: (s - b) / block * 1e6)
                overhead = f"{extra:+.0f}"
            spread = f"{min(rates):.1f}-{max(rates):.1f}"
            lines.append(
                f"{name:<34}{statistics.median(rates):>9.1f}{spread:>15}{ratio:>8}{overhead:>10}"
            )
        for without, with_ in NO_SYNC_PAIRS if accumulation == 4 else ():
            if without in seconds and with_ in seconds:
                speedup = paired(seconds[without], seconds[with_], lambda a, b: a / b)
                lines.append(f"no_sync speed-up, {with_.split(',')[0]}: {speedup:.3f}x")
    lines.append("")
    lines += [f"{name} reported: {text}" for name, text in data["info"].items() if text]
    if "raw DDP" in seconds and "nbaccel" in seconds:
        ratio = paired(seconds["raw DDP"], seconds["nbaccel"], lambda raw, ours: raw / ours)
        verdict = "PASS" if ratio >= GOAL else "MISS"
        lines.append(f"goal: nbaccel >= {GOAL} x raw DDP steps/s: {ratio:.3f}  {verdict}")
    lines += breakdown_report(seconds, data.get("cpu", {}), block, data.get("marks_us", []))
    return lines


def breakdown_report(
    seconds: dict[str, list[list[float]]],
    cpu: dict[str, list[list[float]]],
    block: int,
    marks_us: list[float],
) -> list[str]:
    """The step-time breakdown's cost (nbaccel on vs off: paired turns in wall and in rank
    0's CPU time, and the marks measured directly), and nbaccel with it against Accelerate."""
    on, off = seconds.get("nbaccel"), seconds.get("nbaccel, breakdown off")
    if on is None or off is None:
        return []
    cost = paired(on, off, lambda with_, without: with_ / without - 1)
    extra = paired(on, off, lambda with_, without: (with_ - without) / block * 1e6)
    step_us = statistics.median(itertools.chain(*on)) / block * 1e6
    direct = statistics.median(marks_us) if marks_us else float("nan")
    verdict = "PASS" if direct / step_us <= BREAKDOWN_GOAL else "MISS"
    lines = [
        f"step-time breakdown, paired turns on vs off: {extra:+.0f} us/step, "
        f"{100 * cost:+.2f} % of a step",
    ]
    cpu_on, cpu_off = cpu.get("nbaccel"), cpu.get("nbaccel, breakdown off")
    if cpu_on and cpu_off:
        cpu_cost = paired(cpu_on, cpu_off, lambda with_, without: with_ / without - 1)
        cpu_extra = paired(cpu_on, cpu_off, lambda a, b: (a - b) / block * 1e6)
        lines.append(
            f"step-time breakdown, paired turns on vs off in rank 0's CPU time: "
            f"{cpu_extra:+.0f} us/step, {100 * cpu_cost:+.2f} %"
        )
    lines += [
        f"step-time breakdown, its marks measured directly: {direct:.1f} us of CPU per step, "
        f"{100 * direct / step_us:.2f} % of nbaccel's median step ({step_us:.0f} us); "
        f"goal <= {100 * BREAKDOWN_GOAL:.0f} %  {verdict}",
    ]
    if "accelerate" in seconds:
        ahead = paired(seconds["accelerate"], on, lambda theirs, ours: theirs / ours)
        lines.append(f"nbaccel with the breakdown vs accelerate: {ahead:.3f} x steps/s")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="timed steps per variant and repetition (400)")
    parser.add_argument("--repeats", type=int, help="repetitions, one launch per section (10)")
    parser.add_argument("--warmup", type=int, help="untimed steps per variant first (20)")
    parser.add_argument("--block", type=int, default=20, help="steps per turn (20)")
    parser.add_argument("--hidden", type=int, default=256, help="MLP width (256)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 80 steps x 2")
    numbered = ", ".join(f"{i} {name}" for i, name in enumerate(VARIANTS, 1))
    parser.add_argument("--variants", help=f"comma list of numbers (default all): {numbered}")
    parser.add_argument("--json", metavar="PATH", help="write the seconds of every turn here")
    args = parser.parse_args(argv)
    args.steps = args.steps or (80 if args.quick else 400)
    args.repeats = args.repeats or (2 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (8 if args.quick else 20)
    if args.steps % args.block or args.block % 4 or args.warmup % 4:
        parser.error("--block and --warmup must be multiples of 4, --steps one of --block")
    names = list(VARIANTS)
    picked = args.variants.split(",") if args.variants else range(1, len(names) + 1)
    args.variants = [names[int(number) - 1] for number in picked]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    data = collect(args)
    print(
        f"Training-step throughput, {WORLD_SIZE} CPU processes (gloo), MLP {IN}-{args.hidden}x3-"
        f"{CLASSES}, batch {BATCH}/rank, AdamW; {args.warmup} warm-up steps, turns of"
        f" {args.block} steps, medians of {args.repeats} repetitions"
        f" ({time.perf_counter() - started:.0f} s in all)"
    )
    print("\n".join(format_report(data, args.steps, args.block)))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **data}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
