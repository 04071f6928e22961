"""``nbaccel launch``: run a torchrun-style script on this machine, or on several.

On one machine the script runs through nbaccel's own launcher (the same path as a notebook
launch: warm helper, rank-labelled output, first-failure reporting); with
``--num_machines > 1`` it runs on torch elastic with c10d rendezvous. The exit code is the
first failing rank's.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import nbaccel
from nbaccel.cli.flags import add_config_flags, resolve_flags
from nbaccel.launcher.bootstrap.script import run_script
from nbaccel.launcher.run_folder import make_run_dir

# `nbaccel launch`'s own defaults (a file, env or flag still wins): scripts written for
# torchrun call init_process_group() themselves, and a terminal shows every rank, labelled.
SCRIPT_DEFAULTS: dict[str, Any] = {"init_process_group": False, "log_ranks": "all"}


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "launch",
        help="run a training script on N processes (and M machines)",
        description="Run a torchrun-style script (or -m module) on every worker. Each "
        "config option is a flag; they override the config file and NBACCEL_* variables.",
    )
    parser.add_argument(
        "-m", "--module", action="store_true", help="run TARGET as a module (python -m TARGET)"
    )
    add_config_flags(parser)
    parser.add_argument("target", metavar="TARGET", help="script path (or module name with -m)")
    parser.add_argument(
        "target_args",
        nargs=argparse.REMAINDER,
        metavar="...",
        help="arguments passed to the script",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = resolve_flags(args, os.environ, defaults=SCRIPT_DEFAULTS).config
    if not args.module and not Path(args.target).is_file():
        print(f"nbaccel: no script at {args.target!r} (use -m for a module).", file=sys.stderr)
        return 2
    if config.num_machines > 1:
        if config.detach:
            print(
                "nbaccel: --detach runs on one machine; with --num_machines > 1 each "
                "machine's `nbaccel launch` is its own supervisor: run it under nohup, "
                "tmux or your scheduler instead.",
                file=sys.stderr,
            )
            return 2
        from nbaccel.launcher.remote.elastic import launch_machines

        # One folder per machine: several "machines" may share a host and a working folder.
        # A random part, as every run id has: two launches in one second must not collide.
        stamp = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
        run_dir = make_run_dir(config.runs_dir, f"{stamp}-elastic-m{config.machine_rank}")
        return launch_machines(config, args.target, args.module, list(args.target_args), run_dir)
    run_ = nbaccel.launch(
        run_script,
        args=(args.target, args.module, list(args.target_args)),
        config=config,
        dashboard="text" if not config.detach else False,
    )
    if config.detach:  # the supervisor runs it; this terminal may close
        print(
            f"nbaccel: detached run {run_.run_id} ({run_.run_dir}). Follow it with "
            f"`nbaccel attach {run_.run_id}`, stop it with `nbaccel attach --stop "
            f"{run_.run_id}`, list runs with `nbaccel runs`."
        )
        return 0
    try:
        run_.wait()
    except KeyboardInterrupt:
        run_.stop()
        print("nbaccel: interrupted; every worker was stopped.", file=sys.stderr)
        return 130
    if run_.error is not None and run_.error.__cause__ is not None:
        print(run_.error.__cause__, file=sys.stderr)  # the worker's traceback
    return run_.exit_code or 0
