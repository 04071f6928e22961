"""The ``%%nbaccel`` cell magic: a cell's code runs on every rank of ``nbaccel.Workers``.

``%load_ext nbaccel`` registers it (``nbaccel.load_ipython_extension``). The cell runs in
each rank's persistent namespace, on the last ``Workers`` made, or the one named:
``%%nbaccel workers``. ``--ranks all`` (or ``--ranks 0,1``) shows those ranks' output for
this cell instead of ``log_ranks``'s. The value of the cell's last line, when it is an
expression, is shown as rank 0's repr. An entry point: it imports IPython, and only when
the extension is loaded.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from nbaccel.launcher.interactive.workers import WorkerGroup, last_workers


class RankRepr(str):
    """A rank's repr text, shown as it is (IPython would quote a plain str)."""

    def __repr__(self) -> str:
        return str(self)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="%%nbaccel", add_help=False)
    parser.add_argument("workers", nargs="?", help="the Workers variable (default: the last made)")
    parser.add_argument("--ranks", default=None, help="whose output to show: 'all' or '0,1'")
    return parser


def parse_line(line: str) -> tuple[str | None, frozenset[int] | None]:
    """The magic's line: the Workers variable's name and the ranks to show.

    >>> parse_line("workers --ranks 0,1")
    ('workers', frozenset({0, 1}))
    >>> parse_line("--ranks all")
    (None, frozenset())
    """
    try:
        options = _parser().parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError(
            f"%%nbaccel {line}: expected `%%nbaccel [workers_variable] [--ranks all|0,1]`."
        ) from None
    ranks: frozenset[int] | None = None
    if options.ranks is not None:
        text = options.ranks.strip()
        ranks = frozenset() if text == "all" else frozenset(int(r) for r in text.split(","))
    return options.workers, ranks


def nbaccel_cell(line: str, cell: str, namespace: dict[str, Any], number: int) -> Any:
    """Run ``cell`` on the workers the line names (or the last made); rank 0's last value."""
    name, ranks = parse_line(line)
    workers = namespace.get(name) if name is not None else last_workers()
    if not isinstance(workers, WorkerGroup):
        where = f"{name!r} is not an nbaccel.Workers" if name else "no nbaccel.Workers exists"
        raise NameError(
            f"%%nbaccel: {where}. Start workers first: workers = nbaccel.Workers(num_processes=2)"
        )
    values = workers.run_cell(cell, f"<nbaccel cell {number}>", show_ranks=ranks)
    first = values.get(min(values)) if values else None
    return None if first is None else RankRepr(first)


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%%nbaccel`` in an IPython shell (``%load_ext nbaccel``)."""

    def magic(line: str, cell: str) -> Any:
        return nbaccel_cell(line, cell, ipython.user_ns, ipython.execution_count)

    magic.__doc__ = __doc__
    ipython.register_magic_function(magic, magic_kind="cell", magic_name="nbaccel")
