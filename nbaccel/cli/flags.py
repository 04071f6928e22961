"""Command-line flags generated from the config schema (`--num_processes`, `--num-processes`).

Every option becomes a flag named as Accelerate users expect, with its help text and choices;
values stay text here and are parsed by ``resolve`` like environment values, so the CLI and
the other config faces cannot disagree.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from nbaccel.config.resolve import Resolved, resolve
from nbaccel.config.schema import options, parse_text
from nbaccel.errors import ConfigError


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--config_file`` and one flag per schema option (unset flags stay absent)."""
    parser.add_argument(
        "--config_file",
        "--config-file",
        default=None,
        metavar="PATH",
        help="YAML config (nbaccel's or Accelerate's format) read before env and flags",
    )
    group = parser.add_argument_group("config options (defaults < files < NBACCEL_* env < flags)")
    for opt in options():
        names = [f"--{opt.name}"] + ([f"--{opt.name.replace('_', '-')}"] if "_" in opt.name else [])
        choices = f" Choices: {', '.join(map(str, opt.choices))}." if opt.choices else ""
        default = "" if opt.default in ("", (), None) else f" Default: {opt.default}."
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if opt.kind is bool else {}
        group.add_argument(
            *names,
            dest=opt.name,
            default=argparse.SUPPRESS,
            metavar=opt.kind.__name__.upper() if opt.kind is not tuple else "LIST",
            help=f"{opt.help}{choices}{default}",
            **extra,
        )
    group.add_argument(
        "--nproc_per_node",
        "--nproc-per-node",
        dest="nproc_per_node",
        default=argparse.SUPPRESS,
        metavar="INT",
        help="Worker processes on each machine (torchrun's flag): sets num_processes to this "
        "times num_machines. Give it or --num_processes, or both when they agree.",
    )


def explicit_values(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line, parsed to their types.

    >>> parser = argparse.ArgumentParser(); add_config_flags(parser)
    >>> explicit_values(parser.parse_args(["--num-processes", "4", "--use_cpu"]))
    {'num_processes': 4, 'use_cpu': True}
    """
    given: Mapping[str, Any] = vars(args)
    return {opt.name: parse_text(opt, given[opt.name]) for opt in options() if opt.name in given}


def resolve_flags(
    args: argparse.Namespace, env: Mapping[str, str], defaults: Mapping[str, Any] | None = None
) -> Resolved:
    """``resolve`` with the flags in ``args`` as arguments, ``--nproc_per_node`` included.

    ``--nproc_per_node P`` is not a schema field: it becomes ``num_processes = P ×
    num_machines``, num_machines coming from wherever it is set. ``config show`` then lists
    the num_processes it implies, with the flag named in its source: the run uses that one
    number, and a row of its own would read as a second count that could disagree with it.

    >>> parser = argparse.ArgumentParser(); add_config_flags(parser)
    >>> args = parser.parse_args(["--nproc_per_node", "2", "--num_machines", "3"])
    >>> resolved = resolve_flags(args, env={})
    >>> resolved.config.num_processes, resolved.sources["num_processes"]
    (6, 'argument (--nproc_per_node 2 × num_machines 3)')
    """
    explicit = explicit_values(args)
    per_node = _per_node(getattr(args, "nproc_per_node", None))
    if per_node is None:
        return resolve(explicit, env=env, config=args.config_file, defaults=defaults)
    # num_machines first, with num_processes unset so that no count can fail this pass.
    machines_source = resolve(
        {**explicit, "num_processes": None}, env=env, config=args.config_file, defaults=defaults
    )
    machines = machines_source.config.num_machines
    total = per_node * machines
    given = explicit.get("num_processes")
    if given is not None and given != total:
        raise ConfigError(
            f"--num_processes {given} and --nproc_per_node {per_node} disagree: with "
            f"num_machines={machines} (from {machines_source.sources['num_machines']}), "
            f"--nproc_per_node {per_node} means {total} processes in all, and --num_processes "
            "counts all machines' processes together (as in Accelerate). Give one of the two, "
            f"or --num_processes {total}.",
            field="num_processes",
        )
    resolved = resolve(
        {**explicit, "num_processes": total}, env=env, config=args.config_file, defaults=defaults
    )
    source = f"argument (--nproc_per_node {per_node} × num_machines {machines})"
    return Resolved(resolved.config, {**resolved.sources, "num_processes": source})


def _per_node(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(
            f"--nproc_per_node {text!r} is not a whole number of processes, 1 or more: it is "
            "how many workers each machine starts. Pass a count such as --nproc_per_node 2.",
            field="num_processes",
        )
    return value
