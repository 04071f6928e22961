"""The ``nbaccel`` command line: a dispatcher over one module per command.

Entry point only: nothing in the library imports it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import nbaccel
from nbaccel.demo import train_demo


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
        help="worker processes (default: 2, or one per GPU)",
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

    from nbaccel.devices import visible_gpu_count

    gpus = visible_gpu_count(os.environ)
    num_processes = args.num_processes or max(gpus, 2)
    where = (
        f"{num_processes} GPU processes (nccl)" if gpus else f"{num_processes} CPU processes (gloo)"
    )
    print(f"nbaccel demo: training on {where}; rank 0's output:")
    try:
        summary = nbaccel.notebook_launcher(
            train_demo, args=(args.epochs,), num_processes=num_processes, use_cpu=not gpus
        )
    except KeyboardInterrupt:
        print("nbaccel demo: interrupted; every worker was stopped.", file=sys.stderr)
        return 130
    print(f"rank 0 returned: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
