"""The ``nbaccel`` command line: a dispatcher over one module per command.

Entry point only: nothing in the library imports it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import nbaccel
from nbaccel.demo import train_demo

# Processes of `nbaccel demo` on a machine without GPUs: a demo of a distributed run needs two.
DEMO_CPU_PROCESSES = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nbaccel",
        description="Launch distributed PyTorch training from notebooks and terminals.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="train a small built-in model on generated data across worker processes",
        description="Train a small built-in model on generated data (no downloads), showing "
        "rank 0's progress and the value it returns.",
    )
    demo.add_argument(
        "--num_processes",
        "--num-processes",
        type=int,
        default=None,
        help=f"worker processes (default: one per GPU, else {DEMO_CPU_PROCESSES} CPU processes)",
    )
    demo.add_argument("--epochs", type=int, default=3, help="passes over the data (default 3)")
    demo.set_defaults(run=_demo)
    for module_name in (
        "nbaccel.cli.config",
        "nbaccel.cli.env",
        "nbaccel.cli.launch",
        "nbaccel.cli.runs",
    ):
        try:
            module = __import__(module_name, fromlist=["register"])
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue  # a command not built yet
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nbaccel <command>``; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except nbaccel.ConfigError as error:
        print(f"nbaccel: {error}", file=sys.stderr)
        return 2


def _demo(args: argparse.Namespace) -> int:
    import os

    from nbaccel.hardware.devices import visible_gpu_count

    gpus = visible_gpu_count(os.environ)
    # The demo shows a distributed run, so without a GPU it runs DEMO_CPU_PROCESSES CPU
    # processes, where a launch that names no count runs one (docs/reference.md); with GPUs
    # it takes the launch's own default, one process per GPU (gpu_ids narrows them).
    if args.num_processes:
        where = f"{args.num_processes} {'GPU' if gpus else 'CPU'} processes"
    elif gpus:
        where = "one process per GPU"
    else:
        where = (
            f"{DEMO_CPU_PROCESSES} CPU processes (no GPU is visible; a launch would run 1; "
            "--num_processes N for another count)"
        )
    print(f"nbaccel demo: a distributed training on {where}; rank 0's output:")
    try:
        summary = nbaccel.notebook_launcher(
            train_demo,
            args=(args.epochs,),
            num_processes=args.num_processes or (None if gpus else DEMO_CPU_PROCESSES),
            use_cpu=not gpus,
        )
    except KeyboardInterrupt:
        print("nbaccel demo: interrupted; every worker was stopped.", file=sys.stderr)
        return 130
    print(f"rank 0 returned: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
