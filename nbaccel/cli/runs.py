"""``nbaccel runs`` and ``nbaccel attach``: detached runs from a terminal.

``nbaccel launch --detach script.py`` returns at once with the run's id; ``nbaccel runs``
lists the runs under ``runs_dir`` (``--prune N`` keeps the newest N finished ones);
``nbaccel attach [RUN_ID]`` prints what the run wrote so far and follows it to its end
(Ctrl-C leaves it running; ``--stop`` stops it).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import nbaccel
from nbaccel.sweeps.detached import AttachedSweep


def register(commands: Any) -> None:
    runs = commands.add_parser(
        "runs",
        help="list the runs under runs_dir (detached ones can be attached)",
        description="List the runs under runs_dir, newest first: state, start, elapsed, "
        "world size and rank 0's last metrics.",
    )
    runs.add_argument("--runs_dir", "--runs-dir", default=None, help="default: the config's")
    runs.add_argument(
        "--prune", type=int, default=None, metavar="N", help="keep only the N newest finished runs"
    )
    runs.set_defaults(run=_runs)
    attach = commands.add_parser(
        "attach",
        help="follow a detached run (launched with --detach) to its end",
        description="Print what a detached run's rank 0 wrote so far, then follow it live "
        "until it ends. Ctrl-C stops following and leaves the run going.",
    )
    attach.add_argument("run_id", nargs="?", default="latest", help="default: the newest")
    attach.add_argument("--runs_dir", "--runs-dir", default=None, help="default: the config's")
    attach.add_argument("--stop", action="store_true", help="stop the run instead")
    attach.set_defaults(run=_attach)


def _runs(args: argparse.Namespace) -> int:
    print(nbaccel.runs(args.runs_dir, prune=args.prune))
    return 0


def _attach(args: argparse.Namespace) -> int:
    try:
        run = nbaccel.attach(args.run_id, runs_dir=args.runs_dir, dashboard="text")
    except ValueError as error:
        print(f"nbaccel: {error}", file=sys.stderr)
        return 2
    if isinstance(run, AttachedSweep):  # a sweep's id: follow it until every trial ended
        if args.stop:
            run.stop()
        try:
            run.wait()
        except KeyboardInterrupt:
            print(f"nbaccel: stopped following; sweep {run.sweep_id} goes on.", file=sys.stderr)
            return 130
        print("\n".join(f"trial {row['trial']}: {row['state']}" for row in run.rows()))
        return 0
    if args.stop:
        print(f"nbaccel: run {run.run_id} {run.stop(timeout=60).value}")
        return 0
    try:
        run.wait()
    except KeyboardInterrupt:
        print(f"nbaccel: stopped following; run {run.run_id} goes on.", file=sys.stderr)
        return 130
    return run.exit_code or 0
