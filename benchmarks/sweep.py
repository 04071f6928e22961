"""Sweeps: ``nbaccel.sweep`` against the same trials one after the other, Optuna's threads and
Ray Tune, and a model of the packing on a simulated 8-device box.

The trials: 16 learning rates (log-spaced, 1e-3 to 1e-1) of one small MLP (16 -> 128 -> 128
-> 1, SGD with momentum, batches of 128 from 8,192 points held in the driver, the "kernel":
every trial reads them from it) trained ``--steps`` steps (~1 s on one core of an idle
machine), one process each, on CPU. Each trial measures its own training loop (``compute``)
and keeps torch to one thread (``torch.set_num_threads(1)``): one core per trial.

1. **nbaccel.sweep vs a loop.** ``nbaccel.sweep(trial, configs, use_cpu=True,
   dashboard="text")`` (2 CPU slots on 2 cores), call -> returned, against the same 16
   trials run one after the other with ``nbaccel.notebook_launcher(trial, args=(config,),
   num_processes=1, use_cpu=True)`` in a loop. Goal: sweep <= 0.55 x the loop.
2. **Per-trial overhead.** sweep wall x slots / trials - the median ``compute`` of a trial in
   the loop (alone on the machine), and from the runs' own timings: each trial's seconds as
   the sweep saw them (slot taken -> ended) minus its ``compute``, median. Against a warm
   launch: ``nbaccel.notebook_launcher(noop, num_processes=1, use_cpu=True)``, call ->
   returned, median of 5. The launch's part: each trial's seconds minus the function's own
   (``inside``: entry to return, the model built and the metric logged as well as the loop),
   median; goal: that <= a warm launch, of ``noop`` and of the same trial alone (the loop's
   wall / trials - the function's own; beside it the loop's wall / trials - compute).
3. **Peers.** Optuna's own ``study.optimize(objective, n_trials=16, n_jobs=2)``: the same
   training in the driver's threads (each trial a ``GridSampler`` point; torch set to one
   thread for it), call -> returned. Ray Tune (``--ray-python PATH``: a Python with ray and
   torch; ray is no dependency of nbaccel): this script run there with ``--ray-child``, which
   times ``ray.init(num_cpus=2)`` and ``tune.Tuner(tune.with_resources(
   tune.with_parameters(trainable, X, Y), {"cpu": 1}), param_space={"lr":
   tune.grid_search(...)}).fit()`` separately.
4. **Threads as the launch sets them.** Each 1-process CPU trial gets ``OMP_NUM_THREADS`` =
   the cores (2 here), so two trials at once run four threads on two cores. The same sweep of
   4 trials with the trial leaving torch's threads alone, against 4 trials at one thread.
5. **Packing on a simulated 8-device box** (no processes: an event simulation on
   ``nbaccel.sweeps.packing.Packer(devices=range(8), per_trial=k)``): 64 trials whose
   durations are drawn once (log-normal, median 60 s, seeded) and kept for each k; a trial
   takes the lowest free slot as the sweep's loop does and gives it back when it ends.
   Utilisation = device-seconds busy / (8 x the makespan); idle = devices in no slot.

Medians over ``--rounds`` (parts 1-4; the loop and the sweep alternate which goes first). On a
shared 2-core machine the load moves everything: the ratios within a round are what to read.

Usage::

    python benchmarks/sweep.py --rounds 3                      # ~3 min
    python benchmarks/sweep.py --rounds 1 --ray-python /tmp/ray-venv/bin/python
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_util import median, progress, verdict

TRIALS = 16
LRS = [round(10 ** (-3 + 2 * i / (TRIALS - 1)), 6) for i in range(TRIALS)]
STEPS = 1500
SHAPE = {"points": 8192, "inputs": 16, "hidden": 128, "batch": 128}
GOAL_RATIO = 0.55
SLOTS = 2

_generator = torch.Generator().manual_seed(0)
X = torch.randn(SHAPE["points"], SHAPE["inputs"], generator=_generator)
Y = torch.sin(X[:, :1]) + 0.1 * torch.randn(SHAPE["points"], 1, generator=_generator)


def fit(config: dict[str, Any], x: Any = None, y: Any = None) -> dict[str, float]:
    """Train the MLP ``config["steps"]`` steps at ``config["lr"]``: the loss and the loop's
    seconds. ``threads``: torch's intra-op threads (None: leave them as the process has)."""
    import time

    import torch

    x, y = (X, Y) if x is None else (x, y)
    if config.get("threads") is not None:
        torch.set_num_threads(config["threads"])
    torch.manual_seed(0)
    hidden, batch = SHAPE["hidden"], SHAPE["batch"]
    model = torch.nn.Sequential(
        torch.nn.Linear(SHAPE["inputs"], hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 1),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    started = time.perf_counter()
    for step in range(config["steps"]):
        index = (step * batch) % len(x)
        loss = torch.nn.functional.mse_loss(
            model(x[index : index + batch]), y[index : index + batch]
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {"loss": float(loss.item()), "compute": time.perf_counter() - started}


def trial(config: dict[str, Any]) -> dict[str, float]:
    """One nbaccel trial: fit, its loss logged (the sweep's metric). ``inside``: the function's
    own seconds, entry to return (the model built, the loop, the log), which no launcher owes."""
    import time

    import nbaccel

    entered = time.perf_counter()
    done = fit(config)
    nbaccel.log_metrics({"loss": done["loss"]}, step=config["steps"])
    return {**done, "inside": time.perf_counter() - entered}


def noop() -> int:
    return 0


def configs(steps: int, threads: int | None = 1, count: int = TRIALS) -> list[dict[str, Any]]:
    return [{"lr": lr, "steps": steps, "threads": threads} for lr in LRS[:count]]


# ----------------------------------------------------------------------------- nbaccel


def run_sweep(steps: int, runs_dir: str, threads: int | None = 1, count: int = TRIALS) -> dict:
    import nbaccel

    started = time.perf_counter()
    sweep = nbaccel.sweep(
        trial,
        configs(steps, threads, count),
        metric="loss",
        dashboard="text",
        use_cpu=True,
        runs_dir=runs_dir,
    )
    wall = time.perf_counter() - started
    states = [t.state for t in sweep.trials]
    assert states == ["succeeded"] * count, states
    computes = [run.result()["compute"] for run in sweep.runs]
    insides = [run.result()["inside"] for run in sweep.runs]
    seen = [t.seconds for t in sweep.trials]
    overheads = [s - c for s, c in zip(seen, computes, strict=True) if s is not None]
    launches = [s - i for s, i in zip(seen, insides, strict=True) if s is not None]
    return {
        "wall": wall, "compute": median(computes), "inside": median(insides),
        "seen_overhead": median(overheads), "seen_launch": median(launches),
    }  # fmt: skip


def run_loop(steps: int, runs_dir: str) -> dict:
    import nbaccel

    started = time.perf_counter()
    computes, insides = [], []
    for config in configs(steps):
        done = nbaccel.notebook_launcher(
            trial, args=(config,), num_processes=1, use_cpu=True, dashboard=False, runs_dir=runs_dir
        )
        computes.append(done["compute"])
        insides.append(done["inside"])
    wall = time.perf_counter() - started
    return {"wall": wall, "compute": median(computes), "inside": median(insides)}


def warm_launch(runs_dir: str, times: int = 5) -> float | None:
    import nbaccel

    samples = []
    for _ in range(times):
        started = time.perf_counter()
        nbaccel.notebook_launcher(
            noop, num_processes=1, use_cpu=True, dashboard=False, runs_dir=runs_dir
        )
        samples.append(time.perf_counter() - started)
    return median(samples)


# ----------------------------------------------------------------------------- peers


def run_optuna(steps: int) -> dict:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.GridSampler({"lr": LRS}, seed=0)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    computes: list[float] = []

    def objective(optuna_trial: Any) -> float:
        done = fit({"lr": optuna_trial.suggest_float("lr", LRS[0], LRS[-1]), "steps": steps})
        computes.append(done["compute"])
        return done["loss"]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per trial, as the sweep's trials
    try:
        started = time.perf_counter()
        study.optimize(objective, n_trials=TRIALS, n_jobs=SLOTS)
        wall = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    assert len(study.trials) == TRIALS
    return {"wall": wall, "compute": median(computes)}


def ray_child(steps: int) -> None:
    """In a Python with ray: time ray.init and a Tuner over the same trials; print JSON."""
    import ray
    from ray import tune

    started = time.perf_counter()
    ray.init(num_cpus=SLOTS, include_dashboard=False, log_to_driver=False)
    init = time.perf_counter() - started

    def trainable(config: dict[str, Any], x: Any, y: Any) -> dict[str, float]:
        return fit({"lr": config["lr"], "steps": steps, "threads": 1}, x, y)

    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(trainable, x=X, y=Y), {"cpu": 1}),
        param_space={"lr": tune.grid_search(LRS)},
        tune_config=tune.TuneConfig(num_samples=1, metric="loss", mode="min"),
        run_config=tune.RunConfig(storage_path=tempfile.mkdtemp(prefix="ray-"), verbose=0),
    )
    started = time.perf_counter()
    results = tuner.fit()
    wall = time.perf_counter() - started
    computes = [result.metrics["compute"] for result in results]
    assert len(computes) == TRIALS and not results.errors, results.errors
    print(json.dumps({"init": init, "wall": wall, "compute": median(computes)}))
    ray.shutdown()


def run_ray(python: str, steps: int) -> dict | None:
    command = [python, __file__, "--ray-child", "--steps", str(steps)]
    env = dict(os.environ, RAY_AIR_NEW_OUTPUT="0", PYTHONPATH=str(Path(__file__).parent))
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        progress(f"ray failed ({done.returncode}): {done.stderr[-2000:]}")
        return None
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------- packing


def simulate(per_trial: int, durations: list[float], devices: int = 8) -> dict[str, float]:
    """Run ``durations`` through a Packer as the sweep's loop does: fill every free slot
    (the lowest first), then at each trial's end give its slot back and fill again."""
    from nbaccel.sweeps.packing import Packer

    packer = Packer(devices=range(devices), per_trial=per_trial)
    pending = list(durations)
    running: list[tuple[float, int, Any]] = []  # (end time, tiebreak, slot)
    now, busy, counter = 0.0, 0.0, 0
    while pending or running:
        while pending and (slot := packer.take()) is not None:
            duration = pending.pop(0)
            busy += duration * len(slot.devices)
            heapq.heappush(running, (now + duration, counter, slot))
            counter += 1
        now, _, slot = heapq.heappop(running)
        packer.give(slot)
    used = packer.capacity * per_trial
    return {
        "slots": packer.capacity,
        "idle": devices - used,
        "makespan": now,
        "utilisation": busy / (devices * now),
        "of_used": busy / (used * now),
    }


def packing(seed: int = 0, trials: int = 64) -> list[str]:
    rng = random.Random(seed)
    durations = [60.0 * math.exp(rng.gauss(0.0, 0.5)) for _ in range(trials)]
    lines = [f"5. packing {trials} trials (median 60 s, log-normal sigma 0.5) on 8 devices:"]
    for k in (1, 2, 3):
        r = simulate(k, durations)
        lines.append(
            f"   k={k}: {r['slots']} slots, {r['idle']} devices never used, makespan "
            f"{r['makespan']:.0f} s, utilisation {r['utilisation']:.1%} of 8 "
            f"({r['of_used']:.1%} of the {8 - r['idle']} used)"
        )
    return lines


# ----------------------------------------------------------------------------- report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of parts 1-4")
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per trial")
    parser.add_argument("--ray-python", help="a Python with ray[tune] and torch: measure Ray Tune")
    parser.add_argument("--ray-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ray_child:
        ray_child(args.steps)
        return 0
    import nbaccel  # noqa: F401 - its warm helper starts now, before anything is timed

    load, started = os.getloadavg()[0], time.perf_counter()
    rows: dict[str, list[float]] = {}

    def add(name: str, value: float | None) -> None:
        if value is not None:
            rows.setdefault(name, []).append(value)

    with tempfile.TemporaryDirectory(prefix="sweep-bench-") as runs_dir:
        warm_launch(runs_dir, 2)  # the helper's first forks, untimed
        for index in range(args.rounds):
            progress(f"round {index + 1}/{args.rounds}")
            first, second = (run_sweep, run_loop) if index % 2 == 0 else (run_loop, run_sweep)
            results = {f.__name__: f(args.steps, runs_dir) for f in (first, second)}
            sweep, loop = results["run_sweep"], results["run_loop"]
            add("sweep", sweep["wall"])
            add("loop", loop["wall"])
            add("ratio", sweep["wall"] / loop["wall"])
            add("compute alone", loop["compute"])
            add("compute in sweep", sweep["compute"])
            add("overhead", sweep["wall"] * SLOTS / TRIALS - loop["compute"])
            add("seen overhead", sweep["seen_overhead"])
            add("seen launch", sweep["seen_launch"])
            add("loop overhead", loop["wall"] / TRIALS - loop["compute"])
            add("loop launch", loop["wall"] / TRIALS - loop["inside"])
            add("warm", warm_launch(runs_dir))
            optuna_done = run_optuna(args.steps)
            add("optuna", optuna_done["wall"])
            add("optuna compute", optuna_done["compute"])
            add("optuna ratio", sweep["wall"] / optuna_done["wall"])
            if args.ray_python:
                ray_done = run_ray(args.ray_python, args.steps)
                if ray_done:
                    add("ray", ray_done["wall"])
                    add("ray init", ray_done["init"])
                    add("ray compute", ray_done["compute"])
                    add("ray ratio", sweep["wall"] / ray_done["wall"])
            default = run_sweep(args.steps, runs_dir, threads=None, count=4)
            pinned = run_sweep(args.steps, runs_dir, threads=1, count=4)
            add("default threads", default["wall"])
            add("one thread", pinned["wall"])
            add("default compute", default["compute"])
            add("pinned compute", pinned["compute"])
    print(
        f"Sweeps: {TRIALS} trials of an MLP {SHAPE['inputs']} -> {SHAPE['hidden']} x2 -> 1, "
        f"{args.steps} steps of {SHAPE['batch']}, 1 CPU process each, {SLOTS} slots; "
        f"{os.cpu_count()} CPUs, load average before {load:.2f}, after "
        f"{os.getloadavg()[0]:.2f}; {args.rounds} round(s), {time.perf_counter() - started:.0f} s"
    )
    print("\n".join(report(rows)))
    print("\n".join(packing()))
    return 0


def report(rows: dict[str, list[float]]) -> list[str]:
    def m(name: str) -> float | None:
        return median(rows.get(name, []))

    def s(name: str, unit: str = "s", digits: int = 2) -> str:
        value = m(name)
        if value is None:
            return "-"
        every = ", ".join(f"{v:.{digits}f}" for v in rows[name])
        alone = f"{value:.{digits}f} {unit}"
        return f"{alone} ({every})" if len(rows[name]) > 1 else alone

    ratio, overhead, warm = m("ratio"), m("overhead"), m("warm")
    seen, launch, alone = m("seen overhead"), m("seen launch"), m("loop launch")

    def s3(name: str) -> str:
        return s(name, digits=3)

    lines = [
        f"1. nbaccel.sweep, {TRIALS} trials on {SLOTS} slots        {s('sweep')}",
        f"   the same trials in a notebook_launcher loop    {s('loop')}",
        f"   sweep / loop                                  {s('ratio', 'x')}"
        + (f"  goal <= {GOAL_RATIO}x  {verdict(ratio <= GOAL_RATIO)}" if ratio else ""),
        f"   a trial's compute alone (loop) / in the sweep  {s('compute alone')} / "
        f"{s('compute in sweep')}",
        f"2. per-trial overhead (wall x slots / trials - compute alone)  {s('overhead')}"
        + (f"  goal <= warm launch  {verdict(overhead <= warm)}" if overhead and warm else ""),
        f"   per-trial overhead seen by the sweep (seconds - compute)   {s3('seen overhead')}"
        + (f"  {verdict(seen <= warm)}" if seen and warm else ""),
        f"   the launch's part of it (seconds - the function's own)     {s3('seen launch')}"
        + (f"  <= noop's  {verdict(launch <= warm)}" if launch and warm else "")
        + (f"  <= the trial's  {verdict(launch <= alone)}" if launch and alone else ""),
        f"   warm launch, notebook_launcher(noop), median of 5           {s3('warm')}",
        f"   the loop's per-trial overhead (wall / trials - compute)     {s3('loop overhead')}",
        f"   the loop's launch part (wall / trials - the function's own) {s3('loop launch')}",
        f"3. Optuna study.optimize(n_jobs={SLOTS}), threads in-process     {s('optuna')}"
        f"  (a trial's compute {s('optuna compute')})",
        f"   sweep / Optuna                                              {s('optuna ratio', 'x')}",
    ]
    if "ray" in rows:
        lines += [
            f"   Ray Tune Tuner.fit, {SLOTS} CPUs                             {s('ray')}"
            f"  (+ ray.init {s('ray init')}; a trial's compute {s('ray compute')})",
            f"   sweep / Ray Tune (fit only)                                 {s('ray ratio', 'x')}",
        ]
    else:
        lines.append("   Ray Tune: not measured (no --ray-python)")
    lines += [
        f"4. 4 trials, threads as the launch sets them (2 per trial)     {s('default threads')}"
        f"  (a trial's compute {s('default compute')})",
        f"   4 trials, torch.set_num_threads(1) in the trial            {s('one thread')}"
        f"  (a trial's compute {s('pinned compute')})",
    ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
