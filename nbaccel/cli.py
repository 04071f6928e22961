"""The ``nbaccel`` command line. Entry point only: nothing in the library imports it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import nbaccel
from nbaccel.demo import train_demo


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nbaccel <command>``; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="nbaccel", description=nbaccel.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="train a small built-in model on generated data across worker processes"
    )
    demo.add_argument("--num_processes", "--num-processes", type=int, default=2)
    demo.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args.num_processes, args.epochs)
    return 2  # unreachable: argparse rejects unknown commands


def _demo(num_processes: int, epochs: int) -> int:
    print(f"nbaccel demo: training on {num_processes} CPU processes (gloo); rank 0's output:")
    try:
        summary = nbaccel.notebook_launcher(
            train_demo, args=(epochs,), num_processes=num_processes, use_cpu=True
        )
    except KeyboardInterrupt:
        print("nbaccel demo: interrupted; every worker was stopped.", file=sys.stderr)
        return 130
    print(f"rank 0 returned: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
