"""The script case of ``data_handoff.py``: 1 GiB held by a plain ``python`` script, launched on.

A script makes a 1 GiB float32 numpy array, defines a function that joins a gloo group and
sums it on each of 2 CPU ranks, and calls the launcher ``--launches`` times back to back,
each call timed in the script. Ways: ``nbaccel.notebook_launcher(use, num_processes=2)``
(its text display: a script has no widgets) and ``accelerate.notebook_launcher`` with
``ACCELERATE_USE_CPU=true`` and a free port per launch (it forks the script, whose pages its
ranks share). Each script runs in its own session; rounds alternate the order. Printed: the
first launch and the median of the later ones (from the 3rd) per way, and their ratio.

Usage::

    python benchmarks/data_script_loop.py               # 3 rounds, 7 launches per script
    python benchmarks/data_script_loop.py --rounds 1 --launches 5
"""

from __future__ import annotations

import argparse
import json
import sys

from bench_util import FREE_PORT, median, progress, run_command, seconds

SCRIPT_TIMEOUT_S = 600.0

SCRIPT = (
    "import json, os, time\n"
    "{head}\n"
    "import numpy as np\n"
    + FREE_PORT
    + """
data = np.full((1 << 30) // 4, 1.0, dtype="f4")

def use():
    import torch.distributed as dist
    own = not dist.is_initialized()  # nbaccel's ranks get the group ready-made
    if own:
        dist.init_process_group("gloo")
    total = float(data.sum())
    if own:
        dist.destroy_process_group()
    return total

times = []
for _ in range({launches}):
    started = time.perf_counter()
    {call}
    times.append(time.perf_counter() - started)
print("TIMES", json.dumps(times))
"""
)
WAYS = {
    "nbaccel": ("import nbaccel", "nbaccel.notebook_launcher(use, num_processes=2)"),
    "accelerate": (
        "os.environ['ACCELERATE_USE_CPU'] = 'true'\nimport accelerate",
        "accelerate.notebook_launcher(use, num_processes=2, use_port=str(_free_port()))",
    ),
}


def one_script(way: str, launches: int) -> list[float]:
    head, call = WAYS[way]
    source = SCRIPT.format(head=head, call=call, launches=launches)
    done = run_command([sys.executable, "-c", source], SCRIPT_TIMEOUT_S)
    for line in done.stdout.splitlines():
        if line.startswith("TIMES "):
            return [float(value) for value in json.loads(line[6:])]
    raise RuntimeError(f"{way}: no times (exit {done.returncode}): {done.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--launches", type=int, default=7)
    options = parser.parse_args()
    first: dict[str, list[float]] = {way: [] for way in WAYS}
    warm: dict[str, list[float]] = {way: [] for way in WAYS}
    for index in range(options.rounds):
        for way in list(WAYS) if index % 2 == 0 else list(WAYS)[::-1]:
            progress(f"round {index + 1}/{options.rounds}: {way}")
            times = one_script(way, options.launches)
            first[way].append(times[0])
            warm[way].extend(times[2:])
    print("| way | first launch (s) | later launches, median (s) |\n|---|---|---|")
    for way in WAYS:
        print(f"| {way} | {seconds(median(first[way]))} | {seconds(median(warm[way]))} |")
    ours, theirs = median(warm["nbaccel"]), median(warm["accelerate"])
    if ours is not None and theirs:
        print(f"\nlater launches, nbaccel / Accelerate: {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
