"""Round trip of interactive workers: ``nbaccel.Workers`` against a warm launch and ipyparallel.

What is measured
----------------
For each process count (2, 4 and 8 CPU processes by default, ``--counts``), in one driver
that holds an IPython shell (as a kernel does; ``InteractiveShell``, no ZMQ):

* **nbaccel run**: ``workers.run(noop)`` on persistent workers, call to ``{rank: value}``;
* **nbaccel cell**: an empty ``%%nbaccel`` cell (``pass``) through the shell's ``run_cell``;
* **nbaccel all-reduce**: a ``%%nbaccel`` cell that all-reduces a 1 MB float32 tensor;
* **nbaccel launch**: a warm ``nbaccel.notebook_launcher(noop)`` (the helper up, one launch
  made before), the whole call: what a user pays per cell without ``Workers``;
* **ipyparallel apply**: ``view.apply_sync(noop)`` on as many ipyparallel engines;
* **ipyparallel %px**: an empty ``%%px`` cell through the same shell's ``run_cell``.

Each is the median of ``--repeats`` calls (after two warm-up calls); the launch is repeated
fewer times (``--launches``), being ~1000 times slower. The goal lines compare nbaccel's run
and cell with the warm launch (goal: at most 0.3x) and with ipyparallel's apply and ``%px``
(goal: at most 0.5x). ipyparallel is in the dev extra; without it, its rows are skipped.
On a machine with a CUDA GPU, ``--cuda`` runs the nbaccel rows on it (one rank per GPU).

Run: ``python benchmarks/interactive_round_trip.py [--counts 2 4 8] [--repeats 200]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench_util import progress, verdict
from IPython.core.interactiveshell import InteractiveShell

import nbaccel


def noop() -> None:
    return None


def timed(call: Callable[[], Any], repeats: int, warm: int = 2) -> float:
    for _ in range(warm):
        call()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def cell(shell: InteractiveShell, source: str) -> Callable[[], None]:
    def run() -> None:
        result = shell.run_cell(source, store_history=False, silent=True)
        if not result.success:
            raise RuntimeError(f"cell failed: {result.error_in_exec or result.error_before_exec}")

    return run


def measure_nbaccel(
    shell: InteractiveShell, count: int, repeats: int, launches: int, cuda: bool, runs: str
) -> dict[str, float]:
    device = {} if cuda else {"use_cpu": True}
    options: dict[str, Any] = {"runs_dir": runs, "allow_oversubscribe": True, **device}
    found: dict[str, float] = {}
    with nbaccel.Workers(num_processes=count, **options) as workers:
        shell.user_ns["workers"] = workers
        found["nbaccel run"] = timed(lambda: workers.run(noop), repeats)
        found["nbaccel cell"] = timed(cell(shell, "%%nbaccel workers\npass"), repeats)
        setup = (
            "%%nbaccel workers\nimport torch, torch.distributed as dist\n"
            "device = 'cuda' if torch.cuda.is_available() and dist.get_backend() != 'gloo' "
            "else 'cpu'\nbuffer = torch.ones(262144, device=device)"  # 1 MB of float32
        )
        cell(shell, setup)()
        reduce = "%%nbaccel workers\ndist.all_reduce(buffer)\nbuffer.fill_(1)\n"
        reduce += "torch.cuda.synchronize() if device == 'cuda' else None"
        found["nbaccel all-reduce 1 MB"] = timed(cell(shell, reduce), repeats)
    nbaccel.notebook_launcher(noop, num_processes=count, **options)  # warm
    found["nbaccel launch"] = timed(
        lambda: nbaccel.notebook_launcher(noop, num_processes=count, **options), launches, 0
    )
    return found


def measure_ipyparallel(shell: InteractiveShell, count: int, repeats: int) -> dict[str, float]:
    try:
        import ipyparallel
    except ImportError:
        progress("ipyparallel is not installed (pip install ipyparallel): its rows are skipped")
        return {}
    cluster = ipyparallel.Cluster(n=count, log_level=40)
    client = cluster.start_and_connect_sync()
    try:
        client.wait_for_engines(count, timeout=120)
        view = client[:]
        view.block = True
        view.activate()  # registers %px / %%px in this shell
        found = {"ipyparallel apply": timed(lambda: view.apply_sync(noop), repeats)}
        found["ipyparallel %px"] = timed(cell(shell, "%%px\npass"), repeats)
        return found
    finally:
        client.close()
        cluster.stop_cluster_sync()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--launches", type=int, default=9)
    parser.add_argument("--cuda", action="store_true", help="nbaccel rows on CUDA GPUs")
    options = parser.parse_args()
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbaccel")
    rows: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as runs:
        for count in options.counts:
            progress(f"{count} processes: nbaccel")
            rows[count] = measure_nbaccel(
                shell, count, options.repeats, options.launches, options.cuda, runs
            )
            progress(f"{count} processes: ipyparallel")
            rows[count].update(measure_ipyparallel(shell, count, options.repeats))
    names = sorted({name for found in rows.values() for name in found})
    print(f"\nmedian seconds per call ({'CUDA' if options.cuda else 'CPU'} workers)")
    print(f"{'':28}" + "".join(f"{f'{c} procs':>12}" for c in rows))
    for name in names:
        cells = "".join(f"{rows[c].get(name, float('nan')):>12.5f}" for c in rows)
        print(f"{name:28}{cells}")
    print()
    for count, found in rows.items():
        for ours, theirs, goal in (
            ("nbaccel run", "nbaccel launch", 0.3),
            ("nbaccel cell", "nbaccel launch", 0.3),
            ("nbaccel run", "ipyparallel apply", 0.5),
            ("nbaccel cell", "ipyparallel %px", 0.5),
        ):
            if ours in found and theirs in found:
                ratio = found[ours] / found[theirs]
                print(
                    f"{verdict(ratio <= goal)} {count} procs: {ours} / {theirs} = {ratio:.3f} "
                    f"(goal <= {goal})"
                )


if __name__ == "__main__":
    main()
