"""Runs that outlive their machine: periodic checkpoints, save-and-stop and resume, measured.

An MLP of ~26 M fp32 parameters (512 -> 2048 x7 -> 10; AdamW: a ~300 MiB checkpoint), batch 16
per rank of fixed random data (shuffled DataLoader), 2 CPU processes, nbaccel's
``Accelerator`` in ``while acc.completed_steps < total: for batch in loader: ...``:

1. **Step rate**: ``checkpoint_every`` "auto" with ``checkpoint_dir`` set (15 min: no save in
   a short run, the step agreement still runs) and "10s", against "off" without
   ``checkpoint_dir``; one launch each per round, turns rotated (A B C, B C A, ...); rank 0
   times each step, steps/s over ``--window`` s after ``--warmup`` s. Ratio: median over the
   rounds of the ratio to the same round's "off". Goal >= 0.99 x.
2. **SIGTERM to one rank** (random rank and step, launched from this process): the
   ``stopped`` records of ``events.jsonl`` must all name the step saved at, the run end
   ``stopped``, exit code 0. Reported: signal -> ``run.wait()`` returned, less the write (the
   ``checkpoint`` record's seconds). Goal <= 5 s plus the write.
3. **SIGKILL of everything**: a "kernel" process (this script, ``--kernel``) launches with
   ``checkpoint_every="20 steps"``; at a random step after a save, the driver SIGKILLs it and
   all its descendants (psutil: nbaccel's helper, the workers). The same launch with
   ``resume="auto"`` in a fresh kernel process must resume at the newest save and end with
   parameters bit-identical (sha256) to an uninterrupted run's. Reported: launch call ->
   first resumed step, over the time to load the state folder's files (``torch.load``, in a
   fresh process with torch imported). Goal <= 1.2 x. Beside it: a fresh launch -> first step
   (median of the uninterrupted and the killed run): what any launch costs here.
4. **Accelerate's hand-written resume**: ``accelerate.notebook_launcher`` (CPU, fork), the same
   model, ``save_state`` at step 20; in a fresh kernel process ``load_state`` +
   ``skip_first_batches`` and one step: launch call -> first resumed step. Lightning's
   SIGTERM path only where ``lightning`` imports (not installed here: skipped).

Kernels are plain processes here, each launching once: no helper prewarmed by ``import
nbaccel`` in a Jupyter kernel, so every launch -> first step includes starting nbaccel's helper.
On a shared 2-core machine the load moves the step rates: compare the per-round figures.

Usage::

    python benchmarks/survive.py              # 3 rounds of 3 x 32 s, then 2, 3 and 4: ~8 min
    python benchmarks/survive.py --quick      # smoke run, ~3 min
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_util import (
    FREE_PORT,
    median,
    progress,
    run_command,
    start_driver,
    tail,
    verdict,
    wait_until,
)

HERE = Path(__file__).resolve()
SHAPE = {"inputs": 512, "hidden": 2048, "layers": 7, "classes": 10, "batch": 16}
SAMPLES = 2048  # 64 steps per epoch on 2 ranks: resumes land mid-epoch
KILL_TOTAL, KILL_EVERY = 60, 20  # part 3: steps, periodic save every this many steps
GOAL_RATE, GOAL_STOP_S, GOAL_RESUME = 0.99, 5.0, 1.2
KERNEL_TIMEOUT_S = 240.0  # a launch's start, a kernel process's whole run


# --------------------------------------------------------------------------- the workloads


def build(torch: Any) -> tuple[Any, Any, Any]:
    """The model, its AdamW and a shuffled loader, the same on every rank and launch."""
    torch.manual_seed(0)
    dims = [SHAPE["inputs"]] + [SHAPE["hidden"]] * SHAPE["layers"]
    layers: list[Any] = []
    for a, b in itertools.pairwise(dims):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(dims[-1], SHAPE["classes"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(SAMPLES, SHAPE["inputs"])
    y = torch.randint(0, SHAPE["classes"], (SAMPLES,))
    data = torch.utils.data.TensorDataset(x, y)
    return model, optimizer, torch.utils.data.DataLoader(data, SHAPE["batch"], shuffle=True)


def params_hash(model: Any) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def train(spec: dict[str, Any]) -> dict[str, Any]:
    """nbaccel's loop. ``spec``: total steps, or seconds (warm-up + window: rank 0 decides
    when to end, told to all by a tiny all-reduce every step); ``progress``: a file rank 0
    writes its step count to."""
    import torch
    import torch.distributed as dist

    from nbaccel import Accelerator

    acc = Accelerator()
    model, optimizer, loader = build(torch)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    resumed_at = acc.completed_steps  # restores a pending resume first
    times, first_wall = [], None
    total, seconds = spec.get("total", 10**9), spec.get("seconds")
    while acc.completed_steps < total:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            now = time.perf_counter()
            times.append(now)
            first_wall = first_wall or time.time()
            if spec.get("progress") and acc.is_main_process:
                Path(spec["progress"]).write_text(f"{acc.completed_steps} {first_wall}")
            if seconds is not None:
                done = torch.tensor([float(now - times[0] > seconds and acc.is_main_process)])
                dist.all_reduce(done)
                total = acc.completed_steps if done.item() else total
            if acc.completed_steps >= total:
                break
    value = {"times": times, "first_wall": first_wall, "resumed_at": resumed_at}
    return {**value, "hash": params_hash(acc.unwrap_model(model))}


def accelerate_train(spec: dict[str, Any]) -> None:
    """Accelerate's hand-written way: save_state at ``save_at``; or load_state, then
    skip_first_batches and one step. Rank 0 writes what it saw to ``spec["out"]``."""
    import accelerate
    import torch

    acc = accelerate.Accelerator()
    model, optimizer, loader = build(torch)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    step, first_wall = 0, None
    if spec.get("resume"):
        acc.load_state(spec["dir"])
        step = spec["save_at"]
        batches = acc.skip_first_batches(loader, step % len(loader))
    else:
        batches = loader
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        first_wall = first_wall or time.time()
        if spec.get("resume") or step == spec["save_at"]:
            break
    if not spec.get("resume"):
        acc.save_state(spec["dir"])
    if acc.is_main_process:
        Path(spec["out"]).write_text(json.dumps({"first_wall": first_wall, "step": step}))


# --------------------------------------------------------------------------- launching


def launch(spec: dict[str, Any], opts: dict[str, Any]) -> Any:
    """``nbaccel.launch`` of ``train`` from this process (it plays the kernel)."""
    import nbaccel

    return nbaccel.launch(train, args=(spec,), num_processes=2, dashboard=False, **opts)


def options(scratch: Path, name: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Launch options; ``checkpoint_dir=True``: a folder of the run's own inside
    runs_dir/checkpoints (a local root: no durable copy)."""
    found = {"runs_dir": str(scratch / "runs"), **opts}
    if found.get("checkpoint_dir") is True:
        found["checkpoint_dir"] = str(scratch / "runs" / "checkpoints" / name)
    return found


def kernel_main(spec_path: str) -> None:
    """A "kernel" process: launch as a cell would; write what came back to spec["out"]."""
    spec = json.loads(Path(spec_path).read_text())
    out, scope = Path(spec["out"]), {}  # the launcher is imported before the clock starts
    if spec.get("accelerate"):
        os.environ["ACCELERATE_USE_CPU"] = "true"
        import accelerate

        exec(FREE_PORT, scope)
        launched = time.time()
        accelerate.notebook_launcher(
            accelerate_train, args=(spec,), num_processes=2, use_port=scope["_free_port"]()
        )
        value, state = json.loads(out.read_text()), "succeeded"  # rank 0 wrote it
    else:
        import nbaccel  # noqa: F401

        launched = time.time()
        out.write_text(json.dumps({"launched": launched}))  # what the driver reads if killed
        run = launch(spec, spec["options"])
        value, state = run.result(), run.state.value
    out.write_text(json.dumps({**value, "launched": launched, "state": state}))


def start_kernel(scratch: Path, name: str, spec: dict[str, Any]) -> subprocess.Popen[bytes]:
    spec_path = scratch / f"{name}.spec.json"
    spec_path.write_text(json.dumps({**spec, "name": name, "out": str(scratch / f"{name}.json")}))
    command = [sys.executable, str(HERE), "--kernel", str(spec_path)]
    return start_driver(command, scratch / f"{name}.log", cwd=str(scratch))


def run_kernel(scratch: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    if start_kernel(scratch, name, spec).wait(KERNEL_TIMEOUT_S) != 0:
        raise RuntimeError(f"kernel {name} failed:\n{tail((scratch / f'{name}.log').read_text())}")
    return json.loads((scratch / f"{name}.json").read_text())


def events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def steps_done(path: Path) -> int:
    text = path.read_text() if path.exists() else ""
    return int(text.split()[0]) if text else 0


# --------------------------------------------------------------------------- 1. step rate

CONFIGS = {  # name -> launch options
    "off, no checkpoint_dir": {"checkpoint_every": "off"},
    "auto (15min), dir set": {"checkpoint_every": "auto", "checkpoint_dir": True},
    '"10s", dir set': {"checkpoint_every": "10s", "checkpoint_dir": True},
}


def step_rates(scratch: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    names = list(CONFIGS)
    rates: dict[str, list[float]] = {name: [] for name in names}
    saves: dict[str, list[int]] = {name: [] for name in names}
    progress("1. an untimed launch first: the helper starts and preloads what train imports")
    launch({"total": 2}, options(scratch, "warm", {})).result(timeout=KERNEL_TIMEOUT_S)
    for index in range(args.rounds):
        for name in names[index % 3 :] + names[: index % 3]:  # A B C, B C A, C A B, ...
            progress(f"1. round {index + 1}/{args.rounds}: {name} (load {os.getloadavg()[0]:.1f})")
            spec = {"seconds": args.warmup + args.window}
            run = launch(spec, options(scratch, f"rate{index}-{names.index(name)}", CONFIGS[name]))
            times = run.result(timeout=KERNEL_TIMEOUT_S + args.warmup + args.window)["times"]
            kept = [t for t in times if args.warmup <= t - times[0] <= args.warmup + args.window]
            rates[name].append((len(kept) - 1) / (kept[-1] - kept[0]))
            saves[name].append(sum(e["event"] == "checkpoint" for e in events(run.run_dir)))
    off = rates[names[0]]
    return {
        name: {"rate": median(rates[name]), "all": rates[name], "saves": saves[name],
               "ratio": median([r / o for r, o in zip(rates[name], off, strict=True)])}
        for name in names
    }  # fmt: skip


# --------------------------------------------------------------------------- 2. SIGTERM


def sigterm_stop(scratch: Path, index: int, rng: random.Random) -> dict[str, Any]:
    steps = scratch / f"stop{index}.progress"
    opts = options(scratch, f"stop{index}", {"checkpoint_dir": True})
    run = launch({"progress": str(steps)}, opts)
    target, rank = rng.randint(5, 25), rng.randint(0, 1)
    if not wait_until(lambda: steps_done(steps) >= target, KERNEL_TIMEOUT_S):
        run.stop()
        return {"error": f"step {target} not reached in {KERNEL_TIMEOUT_S:g} s"}
    signalled = time.monotonic()
    os.kill(run.worker_pids[rank], signal.SIGTERM)
    state = run.wait(timeout=KERNEL_TIMEOUT_S)
    ended = time.monotonic()
    found = events(run.run_dir)
    stops = {e["rank"]: e["step"] for e in found if e["event"] == "stopped"}
    saved = [e for e in found if e["event"] == "checkpoint"]
    write = saved[-1]["seconds"] if saved else float("nan")
    same = len(stops) == 2 and {*stops.values(), saved[-1]["completed_steps"]} == {run.saved_step}
    return {
        "rank": rank, "target": target, "stops": stops, "state": state.value,
        "saved_step": run.saved_step, "exit_code": run.exit_code, "write": write,
        "total": ended - signalled, "beyond": ended - signalled - write, "same": same,
    }  # fmt: skip


# --------------------------------------------------------------------------- 3. SIGKILL, resume


def kill_and_resume(scratch: Path, rng: random.Random) -> dict[str, Any]:
    import psutil

    root, steps = scratch / "runs" / "checkpoints" / "killed", scratch / "killed.progress"
    progress("3. the uninterrupted run (checkpoint_every off), in a kernel process")
    clean = run_kernel(scratch, "clean", {"total": KILL_TOTAL, "options": options(scratch, "", {})})
    progress(f"3. the run to kill (checkpoint_every '{KILL_EVERY} steps'), in a kernel process")
    opts = options(
        scratch, "killed", {"checkpoint_every": f"{KILL_EVERY} steps", "checkpoint_dir": True}
    )
    kernel = start_kernel(
        scratch, "killed", {"total": KILL_TOTAL, "options": opts, "progress": str(steps)}
    )
    if not wait_until(lambda: (root / "LATEST").exists(), KERNEL_TIMEOUT_S):
        kernel.kill()
        raise RuntimeError(f"no periodic save:\n{tail((scratch / 'killed.log').read_text())}")
    latest = int((root / "LATEST").read_text().split("-")[1])
    target = rng.randint(latest + 3, latest + KILL_EVERY - 3)
    wait_until(lambda: steps_done(steps) >= target, KERNEL_TIMEOUT_S)
    tree = [psutil.Process(kernel.pid), *psutil.Process(kernel.pid).children(recursive=True)]
    for process in tree:
        process.kill()
    psutil.wait_procs(tree, timeout=30)
    killed_at, first_wall = steps_done(steps), float(steps.read_text().split()[1])
    killed_first = first_wall - json.loads((scratch / "killed.json").read_text())["launched"]
    name = (root / "LATEST").read_text().strip()
    progress(f"3. killed {len(tree)} processes at step {killed_at}; resuming (newest: {name})")
    resumed = run_kernel(
        scratch, "resumed", {"total": KILL_TOTAL, "options": {**opts, "resume": "auto"}}
    )
    return {
        "killed_at": killed_at, "processes": len(tree), "saved_step": int(name.split("-")[1]),
        "resumed_at": resumed["resumed_at"], "identical": resumed["hash"] == clean["hash"],
        "hashes": (clean["hash"], resumed["hash"]), "read": read_time(root / name),
        "resume_first": resumed["first_wall"] - resumed["launched"],
        "fresh_first": median([clean["first_wall"] - clean["launched"], killed_first]),
    }  # fmt: skip


READ = """
import sys, time, torch, safetensors.torch
from pathlib import Path
kinds = (".pt", ".bin", ".pkl", ".safetensors")
files = sorted(f for f in Path(sys.argv[1]).iterdir() if f.suffix in kinds)
started = time.perf_counter()
for f in files:
    if f.suffix == ".safetensors":
        safetensors.torch.load_file(f)
    else:
        torch.load(f, map_location="cpu", weights_only=False)
print(time.perf_counter() - started, sum(f.stat().st_size for f in files))
"""


def read_time(folder: Path) -> float:
    """Seconds to load every state file of ``folder`` in a fresh process (torch imported)."""
    found = run_command([sys.executable, "-c", READ, str(folder)], timeout=120)
    seconds_s, size = found.stdout.split()
    progress(f"   read {int(size) / 2**20:.0f} MiB in {float(seconds_s):.3f} s ({folder.name})")
    return float(seconds_s)


# --------------------------------------------------------------------------- 4. Accelerate


def accelerate_resume(scratch: Path) -> dict[str, Any]:
    folder = scratch / "accelerate_ckpt"
    spec = {"accelerate": True, "dir": str(folder), "save_at": KILL_EVERY}
    progress(f"4. accelerate: {KILL_EVERY} steps, save_state, in a kernel process")
    fresh = run_kernel(scratch, "acc_save", spec)
    progress("4. accelerate: load_state + skip_first_batches, one step, in a fresh one")
    resumed = run_kernel(scratch, "acc_resume", {**spec, "resume": True})
    return {"fresh_first": fresh["first_wall"] - fresh["launched"], "read": read_time(folder),
            "resume_first": resumed["first_wall"] - resumed["launched"]}  # fmt: skip


# --------------------------------------------------------------------------- the report


def row(what: str, value: str, ratio: str = "", goal: str = "", ok: bool | None = None) -> str:
    return f"{what:<52}{value:>9}{ratio:>9}  {goal:<16}{'' if ok is None else verdict(ok)}"


def report(rates: dict, stops: list[dict], kill: dict, acc: dict) -> list[str]:
    lines = [row("measure", "median", "ratio", "goal"), "-" * 92]
    for name, found in rates.items():
        goal = None if name.startswith("off") else found["ratio"] >= GOAL_RATE
        lines.append(row(f"1. steps/s, {name}", f"{found['rate']:.3f}", f"{found['ratio']:.3f}x",
                         "" if goal is None else f">= {GOAL_RATE}x", goal))  # fmt: skip
    good = [s for s in stops if "error" not in s]
    if good:
        beyond, write = median([s["beyond"] for s in good]), median([s["write"] for s in good])
        ok = beyond <= GOAL_STOP_S and all(
            s["same"] and s["state"] == "stopped" and s["exit_code"] == 0 for s in good
        )
        lines.append(row("2. SIGTERM: signal -> run ended, less the write, s", f"{beyond:.2f}",
                         "", f"<= {GOAL_STOP_S:g} s", ok))  # fmt: skip
        lines.append(row("   the write (checkpoint record's seconds), s", f"{write:.2f}"))
    ratio = kill["resume_first"] / kill["read"]
    resumed_ok = kill["resumed_at"] == kill["saved_step"] and kill["identical"]
    lines += [
        row("3. SIGKILL: resumed at the last save, bit-identical", str(resumed_ok), "", "yes",
            resumed_ok),
        row("3. resume: launch -> first resumed step, s", f"{kill['resume_first']:.2f}",
            f"{ratio:.1f}x", f"<= {GOAL_RESUME}x read", ratio <= GOAL_RESUME),
        row("   torch.load of the state folder, s", f"{kill['read']:.2f}"),
        row("   fresh launch -> first step, s", f"{kill['fresh_first']:.2f}"),
        row("4. accelerate hand-written resume: launch -> 1st step", f"{acc['resume_first']:.2f}",
            f"{kill['resume_first'] / acc['resume_first']:.2f}x", "(nbaccel / it)"),
        row("   torch.load of its checkpoint folder, s", f"{acc['read']:.2f}"),
        row("   its fresh launch -> first step, s", f"{acc['fresh_first']:.2f}"),
    ]  # fmt: skip
    lines.append("details:")
    off = next(iter(rates.values()))["all"]
    lines += [f"  1. {name}: steps/s per round {[round(r, 3) for r in found['all']]}, / off "
              f"{[round(r / o, 3) for r, o in zip(found['all'], off, strict=True)]}, saves per"
              f" run {found['saves']}" for name, found in rates.items()]  # fmt: skip
    spread = (max(off) - min(off)) / median(off)
    lines.append(f"  1. resolution: 'off' alone moved by {spread:.0%} (max - min over median) "
                 "between rounds: ratios nearer 1 than that may be drift")  # fmt: skip
    lines += [f"  2. {s}" if "error" in s else
              f"  2. SIGTERM to rank {s['rank']} at step >= {s['target']}: 'stopped' records "
              f"{s['stops']}, state {s['state']}, saved_step {s['saved_step']}, exit code "
              f"{s['exit_code']}; signal -> end {s['total']:.2f} s, write {s['write']:.2f} s"
              for s in stops]  # fmt: skip
    lines.append(
        f"  3. SIGKILL of the kernel and its {kill['processes'] - 1} descendants at step "
        f"{kill['killed_at']}, newest save {kill['saved_step']}; resume='auto' in a fresh "
        f"process resumed at {kill['resumed_at']}; final params sha256 uninterrupted / "
        f"resumed {kill['hashes'][0]} / {kill['hashes'][1]}"
    )
    try:
        import lightning  # noqa: F401

        lines.append("lightning: installed; its SIGTERM path is not measured by this script")
    except ImportError:
        lines.append("lightning: not installed here (skipped)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="1 round of 3 x 14 s, 1 SIGTERM")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the step rates")
    parser.add_argument("--warmup", type=float, default=6.0, help="s of steps not counted")
    parser.add_argument("--window", type=float, default=26.0, help="s of steps counted")
    parser.add_argument("--stops", type=int, default=2, help="SIGTERM runs")
    parser.add_argument("--seed", type=int, help="for the random steps and rank")
    args = parser.parse_args()
    if args.kernel:
        kernel_main(args.kernel)
        return 0
    if args.quick:
        args.rounds, args.warmup, args.window, args.stops = 1, 4.0, 10.0, 1
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    rng, started, load = random.Random(seed), time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="survive-") as folder:
        scratch = Path(folder)
        rates = step_rates(scratch, args)
        stops = [sigterm_stop(scratch, index, rng) for index in range(args.stops)]
        kill = kill_and_resume(scratch, rng)
        acc = accelerate_resume(scratch)
    print(
        f"Surviving the machine: MLP {SHAPE['inputs']} -> {SHAPE['hidden']} x{SHAPE['layers']}"
        f" -> {SHAPE['classes']} (~26 M fp32 params, AdamW: ~300 MiB checkpoint), batch "
        f"{SHAPE['batch']}/rank, 2 CPU processes; {os.cpu_count()} CPUs, load average before "
        f"{load:.2f}, after {os.getloadavg()[0]:.2f}; seed {seed}; "
        f"{time.perf_counter() - started:.0f} s"
    )
    print("\n".join(report(rates, stops, kill, acc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
