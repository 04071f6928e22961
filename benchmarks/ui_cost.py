"""What showing a run costs the kernel: the live dashboard vs text-only vs no output.

What is measured
----------------
A real Jupyter kernel (ipykernel, started with jupyter_client; this script plays the
frontend and reads every IOPub message) runs ``nbaccel.notebook_launcher(train,
num_processes=2, ...)`` as a notebook cell would. In ``train``, every step of both ranks
prints a line (with the worker's clock in it), rank 0 logs a metric
(``nbaccel.log_metrics``) and advances a ``tqdm`` bar; a step is ``--compute-ms`` of matrix
products then a sleep to keep ``--rate`` steps/s, so the workers leave the kernel its CPU.
Three variants, taking turns (the order rotates each round) after one unmeasured dashboard
launch (it starts nbaccel's helper and loads matplotlib in the kernel):

* **dashboard**: ``dashboard=True``, the widget dashboard at its default rates (text
  ≤ 10 Hz, PNG frames 2 Hz, memory sampled every second);
* **text**: ``dashboard=False``, rank 0's lines printed into the cell (ipykernel's stdout);
* **none**: ``dashboard=False`` with the kernel's stdout sent to a sink that drops
  everything: the launcher's own cost (the pump thread, events, ``run_dir`` files).

For each launch the kernel reports:

* **kernel CPU**: ``time.process_time()`` of the kernel process (every thread: the run's
  pump, the dashboard's UI and memory threads, ipykernel's IOPub thread), per second of
  wall time, over the steady part of the run (first to last step line received). "UI
  cost" = a variant's CPU minus the **none** variant's in the same round.
* **print → event**: for each of rank 0's step lines, the time from the worker's
  ``print`` to the ``LogLine`` event reaching a run subscriber in the kernel (the same
  pump-thread call that hands it to the dashboard or the text printer).
* **frames** (dashboard only): wall and thread-CPU time of each PNG render on the UI
  thread (the curve with every logged point, the memory bars), timed by wrapping
  ``nbaccel.ui.dashboard.plots``' ``CurvePlot.render`` and ``MemoryBars.render`` in the
  kernel, apart
  for frames that only blit the data onto the cached axes and frames that redraw the axes
  (the data left them: a few per launch). The dashboard's UI thread CPU is also split into
  applying events, text writes and frames (its private methods, wrapped the same way).

The frontend side counts IOPub messages per second (mean and the busiest second; the
Jupyter server drops messages above ~1000/s, FACTS.md) and their bytes. Separately, in
this script's own process (no kernel, no workers competing), the dashboard's plots render a
1000-point curve and 8 memory bars ``--frames`` times, the case FACTS.md measured.

Reading the output
------------------
Medians over the rounds (min-max beside them); latency percentiles pool every step line of
every round. The goals (issue 5): kernel-side UI cost ≤ 5 % of one core at the default
rates, a frame ≤ 15 ms (judged on thread CPU, for blitted frames and for every frame),
print → event p95 ≤ 50 ms. The machine is shared: compare runs.

Usage::

    python benchmarks/ui_cost.py              # 5 rounds x 3 variants x 6 s, ~2 min
    python benchmarks/ui_cost.py --quick      # 2 rounds x 3 s, < 1 min
    python benchmarks/ui_cost.py --rate 200 --seconds 8 --rounds 7
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GOAL_UI_CPU = 0.05  # fraction of one core
GOAL_FRAME_MS = 15.0
GOAL_LATENCY_P95_MS = 50.0
VARIANTS = ("dashboard", "text", "none")
WORLD_SIZE = 2
RESULT_MARK = "UI_COST_RESULT "


# --------------------------------------------------------------------------- worker side


def train(seconds: float, rate: float, compute_ms: float) -> int:
    """Print a stamped line every step on both ranks, log a metric and a tqdm bar on rank 0."""
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    import nbaccel

    rank = dist.get_rank()
    steps = int(seconds * rate)
    a = torch.randn(64, 64)
    bar = tqdm(total=steps, desc="train", disable=rank != 0, file=sys.stderr)
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        busy_until = time.perf_counter() + compute_ms / 1000
        while time.perf_counter() < busy_until:
            a = torch.tanh(a @ a)
        loss = 1.0 / (1.0 + step) + float(a[0, 0]) * 1e-9
        delay = start + (step + 1) / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        print(f"step {step} loss {loss:.5f} sent {time.time():.6f}")
        if rank == 0:
            nbaccel.log_metrics({"loss": loss}, step=step)
        bar.update()
    bar.close()
    dist.barrier()
    return steps


# --------------------------------------------------------------------------- kernel side


class _Probe:
    """A run subscriber: latency of each stamped rank-0 line, CPU at the first and last."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.first: tuple[float, float] | None = None  # (process_time, perf_counter)
        self.last: tuple[float, float] | None = None

    def __call__(self, event: Any) -> None:
        text = getattr(event, "text", "")
        if getattr(event, "rank", None) != 0 or " sent " not in text:
            return
        received = time.time()
        self.latencies.append(received - float(text.rsplit(" sent ", 1)[1]))
        mark = (time.process_time(), time.perf_counter())
        self.first = self.first or mark
        self.last = mark


class _Sink:
    """A stdout that drops everything (the **none** variant)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def _timed(cls: Any, name: str, into: list[list[float]]) -> Iterator[None]:
    """Wrap ``cls.name``: each call appends [wall s, thread CPU s, full redraws] to ``into``
    (full redraws: how much the object's ``full_draws`` counter moved, for plots)."""
    original = getattr(cls, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        started, cpu = time.perf_counter(), time.thread_time()
        draws = getattr(self, "full_draws", 0)
        try:
            return original(self, *args, **kwargs)
        finally:
            redrawn = getattr(self, "full_draws", 0) - draws
            into.append([time.perf_counter() - started, time.thread_time() - cpu, redrawn])

    setattr(cls, name, wrapper)
    try:
        yield
    finally:
        setattr(cls, name, original)


# The dashboard's UI-thread steps (private names, read only to attribute its CPU; a
# renamed one is simply left out of the breakdown).
UI_STEPS = {"apply events": "_drain", "text writes": "_write_text", "frames": "_write_images"}


def measure_in_kernel(
    variant: str, seconds: float, rate: float, compute_ms: float, runs_dir: str
) -> dict[str, Any]:
    """One launch in this kernel, as a notebook cell would do it; what it cost the kernel."""
    import nbaccel
    from nbaccel.launcher.run import Run

    probe = _Probe()
    timings: dict[str, list[list[float]]] = {"curve": [], "memory": []}
    original_start = Run.start

    def start_with_probe(self: Run, *args: Any, **kwargs: Any) -> None:
        self.subscribe(probe)  # after the display's subscriber, before any event
        original_start(self, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        if variant == "dashboard":
            from nbaccel.ui.dashboard import plots
            from nbaccel.ui.dashboard.board import Dashboard

            stack.enter_context(_timed(plots.CurvePlot, "render", timings["curve"]))
            stack.enter_context(_timed(plots.MemoryBars, "render", timings["memory"]))
            for step, method in UI_STEPS.items():
                if hasattr(Dashboard, method):
                    stack.enter_context(_timed(Dashboard, method, timings.setdefault(step, [])))
        if variant == "none":
            stack.enter_context(contextlib.redirect_stdout(_Sink()))  # type: ignore[type-var]
        Run.start = start_with_probe  # type: ignore[method-assign]
        stack.callback(setattr, Run, "start", original_start)
        cpu_started, wall_started = time.process_time(), time.perf_counter()
        nbaccel.notebook_launcher(
            train,
            args=(seconds, rate, compute_ms),
            num_processes=WORLD_SIZE,
            dashboard=variant == "dashboard",
            runs_dir=runs_dir,
        )
        cpu_call, wall_call = time.process_time() - cpu_started, time.perf_counter() - wall_started
    if probe.first is None or probe.last is None or probe.last[1] <= probe.first[1]:
        raise RuntimeError(f"{variant}: the probe saw {len(probe.latencies)} step lines")
    return {
        "variant": variant,
        "cpu_per_s": (probe.last[0] - probe.first[0]) / (probe.last[1] - probe.first[1]),
        "call_cpu_s": cpu_call,
        "call_wall_s": wall_call,
        "latencies": probe.latencies,
        "timings": timings,
    }


def kernel_cell(variant: str, args: argparse.Namespace, runs_dir: str) -> str:
    """The code cell the kernel runs for one launch; it prints one JSON result line."""
    call = (
        f"{measure_in_kernel.__name__}({variant!r}, {args.seconds!r}, {args.rate!r}, "
        f"{args.compute_ms!r}, {runs_dir!r})"
    )
    return f"print({RESULT_MARK!r} + __import__('json').dumps(ui_cost.{call}))"


def setup_cell() -> str:
    """Import this file in the kernel; its ``train`` travels to workers by value."""
    here = Path(__file__).resolve()
    return (
        "import importlib.util, sys, cloudpickle\n"
        f"spec = importlib.util.spec_from_file_location('ui_cost', {str(here)!r})\n"
        "ui_cost = importlib.util.module_from_spec(spec)\n"
        "sys.modules['ui_cost'] = ui_cost\n"
        "spec.loader.exec_module(ui_cost)\n"
        "cloudpickle.register_pickle_by_value(ui_cost)  # workers cannot import it\n"
    )


# --------------------------------------------------------------------------- the frontend


class Kernel:
    """A kernel and a client that executes cells and reads every IOPub message."""

    def __init__(self, cwd: str) -> None:
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=cwd)

    def execute(self, code: str, timeout: float = 300.0) -> dict[str, Any]:
        """Run a cell; its stdout, any error, and the IOPub traffic while it ran."""
        msg_id = self.client.execute(code)
        stdout: list[str] = []
        arrivals: list[float] = []
        sizes: list[int] = []
        kinds: dict[str, int] = {}
        error = None
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the kernel did not finish within {timeout} s") from None
            kind = msg["msg_type"]
            content = msg["content"]
            if kind not in ("status", "execute_input"):
                arrivals.append(time.monotonic())
                size = len(json.dumps(content, default=str))
                sizes.append(size + sum(len(b) for b in msg.get("buffers") or []))
                kinds[kind] = kinds.get(kind, 0) + 1
            is_ours = msg["parent_header"].get("msg_id") == msg_id
            if kind == "stream" and content["name"] == "stdout" and is_ours:
                stdout.append(content["text"])
            elif kind == "error" and is_ours:
                error = "\n".join(content["traceback"])
            elif kind == "status" and content["execution_state"] == "idle" and is_ours:
                break
        if error is not None:
            raise RuntimeError(f"the kernel raised:\n{error}")
        return {"stdout": "".join(stdout), "arrivals": arrivals, "sizes": sizes, "kinds": kinds}

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def iopub_rates(traffic: dict[str, Any]) -> dict[str, float]:
    """Messages per second (mean, busiest 1-s window) and kB per second of one cell."""
    arrivals = traffic["arrivals"]
    if len(arrivals) < 2:
        return {"msgs_per_s": 0.0, "peak_msgs_per_s": float(len(arrivals)), "kb_per_s": 0.0}
    span = max(arrivals[-1] - arrivals[0], 1e-9)
    peak, low = 0, 0
    for high, now in enumerate(arrivals):
        while now - arrivals[low] > 1.0:
            low += 1
        peak = max(peak, high - low + 1)
    return {
        "msgs_per_s": len(arrivals) / span,
        "peak_msgs_per_s": float(peak),
        "kb_per_s": sum(traffic["sizes"]) / span / 1000,
    }


def collect(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Every round's result per variant, measured in one kernel."""
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory(prefix="ui_cost-") as folder:
        kernel = Kernel(folder)
        try:
            kernel.execute(setup_cell())
            print("warm-up launch (nbaccel helper, matplotlib)", file=sys.stderr, flush=True)
            warm_up = argparse.Namespace(**{**vars(args), "seconds": 1.0})
            kernel.execute(kernel_cell("dashboard", warm_up, folder))  # imports, caches
            for round_ in range(args.rounds):
                shift = round_ % len(args.variants)
                for variant in args.variants[shift:] + args.variants[:shift]:
                    print(
                        f"round {round_ + 1}/{args.rounds}: {variant}", file=sys.stderr, flush=True
                    )
                    traffic = kernel.execute(kernel_cell(variant, args, folder))
                    line = next(
                        line
                        for line in traffic["stdout"].splitlines()
                        if line.startswith(RESULT_MARK)
                    )
                    result = json.loads(line[len(RESULT_MARK) :])
                    result.update(iopub_rates(traffic), round=round_, kinds=traffic["kinds"])
                    results[variant].append(result)
        finally:
            kernel.close()
    return results


# --------------------------------------------------------------------------- in-process frames


def frame_times(count: int) -> dict[str, list[list[float]]]:
    """[wall, CPU] seconds per frame rendered here, without a kernel or workers: a 1000-point
    curve and 8 memory bars (FACTS.md's case), the first two frames (axes) left out."""
    from nbaccel.ui.dashboard import plots
    from nbaccel.ui.dashboard.model import MemoryReading

    curve, bars = plots.CurvePlot(), plots.MemoryBars()
    steps = list(range(1000))
    values = [1.0 / (1 + 0.01 * s) for s in steps]
    gib = 2**30
    timings: dict[str, list[list[float]]] = {"curve": [], "memory": []}
    for frame in range(count + 2):
        steps.append(1000 + frame)
        values.append(values[-1] * 0.999)
        readings = [
            MemoryReading(f"cuda:{i}", int((10 + i + frame % 5) * gib), 20 * gib, 80 * gib)
            for i in range(8)
        ]
        for name, render, data in (
            ("curve", curve.render, ("loss", steps, values)),
            ("memory", bars.render, (readings,)),
        ):
            started, cpu = time.perf_counter(), time.thread_time()
            render(*data)
            if frame >= 2:
                timings[name].append([time.perf_counter() - started, time.thread_time() - cpu])
    return timings


# --------------------------------------------------------------------------- report


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _spread(values: list[float], scale: float, fmt: str) -> str:
    return f"{statistics.median(values) * scale:{fmt}} ({min(values) * scale:{fmt}}-" + (
        f"{max(values) * scale:{fmt}})"
    )


def format_report(
    results: dict[str, list[dict[str, Any]]], frames: dict[str, list[list[float]]]
) -> list[str]:
    lines = [
        "",
        f"{'variant':<11}{'kernel CPU % of a core':>24}{'UI cost, % (vs none)':>22}"
        f"{'IOPub msg/s (peak)':>20}{'kB/s':>7}{'print->event p50/p95 ms':>25}",
        "-" * 109,
    ]
    none_by_round = {r["round"]: r["cpu_per_s"] for r in results.get("none", [])}
    ui_cost: dict[str, float] = {}
    latency_p95: dict[str, float] = {}
    for variant, runs in results.items():
        cpu = _spread([r["cpu_per_s"] for r in runs], 100, ".1f")
        extra = [
            r["cpu_per_s"] - none_by_round[r["round"]] for r in runs if r["round"] in none_by_round
        ]
        cost = "-"
        if extra and variant != "none":
            ui_cost[variant] = statistics.median(extra)
            cost = _spread(extra, 100, "+.1f")
        rate = statistics.median(r["msgs_per_s"] for r in runs)
        peak = max(r["peak_msgs_per_s"] for r in runs)
        kbs = statistics.median(r["kb_per_s"] for r in runs)
        pooled = [x for r in runs for x in r["latencies"]]
        latency_p95[variant] = _percentile(pooled, 0.95)
        latency = f"{_percentile(pooled, 0.5) * 1e3:.1f} / {latency_p95[variant] * 1e3:.1f}"
        lines.append(
            f"{variant:<11}{cpu:>24}{cost:>22}{f'{rate:.0f} ({peak:.0f})':>20}{kbs:>7.0f}"
            f"{latency:>25}"
        )
    call = ", ".join(
        f"{v} {statistics.median(r['call_cpu_s'] for r in runs):.2f} s CPU / "
        f"{statistics.median(r['call_wall_s'] for r in runs):.1f} s"
        for v, runs in results.items()
    )
    lines += ["", f"whole call (launch to return, kernel CPU / wall, medians): {call}"]
    dash = results.get("dashboard", [])
    live = {part: [x for r in dash for x in r["timings"][part]] for part in ("curve", "memory")}
    lines += [
        "",
        f"{'frame render, ms':<36}{'n':>5}{'wall p50':>10}{'p95':>7}{'max':>7}"
        f"{'CPU p50':>9}{'p95':>7}",
    ]
    frame_cpu_p95 = 0.0
    rows: list[tuple[str, list[list[float]]]] = []
    for part in ("curve", "memory"):
        blitted = [t for t in live[part] if not t[2]]
        redrawn = [t for t in live[part] if t[2]]
        rows += [(f"live {part}, blitted (kernel)", blitted)]
        rows += [(f"live {part}, axes redrawn (kernel)", redrawn)]
    rows += [
        ("1000-pt curve (alone)", frames["curve"]),
        ("8 memory bars (alone)", frames["memory"]),
    ]
    for label, times in rows:
        if not times:
            lines.append(f"{label:<36}{0:>5}")
            continue
        wall, cpu = [t[0] * 1e3 for t in times], [t[1] * 1e3 for t in times]
        if "blitted" in label:
            frame_cpu_p95 = max(frame_cpu_p95, _percentile(cpu, 0.95))
        lines.append(
            f"{label:<36}{len(times):>5}{statistics.median(wall):>10.1f}"
            f"{_percentile(wall, 0.95):>7.1f}{max(wall):>7.1f}{statistics.median(cpu):>9.1f}"
            f"{_percentile(cpu, 0.95):>7.1f}"
        )
    if dash:
        per_run = statistics.median(sum(t[2] for t in r["timings"]["curve"]) for r in dash)
        lines.append(f"full redraws of the curve per launch (median): {per_run:.0f}")
        shares = []
        for step in UI_STEPS:
            if all(step in r["timings"] for r in dash):
                cpu_s = statistics.median(
                    sum(t[1] for t in r["timings"][step]) / r["call_wall_s"] for r in dash
                )
                shares.append(f"{step} {cpu_s:.1%}")
        if shares:
            lines.append("dashboard UI thread, CPU % of a core over the call: " + ", ".join(shares))
    lines.append("")
    for variant, cost in ui_cost.items():
        verdict = "PASS" if cost <= GOAL_UI_CPU else "MISS"
        lines.append(
            f"goal: {variant} UI cost <= {GOAL_UI_CPU:.0%} of one core: {cost:+.1%}  {verdict}"
        )
    every = [t[1] * 1e3 for part in ("curve", "memory") for t in live[part]]
    for what, p95 in (
        ("blitted", frame_cpu_p95),
        ("every", _percentile(every, 0.95) if every else 0),
    ):
        if p95:
            verdict = "PASS" if p95 <= GOAL_FRAME_MS else "MISS"
            lines.append(
                f"goal: live frame CPU p95 <= {GOAL_FRAME_MS:.0f} ms, {what} frame: {p95:.1f} ms"
                f"  {verdict}"
            )
    for variant, p95 in latency_p95.items():
        verdict = "PASS" if p95 * 1e3 <= GOAL_LATENCY_P95_MS else "MISS"
        lines.append(
            f"goal: {variant} print -> event p95 <= {GOAL_LATENCY_P95_MS:.0f} ms: "
            f"{p95 * 1e3:.1f} ms  {verdict}"
        )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, help="rounds of every variant (5)")
    parser.add_argument("--seconds", type=float, help="training seconds per launch (6)")
    parser.add_argument("--rate", type=float, default=100.0, help="steps/s per rank (100)")
    parser.add_argument("--compute-ms", type=float, default=3.0, help="compute per step (3)")
    parser.add_argument("--frames", type=int, default=50, help="in-process frames (50)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds x 3 s")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list")
    parser.add_argument("--json", metavar="PATH", help="write every measurement here")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.seconds = args.seconds or (3.0 if args.quick else 6.0)
    args.variants = [v.strip() for v in args.variants.split(",")]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    results = collect(args)
    frames = frame_times(args.frames)
    print(
        f"Kernel-side cost of showing a run: {WORLD_SIZE} CPU processes, each printing a line"
        f" every step at {args.rate:.0f} steps/s ({args.compute_ms:g} ms compute + sleep),"
        f" rank 0 logging a metric and a tqdm bar; {args.seconds:g} s per launch, medians of"
        f" {args.rounds} rounds ({time.perf_counter() - started:.0f} s in all)"
    )
    print("\n".join(format_report(results, frames)))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "results": results, "frames": frames}) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
