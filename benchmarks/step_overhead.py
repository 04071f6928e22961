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
  reports MULTI_CPU with 2 processes and the launch's accumulation steps).

The **step-time breakdown** (issue 16: at most 1 % of a step) is on in every launched worker,
so the nbaccel rows include it. Its cost has its own launch per repetition: one **nbaccel**
loop (the same model, loader and ``log`` every step) whose breakdown is switched on and off
step by step (``acc.strategy.step_timer.enabled``), in rounds of three steps: **on**, **off**,
**on again** (order rotated every round). The arms share every object (model, optimizer,
loader, allocator and GC state): only the switch differs. Each step is timed on rank 0
(``perf_counter``) and by both ranks' own main-thread CPU time (``thread_time``, summed), and
compared with the other arms' steps of the same round, a few milliseconds apart: the drift of
a shared machine cancels. **on vs off** is the cost; **on again vs on** is a null test (two
identical arms) whose interval shows what the run can resolve. Both are the median of the
per-round log ratios, with a 95 % bootstrap interval over the rounds; "us/step" is the paired
median difference. Alternating single steps keeps the breakdown's real work per step (a
step is closed at the next batch request, a window sent every 0.5 s of wall time). Rank 0
also runs the marks of one step (a batch requested and handed out, ``backward`` with the
reduction watch, clipping, ``step``, ``zero_grad``) around a tiny backward on a timer
switched on and off, in thread CPU time (min of 5 runs of 1,000 steps): the marks alone, with
warm caches (in a real loop each mark runs after the model's compute, with cold caches, so
they cost more there: the paired figures are the honest ones).

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
The breakdown lines say what each interval is; the goal line passes only if the wall-time
interval of "on vs off" ends at or below 1 %, and says NOT RESOLVED if it contains 1 %.

Usage::

    python benchmarks/step_overhead.py               # 400 steps x 10 repetitions, 5-8 min
    python benchmarks/step_overhead.py --quick       # smoke run, < 60 s
    python benchmarks/step_overhead.py --variants none --breakdown-rounds 600  # breakdown only
    python benchmarks/step_overhead.py --steps 600 --repeats 10 --hidden 512
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import random
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
}
BREAKDOWN_ARMS = ("on", "off", "on again")  # "on again": the null test against "on"
REFERENCE = {1: "raw DDP", 4: "raw DDP, no_sync"}
NO_SYNC_PAIRS = (
    ("raw DDP, sync every micro-step", "raw DDP, no_sync"),
    ("nbaccel, accumulate() (syncs)", "nbaccel, accumulate(model)"),
)
Step = Callable[[Any, Any, int], None]


# --------------------------------------------------------------------------- worker side


def make_variant(name: str, data: Any, hidden: int) -> tuple[Step, Any, str, Any]:
    """The step function, batch iterator, self-report and step timer (nbaccel's; else None)
    of one variant, freshly built."""
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

        return raw_step, iter(loader), "", None
    if framework == "nbaccel":
        from nbaccel import Accelerator
    else:
        from accelerate import Accelerator  # type: ignore[import-untyped]
    acc = Accelerator()  # accumulation steps come from the launch, as in a notebook
    timer = acc.strategy.step_timer if framework == "nbaccel" else None
    if timer is not None and not timer.enabled:
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

    return step, iter(loader), "{}, {} processes, accumulation {}".format(*seen), timer


def dataset(steps: int) -> Any:
    """Fixed random samples for ``steps`` steps of every rank."""
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(0)
    samples = steps * BATCH * WORLD_SIZE
    return TensorDataset(
        torch.randn(samples, IN, generator=generator),
        torch.randint(0, CLASSES, (samples,), generator=generator),
    )


def train(names: list[str], steps: int, warmup: int, block: int, hidden: int) -> dict[str, Any]:
    """All ``names`` in turns of ``block`` steps; rank 0's seconds per variant and turn."""
    import torch.distributed as dist

    data = dataset(warmup + steps)
    built = {name: make_variant(name, data, hidden) for name in names}
    done = dict.fromkeys(names, 0)
    seconds: dict[str, list[float]] = {name: [] for name in names}

    def run(name: str, count: int) -> None:
        step, batches = built[name][:2]
        for _ in range(count):
            x, y = next(batches)
            step(x, y, done[name])
            done[name] += 1

    for name in names:
        run(name, warmup)
    for turn in range(steps // block):
        shift = turn % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            started = time.perf_counter()
            run(name, block)
            dist.barrier()
            seconds[name].append(time.perf_counter() - started)
    return {"seconds": seconds, "info": {name: built[name][2] for name in names}}


def breakdown_steps(rounds: int, warmup: int, hidden: int) -> dict[str, Any]:
    """One nbaccel loop, its breakdown switched per step: ``BREAKDOWN_ARMS`` in rounds (order
    rotated); per arm and round, rank 0's wall seconds and both ranks' main-thread CPU."""
    import torch.distributed as dist

    arms = list(BREAKDOWN_ARMS)
    data = dataset(warmup + rounds * len(arms))
    step, batches, _info, timer = make_variant("nbaccel", data, hidden)
    wall: dict[str, list[float]] = {arm: [] for arm in arms}
    cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    for index in range(warmup):
        step(*next(batches), index)
    dist.barrier()  # no barrier per step: DDP's all-reduce keeps the ranks in step
    for turn in range(rounds):
        shift = turn % len(arms)
        for arm in arms[shift:] + arms[:shift]:
            timer.enabled = arm != "off"  # before the batch request: the whole step is one arm's
            started, cpu_started = time.perf_counter(), time.thread_time()
            step(*next(batches), warmup + turn)
            cpu[arm].append(time.thread_time() - cpu_started)
            wall[arm].append(time.perf_counter() - started)
    timer.enabled = True
    ranks_cpu: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(ranks_cpu, cpu)
    summed = {
        arm: [sum(ranks) for ranks in zip(*(r[arm] for r in ranks_cpu), strict=True)]
        for arm in arms
    }
    return {"wall": wall, "cpu": summed, "marks_us": marks_cost()}


def marks_cost(runs: int = 5, steps: int = 1000) -> float:
    """Microseconds of CPU time the step timer's marks add to one DDP step (see above)."""
    import torch

    from nbaccel.accel.tracking.step_timing import BACKWARD, OPTIMIZER, StepTimer

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
    """Per variant, the seconds of each turn, repetition after repetition; self-reports; per
    breakdown arm, the seconds (wall, CPU) of each step, repetition after repetition."""
    import nbaccel

    seconds: dict[str, list[list[float]]] = {name: [] for name in args.variants}
    info: dict[str, str] = {}
    breakdown: dict[str, Any] = {"wall": {}, "cpu": {}, "marks_us": []}
    sections = sorted({VARIANTS[name][1] for name in args.variants})
    with tempfile.TemporaryDirectory(prefix="step_overhead-") as runs_dir:

        def launch(what: str, function: Callable[..., Any], *arguments: Any, **config: Any) -> Any:
            print(f"repetition {what}", file=sys.stderr, flush=True)
            return nbaccel.notebook_launcher(
                function,
                args=arguments,
                num_processes=WORLD_SIZE,
                runs_dir=runs_dir,
                log_ranks="0",
                **config,
            )

        for repeat in range(args.repeats):
            for accumulation in sections:
                names = [n for n in args.variants if VARIANTS[n][1] == accumulation]
                result = launch(
                    f"{repeat + 1}/{args.repeats}, accumulation {accumulation}",
                    train,
                    *(names, args.steps, args.warmup, args.block, args.hidden),
                    gradient_accumulation_steps=accumulation,
                )
                for name in names:
                    seconds[name].append(result["seconds"][name])
                info.update(result["info"])
            if args.breakdown_rounds:
                result = launch(
                    f"{repeat + 1}/{args.repeats}, step-time breakdown on/off",
                    breakdown_steps,
                    *(args.breakdown_rounds, args.warmup, args.hidden),
                )
                for clock in ("wall", "cpu"):
                    for arm, times in result[clock].items():
                        breakdown[clock].setdefault(arm, []).append(times)
                breakdown["marks_us"].append(result["marks_us"])
    return {"seconds": seconds, "info": info, "breakdown": breakdown}


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
    lines += breakdown_report(data["breakdown"], seconds)
    return lines


def breakdown_report(data: dict[str, Any], seconds: dict[str, list[list[float]]]) -> list[str]:
    """The step-time breakdown's cost: on vs off and the null test (on again vs on), paired
    per round, in rank 0's wall time and both ranks' CPU time; the marks alone; the goal."""
    wall, cpu = data["wall"], data["cpu"]
    if not wall:
        return []
    rounds = len(list(itertools.chain(*wall["on"])))
    step = statistics.median(itertools.chain(*wall["off"]))
    lines = [
        "",
        f"step-time breakdown, switched per step in one nbaccel loop ({rounds} rounds of"
        f" {', '.join(BREAKDOWN_ARMS)}); paired medians, [95 % bootstrap interval]:",
    ]
    costs: dict[str, Interval] = {}
    for times, what in ((wall, "rank 0's wall time"), (cpu, "both ranks' CPU time")):
        cost = costs[what] = Interval(
            paired_values(times, "on", "off", lambda a, b: math.log(a / b))
        )
        null = Interval(paired_values(times, "on again", "on", lambda a, b: math.log(a / b)))
        extra = statistics.median(paired_values(times, "on", "off", lambda a, b: a - b))
        lines.append(
            f"  {what + ':':<22} on vs off {cost.change()}  ({extra * 1e6:+.0f} us/step);"
            f"  null test, on again vs on {null.change()}"
        )
    # The breakdown is work on each rank's main thread: what it adds to a rank's CPU time
    # is what it can add to a step, resolved far better than the wall time on a shared box.
    share = Interval(paired_values(cpu, "on", "off", lambda a, b: (a - b) / WORLD_SIZE / step))
    marks = statistics.median(data["marks_us"])
    wall_verdict = verdict(costs["rank 0's wall time"], BREAKDOWN_GOAL, math.log1p)
    lines += [
        f"  a rank's extra CPU per step, over the wall step ({step * 1e6:.0f} us, off):"
        f" {share.percent()}",
        f"  the marks alone, warm caches (rank 0): {marks:.1f} us of CPU per step,"
        f" {marks / step / 1e4:.2f} % of the wall step",
        f"goal: the breakdown costs <= {100 * BREAKDOWN_GOAL:.0f} % of a step:"
        f" wall time, on vs off: {wall_verdict};"
        f" a rank's extra CPU over the wall step: {verdict(share, BREAKDOWN_GOAL)}",
    ]
    if "accelerate" in seconds and "nbaccel" in seconds:
        ahead = paired(seconds["accelerate"], seconds["nbaccel"], lambda them, us: them / us)
        lines.append(f"nbaccel (breakdown on) vs accelerate: {ahead:.3f} x steps/s")
    return lines


class Interval:
    """The median of paired values with its 95 % bootstrap interval (resampled pairs)."""

    def __init__(self, values: list[float], resamples: int = 1000) -> None:
        self.median = statistics.median(values)
        draw = random.Random(0)
        medians = sorted(
            statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples)
        )
        self.low = medians[int(0.025 * resamples)]
        self.high = medians[int(0.975 * resamples)]

    def percent(self, scale: Callable[[float], float] = lambda x: x) -> str:
        low, median, high = (100 * scale(x) for x in (self.low, self.median, self.high))
        return f"{median:+.2f} % [{low:+.2f}, {high:+.2f}]"

    def change(self) -> str:
        """Log ratios (symmetric for faster and slower) as a change in per cent."""
        return self.percent(math.expm1)


def verdict(interval: Interval, goal: float, scale: Callable[[float], float] = lambda x: x) -> str:
    """PASS if the whole interval is within ``goal`` (in ``scale``: log for log ratios)."""
    if interval.high <= scale(goal):
        return "PASS"
    return "MISS" if interval.low > scale(goal) else "NOT RESOLVED (the interval contains it)"


def paired_values(
    times: dict[str, list[list[float]]], arm: str, reference: str, how: Callable[..., float]
) -> list[float]:
    """``how(arm's, reference's)`` for each round of every repetition."""
    pairs = zip(itertools.chain(*times[arm]), itertools.chain(*times[reference]), strict=True)
    return [how(a, b) for a, b in pairs]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="timed steps per variant and repetition (400)")
    parser.add_argument("--repeats", type=int, help="repetitions, one launch per section (10)")
    parser.add_argument("--warmup", type=int, help="untimed steps per variant first (20)")
    parser.add_argument("--block", type=int, default=20, help="steps per turn (20)")
    parser.add_argument("--hidden", type=int, default=256, help="MLP width (256)")
    parser.add_argument(
        "--breakdown-rounds",
        type=int,
        help="rounds of the breakdown's on / off / on again steps per repetition (200; 0: none)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 60 steps x 2")
    numbered = ", ".join(f"{i} {name}" for i, name in enumerate(VARIANTS, 1))
    parser.add_argument(
        "--variants", help=f"comma list of numbers (default all; 'none'): {numbered}"
    )
    parser.add_argument("--json", metavar="PATH", help="write the seconds of every turn here")
    parser.add_argument("--from-json", metavar="PATH", help="report a run saved by --json again")
    args = parser.parse_args(argv)
    args.steps = args.steps or (60 if args.quick else 400)
    args.repeats = args.repeats or (2 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (8 if args.quick else 20)
    if args.breakdown_rounds is None:
        args.breakdown_rounds = 20 if args.quick else 200
    if args.steps % args.block or args.block % 4 or args.warmup % 4:
        parser.error("--block and --warmup must be multiples of 4, --steps one of --block")
    names = list(VARIANTS)
    picked = args.variants.split(",") if args.variants else range(1, len(names) + 1)
    picked = [] if args.variants == "none" else picked
    args.variants = [names[int(number) - 1] for number in picked]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        data, args = saved, argparse.Namespace(**saved.pop("args"))
    else:
        data = collect(args)
    print(
        f"Training-step throughput, {WORLD_SIZE} CPU processes (gloo), MLP {IN}-{args.hidden}x3-"
        f"{CLASSES}, batch {BATCH}/rank, AdamW; {args.warmup} warm-up steps, turns of"
        f" {args.block} steps, medians of {args.repeats} repetitions; breakdown:"
        f" {args.breakdown_rounds} rounds per repetition"
        f" ({time.perf_counter() - started:.0f} s in all)"
    )
    print("\n".join(format_report(data, args.steps, args.block)))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **data}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
