"""A warm nbaccel launch whose function does one CUDA op: the whole call, and where it goes.

A CUDA context cannot be inherited across a fork, so every warm launch's workers initialise
CUDA again, whatever the helper preloaded. This measures, in one driver, a first launch and
then warm launches of a function that does ``torch.ones(1, device="cuda")`` and synchronises:
the whole call (the kernel's view) and, inside rank 0, the time from the function's start to
the op done (CUDA's initialisation: the driver, the context, the first kernel). What is left
of the whole call is nbaccel's: the fork from a spare, the process group, the result, the
exit. ``--device cpu`` runs the same plumbing without a GPU (the GPU check's dry run).

    python benchmarks/cuda_launch.py [--device cpu] [--launches 6] [--processes 1]

Prints one line per launch and a ``CUDA_LAUNCH {...}`` JSON line with the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time


def first_op(device: str) -> float:
    start = time.perf_counter()
    import torch

    torch.ones(1, device=device).add_(1)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--launches", type=int, default=6)
    parser.add_argument("--processes", type=int, default=1)
    args = parser.parse_args(argv)

    import nbaccel

    runs_dir = tempfile.mkdtemp(prefix="nbaccel-cuda-launch-")
    wholes, inits = [], []
    for index in range(args.launches):
        start = time.perf_counter()
        init = nbaccel.notebook_launcher(
            first_op,
            args=(args.device,),
            num_processes=args.processes,
            use_cpu=args.device == "cpu",
            dashboard=False,
            runs_dir=runs_dir,
        )
        whole = time.perf_counter() - start
        kind = "first" if index == 0 else "warm"
        print(f"launch {index} ({kind}): whole {whole:.3f} s, first {args.device} op {init:.3f} s")
        if index:
            wholes.append(whole)
            inits.append(init)
    summary = {
        "device": args.device,
        "warm_whole_median_s": round(statistics.median(wholes), 4),
        "warm_first_op_median_s": round(statistics.median(inits), 4),
        "warm_rest_median_s": round(
            statistics.median(w - i for w, i in zip(wholes, inits, strict=True)), 4
        ),
        "launches": len(wholes),
    }
    print("CUDA_LAUNCH " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
