"""Widgets or text: what a launch shows, decided without importing ipywidgets or torch.

``dashboard="auto"`` shows the widget dashboard inside a Jupyter kernel (an IPython shell
that talks ZMQ: JupyterLab, Notebook, VS Code, Colab) when ipywidgets is installed, and
rank-labelled text anywhere else (a terminal, a script, IPython in a terminal, where
widgets cannot render). ``"text"`` or ``False``: text only. ``True``: widgets, or an error
before anything starts if ipywidgets is missing. Stdlib only.
"""

from __future__ import annotations

import importlib.util
import sys

from nbaccel.errors import ConfigError

INSTALL_HINT = "pip install nbaccel[notebook]"


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


def wants_widgets(dashboard: str | bool) -> bool:
    """Whether a launch with this ``dashboard`` argument shows the widget dashboard.

    >>> wants_widgets("auto"), wants_widgets("text"), wants_widgets(False)
    (False, False, False)
    """
    if dashboard == "text" or dashboard is False:
        return False
    if dashboard is True:
        if not widgets_installed():
            raise ConfigError(
                "dashboard=True asks for the widget dashboard, but ipywidgets is not installed "
                f"in this kernel's environment. Install the notebook extra: {INSTALL_HINT} "
                "(ipywidgets, matplotlib), then restart the kernel; or use dashboard='text'."
            )
        return True
    return in_kernel() and widgets_installed()
