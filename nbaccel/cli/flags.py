"""Command-line flags generated from the config schema (`--num_processes`, `--num-processes`).

Every option becomes a flag named as Accelerate users expect, with its help text and choices;
values stay text here and are parsed by ``resolve`` like environment values, so the CLI and
the other config faces cannot disagree.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from nbaccel.config.schema import options, parse_text


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


def explicit_values(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line, parsed to their types.

    >>> parser = argparse.ArgumentParser(); add_config_flags(parser)
    >>> explicit_values(parser.parse_args(["--num-processes", "4", "--use_cpu"]))
    {'num_processes': 4, 'use_cpu': True}
    """
    given: Mapping[str, Any] = vars(args)
    return {opt.name: parse_text(opt, given[opt.name]) for opt in options() if opt.name in given}
