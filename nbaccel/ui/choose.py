"""Widgets or text: what a launch shows, decided without importing ipywidgets or torch.

``dashboard="auto"`` shows the widget dashboard inside a Jupyter kernel (an IPython shell
that talks ZMQ: JupyterLab, Notebook, VS Code, Colab) when ipywidgets is installed, and
rank-labelled text anywhere else (a terminal, a script, IPython in a terminal, where
widgets cannot render). ``"text"`` or ``False``: text only. ``True``: widgets, or an error
before anything starts if ipywidgets is missing. Imports neither ipywidgets nor torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from nbaccel.errors import ConfigError
from nbaccel.launcher.planned import Display
from nbaccel.launcher.printer import TextPrinter
from nbaccel.launcher.run import Run
from nbaccel.ui.kernel import in_kernel, widgets_installed

DASHBOARD_CHOICES = ("auto", "text", True, False)

INSTALL_HINT = "pip install nbaccel[notebook]"


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


def choose_display(dashboard: str | bool, *, blocking: bool) -> Display:
    """What shows a launch: the widget dashboard in the calling cell, or rank-labelled text
    on ``sys.stdout``. Bad choices fail here, before anything starts.

    >>> choose_display("fancy", blocking=True)
    Traceback (most recent call last):
    ...
    nbaccel.errors.ConfigError: dashboard='fancy' is not one of 'auto', 'text', True, False.
    """
    if dashboard not in DASHBOARD_CHOICES:
        raise ConfigError(f"dashboard={dashboard!r} is not one of 'auto', 'text', True, False.")
    if wants_widgets(dashboard):  # dashboard=True without ipywidgets fails here

        def show_widgets(run: Run, gpus: int) -> Callable[[], None]:
            from nbaccel.ui.attach import show_dashboard, subscribe_dashboard  # ipywidgets: now

            dashboard = subscribe_dashboard(run, blocking=blocking, gpus=gpus)
            return lambda: show_dashboard(dashboard)  # in the calling cell, as ranks start

        return show_widgets

    def show_text(run: Run, gpus: int) -> None:
        printer = TextPrinter(
            sys.stdout, run.shown_ranks(), announce_end=not blocking, host_of=run.host_of
        )
        run.subscribe(printer)

    return show_text
