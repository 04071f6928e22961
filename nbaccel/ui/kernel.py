"""Where the UI runs: inside a Jupyter kernel (widgets can render) or not, and whether
ipywidgets is installed. Looked up without importing IPython or ipywidgets."""

from __future__ import annotations

import importlib.util
import sys


def in_kernel() -> bool:
    """True inside a Jupyter kernel (where widgets can render).

    >>> in_kernel()  # doctest runs in a plain interpreter
    False
    """
    ipython = sys.modules.get("IPython")  # a kernel has imported it; never import it here
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and any(
        cls.__name__ == "ZMQInteractiveShell" for cls in type(shell).__mro__
    )


def widgets_installed() -> bool:
    """Whether ipywidgets can be imported (looked up, not imported)."""
    return importlib.util.find_spec("ipywidgets") is not None
