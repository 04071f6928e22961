"""``nbaccel config``: the interactive wizard, ``config show`` and ``config validate``.

The wizard's questions come from the schema (``options()``): a field added to ``Config``
is asked without touching this module. ``APPLIES_WHEN`` is the only wizard-specific data:
which questions are skipped given the answers so far (whole sections, multi-node fields).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nbaccel.cli.flags import add_config_flags, resolve_flags
from nbaccel.config.display import applies, launch_flags, show_value
from nbaccel.config.files import default_file, nbaccel_default_file, save
from nbaccel.config.resolve import Resolved, resolve
from nbaccel.config.schema import Config, Option, flatten, from_flat, options, parse_text, sections
from nbaccel.errors import ConfigError

INTRO = (
    "Press Enter to keep the value in [brackets]; 'none' unsets an optional value, '-' "
    "empties a text or list value. Ctrl-D quits without saving."
)


def register(subparsers: Any) -> None:
    """Add ``config`` (the wizard) with its ``show`` and ``validate`` subcommands.

    >>> parser = argparse.ArgumentParser(prog="nbaccel")
    >>> register(parser.add_subparsers())
    >>> parser.parse_args(["config", "validate", "run.yaml"]).file
    'run.yaml'
    """
    asked = ", ".join(opt.path for opt in options())
    config = subparsers.add_parser(
        "config",
        usage="%(prog)s [-h] [--config_file PATH] [{show,validate} ...]",
        help="interactive wizard writing the default config file; show, validate",
        description="Without a subcommand: ask every config question (defaults shown, "
        "answers checked) and write the default config file, or --config_file PATH.",
        epilog=f"The wizard asks, in this order, skipping what does not apply: {asked}.",
    )
    wizard_help = "file to write (default: nbaccel's default file); its values are the defaults"
    config.add_argument("--config_file", "--config-file", metavar="PATH", help=wizard_help)
    config.set_defaults(run=_run_wizard)
    commands = config.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    show = commands.add_parser(
        "show",
        prog=f"{config.prog} show",
        help="every resolved config value with its source",
        description="Print every option's resolved value and where it came from (default, "
        "file, NBACCEL_* environment variable, or a flag given here).",
    )
    add_config_flags(show)
    show.set_defaults(run=_run_show)
    validate = commands.add_parser(
        "validate",
        prog=f"{config.prog} validate",
        help="check a config file (with the environment) and exit 0, or 2 naming the problem",
        description="Resolve FILE together with NBACCEL_*/ACCELERATE_* variables.",
    )
    validate.add_argument("file", metavar="FILE", help="YAML config, nbaccel's or Accelerate's")
    validate.set_defaults(run=_run_validate)


def run_wizard(
    start: Config, ask: Callable[[str], str] | None = None, say: Callable[[str], None] = print
) -> Config:
    """Ask every applicable question, starting from ``start``; EOFError if input ends.

    >>> answers = {"num_processes": "3", "strategy": "fsdp"}  # Enter for the others
    >>> ask = lambda prompt: answers.get(prompt.split()[0], "")
    >>> config = run_wizard(Config(), ask, say=lambda line: None)
    >>> config.num_processes, config.strategy
    (3, 'fsdp')
    """
    read = ask or input  # looked up at call time, so a patched builtins.input is used
    values = flatten(start)
    opts = options()
    index = 0
    while True:
        section = ""
        while index < len(opts):
            opt = opts[index]
            index += 1
            if not applies(opt.path, values):
                values[opt.name] = opt.default
                continue
            here = opt.path.split(".")[0] if "." in opt.path else ""
            if here and here != section:
                say(f"\n== {here}: {sections()[here]}")
            section = here
            values[opt.name] = _ask(opt, values, read, say)
        try:
            return from_flat(values)
        except ConfigError as error:  # a cross-field conflict: ask again from that field
            say(f"! {error}")
            index = next((i for i, o in enumerate(opts) if o.name == error.field), 0)


def _ask(
    opt: Option, values: Mapping[str, Any], read: Callable[[str], str], say: Callable[[str], None]
) -> Any:
    current = values[opt.name]
    say(f"\n{opt.path}: {opt.help}")
    if opt.kind is bool:
        say("  true or false (yes/no)")
    elif opt.choices:
        many = " (comma list)" if opt.kind is tuple else ""
        say(f"  choices{many}: {', '.join(map(str, opt.choices))}")
    keep = (
        "" if _problem(opt, values, current) else f", or press Enter to keep {show_value(current)}"
    )
    while True:
        answer = read(f"{opt.path} [{show_value(current)}]: ")
        try:
            value = _parse_answer(opt, answer) if answer.strip() else current
            problem = _problem(opt, values, value)
        except ConfigError as error:
            problem = error
        if problem is None:
            return value
        say(f"! {problem} Try again{keep}.")


def _problem(opt: Option, values: Mapping[str, Any], value: Any) -> ConfigError | None:
    """The error ``value`` causes for ``opt`` given the other values (checked in full)."""
    try:
        from_flat({**values, opt.name: value})
    except ConfigError as error:  # one naming another field is checked again at the end
        return error if error.field == opt.name else None
    return None


def _parse_answer(opt: Option, answer: str) -> Any:
    if opt.kind in (str, tuple) and answer.strip() == "-":
        return opt.kind()
    value = parse_text(opt, answer)
    if opt.kind is str and opt.choices and value not in opt.choices:
        by_lower = {str(choice).lower(): choice for choice in opt.choices}
        value = by_lower.get(value.lower(), value)  # "full_shard" means FULL_SHARD
    return value


def format_sources(resolved: Resolved) -> str:
    """Every option's dotted path, resolved value and source, in aligned columns.

    >>> text = format_sources(resolve({"num_processes": 2}, env={}))
    >>> text.splitlines()[1].split()
    ['num_processes', '2', 'argument']
    """
    rows = [("option", "value", "source")] + [
        (opt.path, show_value(opt.get(resolved.config)), resolved.sources[opt.name])
        for opt in options()
    ]
    path_width = max(len(row[0]) for row in rows)
    value_width = max(len(row[1]) for row in rows)
    return "\n".join(f"{p:<{path_width}}  {v:<{value_width}}  {s}".rstrip() for p, v, s in rows)


def _starting_point(target: Path, env: Mapping[str, str]) -> tuple[Config, str]:
    source = target if target.is_file() else default_file(env)
    if source is None:
        return Config(), "the defaults"
    try:
        return resolve(env={}, config=source, use_default_file=False).config, str(source)
    except ConfigError as error:
        print(f"! Cannot start from {source}: {error}\n  Starting from the defaults instead.")
        return Config(), "the defaults"


def _run_wizard(args: argparse.Namespace) -> int:
    target = Path(args.config_file) if args.config_file else nbaccel_default_file(os.environ)
    start, origin = _starting_point(target, os.environ)
    print(f"nbaccel config: writes {target}, starting from {origin}.\n{INTRO}")
    try:
        config = run_wizard(start)
    except EOFError:
        print("\nAborted (end of input): nothing was written.", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nInterrupted: nothing was written.", file=sys.stderr)
        return 130
    save(config, target)
    flags = launch_flags(config)
    print(f"\nSaved {target}")
    if target != nbaccel_default_file(os.environ):
        print(f"Use it with: nbaccel launch --config_file {shlex.quote(str(target))} SCRIPT.py")
    print(f"The same settings as flags: nbaccel launch {flags + ' ' if flags else ''}SCRIPT.py")
    return 0


def _run_show(args: argparse.Namespace) -> int:
    print(format_sources(resolve_flags(args, os.environ)))
    return 0


def _run_validate(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise ConfigError(
            f"Config file {path} does not exist. Check the path, or write one "
            "with `nbaccel config --config_file PATH`."
        )
    resolve(env=os.environ, config=path)
    print(f"{path} is valid")
    return 0
