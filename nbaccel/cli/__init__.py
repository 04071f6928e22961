"""The ``nbaccel`` command line (``main.py`` dispatches to one module per command).

Entry point only: nothing in the library imports it.
"""

from nbaccel.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
