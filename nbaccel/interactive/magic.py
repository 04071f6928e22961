"""The ``%%nbaccel`` cell magic: a cell's code runs on every rank of ``nbaccel.Workers``;
``%nbaccel_debug``: pdb at the frame where a rank's last call raised (docs/debugging.md).

``%load_ext nbaccel`` registers it (``nbaccel.load_ipython_extension``). The cell runs in
each rank's persistent namespace, on the last ``Workers`` made, or the one named:
``%%nbaccel workers``. ``--ranks all`` (or ``--ranks 0,1``) shows those ranks' output for
this cell instead of ``log_ranks``'s. The value of the cell's last line, when it is an
expression, is shown as rank 0's repr. A wrong line, ranks the workers lack, or IPython
syntax in the cell (which the ranks do not run) is refused before anything is sent, as
IPython refuses a magic's bad arguments (``UsageError``). A rank's error is raised at the
cell's line that failed on the rank (``<nbaccel cell N>``, N the cell's ``In [N]``), with
nbaccel's own frames hidden from IPython's traceback (``__tracebackhide__``). An entry
point: it imports IPython, and only when the extension is loaded.
"""

from __future__ import annotations

import argparse
import ast
import linecache
import shlex
from collections.abc import Callable
from typing import Any, NoReturn

from nbaccel.launcher.interactive.calls import check_ranks, raise_at_rank_line
from nbaccel.launcher.interactive.workers import WorkerGroup, last_workers


class CellRefused(ValueError):
    """What is wrong with a ``%%nbaccel`` line or cell, found before anything is sent."""


class RankRepr(str):
    """A rank's repr text, shown as it is (IPython would quote a plain str)."""

    def __repr__(self) -> str:
        return str(self)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="%%nbaccel", add_help=False)
    parser.add_argument("workers", nargs="?", help="the Workers variable (default: the last made)")
    parser.add_argument("--ranks", default=None, help="whose output to show: 'all' or '0,1'")
    return parser


USAGE = "%%nbaccel [workers_variable] [--ranks all|0,1]"


def parse_line(line: str) -> tuple[str | None, frozenset[int] | None]:
    """The magic's line: the Workers variable's name and the ranks to show.

    >>> parse_line("workers --ranks 0,1")
    ('workers', frozenset({0, 1}))
    >>> parse_line("--ranks all")
    (None, frozenset())
    >>> parse_line("--ranks one")
    Traceback (most recent call last):
    nbaccel.interactive.magic.CellRefused: %%nbaccel --ranks one: expected 'all' or a comma ...
    """
    try:
        options = _parser().parse_args(shlex.split(line))
    except SystemExit:
        raise CellRefused(f"%%nbaccel {line}: expected `{USAGE}`.") from None
    ranks: frozenset[int] | None = None
    if options.ranks is not None:
        text = options.ranks.strip()
        parts = [part.strip() for part in text.split(",")]
        if text != "all" and not all(part.isdigit() for part in parts):
            raise CellRefused(
                f"%%nbaccel --ranks {options.ranks}: expected 'all' or a comma list of ranks "
                "such as 0,1."
            )
        ranks = frozenset() if text == "all" else frozenset(map(int, parts))
    return options.workers, ranks


def nbaccel_cell(
    line: str,
    cell: str,
    namespace: dict[str, Any],
    number: int,
    transform: Callable[[str], str] | None = None,
) -> Any:
    """Run ``cell`` on the workers the line names (or the last made); rank 0's last value.

    ``number``: the cell's ``In [N]``; ``transform``: IPython's input transformer (to tell
    IPython syntax from Python's). What is wrong with the line or the cell raises
    ``CellRefused`` before anything is sent (the magic shows it as a ``UsageError``).
    """
    __tracebackhide__ = True  # IPython shows the cell, not nbaccel's frames
    name, ranks = parse_line(line)
    workers = namespace.get(name) if name is not None else last_workers()
    if not isinstance(workers, WorkerGroup):
        where = f"{name!r} is not an nbaccel.Workers" if name else "no nbaccel.Workers exists"
        raise NameError(
            f"%%nbaccel: {where}. Start workers first: workers = nbaccel.Workers(num_processes=2)"
        )
    if ranks:
        asked = f"%%nbaccel --ranks {','.join(map(str, sorted(ranks)))}"
        try:
            check_ranks(ranks, workers.world_size, asked)
        except ValueError as error:
            raise CellRefused(str(error)) from None
    if transform is not None:
        refuse_ipython_syntax(cell, transform)
    filename = f"<nbaccel cell {number}>"
    try:
        values = workers.run_cell(cell, filename, show_ranks=ranks, kernel_names=namespace)
    except Exception as error:  # noqa: BLE001 - raised again, at the cell's failing line
        raise_at_cell_line(error, filename, cell)
    first = values.get(min(values)) if values else None
    return None if first is None else RankRepr(first)


_KINDS = (  # what IPython made of a line -> what the user wrote, and a plain-Python way
    (".system(", "a shell command (!)", " (subprocess.run for a shell command)"),
    (".getoutput(", "a shell command (!)", " (subprocess.run for a shell command)"),
    ("run_line_magic('pinfo", "a help request (?)", ""),
    ("run_line_magic('psearch", "a help request (?)", ""),
    ("run_line_magic(", "a line magic (%)", ""),
    ("run_cell_magic(", "a cell magic (%%)", ""),
)


def refuse_ipython_syntax(cell: str, transform: Callable[[str], str]) -> None:
    """Refuse a cell with IPython syntax (magics ``%``, shell ``!``, help ``?``): the ranks run
    plain Python. Only a cell that is not Python is looked at, at the line Python refuses.

    >>> from IPython.core.inputtransformer2 import TransformerManager
    >>> refuse_ipython_syntax("import os\\n!ls", TransformerManager().transform_cell)
    Traceback (most recent call last):
    nbaccel.interactive.magic.CellRefused: %%nbaccel: line 2 of the cell, `!ls`, is IPython ...
    """
    try:
        ast.parse(cell)
        return
    except SyntaxError as error:
        number = error.lineno
    lines = cell.splitlines()
    if number is None or not 1 <= number <= len(lines):
        return  # the ranks report it, as Python does
    text = lines[number - 1].strip()
    try:
        python = transform(text + "\n")
        ast.parse(python)
    except (SyntaxError, ValueError):  # IPython cannot read it either: Python's error stands
        return
    if python.strip() == text:
        return  # the same line: the trouble is elsewhere (an unclosed bracket above...)
    kind, hint = next(((k, h) for mark, k, h in _KINDS if mark in python), ("IPython syntax", ""))
    raise CellRefused(
        f"%%nbaccel: line {number} of the cell, `{text}`, is IPython syntax ({kind}), which "
        f"does not run on the ranks: they run plain Python. Write it in plain Python{hint}, "
        "or run it in an ordinary cell (it then runs in the kernel)."
    )


def raise_at_cell_line(error: BaseException, filename: str, cell: str) -> NoReturn:
    """Raise a rank's ``error`` from the cell's line that failed on the rank
    (``calls.raise_at_rank_line``), the cell's source known to the kernel's traceback."""
    __tracebackhide__ = True
    if filename not in linecache.cache:  # the kernel's traceback shows the line's source
        linecache.cache[filename] = (len(cell), None, cell.splitlines(keepends=True), filename)
    raise_at_rank_line(error, filename)


def running_cell(ipython: Any) -> int:
    """The number of the cell running now: IPython's own (``In [N]``, ``Cell In[N]`` in its
    tracebacks), from the cell's execution result. IPython 9 counts the next cell already
    while one runs; IPython 8 did not: ``execution_count`` is right in one of them only."""
    result = getattr(getattr(ipython, "displayhook", None), "exec_result", None)
    number = getattr(result, "execution_count", None)
    return number if isinstance(number, int) else int(ipython.execution_count)


def nbaccel_debug(line: str, namespace: dict[str, Any]) -> None:
    """``%nbaccel_debug [workers_variable] [--rank N]``: pdb in the cell at the frame where
    a rank's last call raised, as IPython's ``%debug`` (``workers.debug``). A wrong line
    raises ``CellRefused`` before anything is sent.

    >>> nbaccel_debug("--rank one", {})
    Traceback (most recent call last):
    nbaccel.interactive.magic.CellRefused: %nbaccel_debug --rank one: expected `%nbaccel_debug ...
    """
    parser = argparse.ArgumentParser(prog="%nbaccel_debug", add_help=False)
    parser.add_argument("workers", nargs="?")
    parser.add_argument("--rank", type=int, default=None)
    try:
        options = parser.parse_args(shlex.split(line))
    except SystemExit:
        raise CellRefused(
            f"%nbaccel_debug {line}: expected `%nbaccel_debug [workers_variable] [--rank N]`."
        ) from None
    name = options.workers
    workers = namespace.get(name) if name is not None else last_workers()
    if not isinstance(workers, WorkerGroup):
        where = f"{name!r} is not an nbaccel.Workers" if name else "no nbaccel.Workers exists"
        raise CellRefused(f"%nbaccel_debug: {where}; it debugs a rank of interactive workers.")
    workers.debug(options.rank)


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%%nbaccel`` and ``%nbaccel_debug`` in an IPython shell (``%load_ext
    nbaccel``)."""
    from IPython.core.error import UsageError

    def magic(line: str, cell: str) -> Any:
        __tracebackhide__ = True
        number, transform = running_cell(ipython), ipython.input_transformer_manager.transform_cell
        try:
            return nbaccel_cell(line, cell, ipython.user_ns, number, transform)
        except CellRefused as error:  # as IPython shows a magic's misuse: no traceback
            raise UsageError(str(error)) from None

    magic.__doc__ = __doc__
    ipython.register_magic_function(magic, magic_kind="cell", magic_name="nbaccel")

    def debug_magic(line: str) -> None:
        try:
            nbaccel_debug(line, ipython.user_ns)
        except CellRefused as error:
            raise UsageError(str(error)) from None

    debug_magic.__doc__ = nbaccel_debug.__doc__
    ipython.register_magic_function(debug_magic, magic_kind="line", magic_name="nbaccel_debug")
