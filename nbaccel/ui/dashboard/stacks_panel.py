"""The dashboard's stacks panel: where every rank is, from a stall warning or the Stacks button.

A ``StallWarning`` (no rank printed, logged a metric or finished a step for ``stall_warning``
seconds) or the answer to the Stacks button (``Run.stacks``) replaces what the panel shows:
a line saying why, then one block per rank, its first line (the user's function it is in,
the collective it waits in) as the block's summary and every thread's stack inside. Plain
HTML in one ``ipywidgets.HTML``, written with the dashboard's text.
"""

from __future__ import annotations

import html
import time
from collections.abc import Mapping

from nbaccel.events import Event, StallWarning
from nbaccel.launcher.printer import seconds_text

# What the button's tooltip and a blocking dashboard say: clicks wait for the cell's end.
BLOCKING_STACKS_NOTE = (
    "While this cell runs, the browser's clicks reach the kernel only after it ends: the stall "
    "warning shows every rank's stack here when the run goes quiet (stall_warning). Launch "
    "with nbaccel.launch(...) for a Stacks button that works while the run goes on."
)


class StacksPanel:
    """Stall warnings and Stacks answers in, HTML out (the dashboard's UI thread).

    >>> panel = StacksPanel()
    >>> panel.html()
    ''
    >>> panel.handle(StallWarning(120.0, {0: "rank 0: in train (t.py:3), waiting in barrier\\n"
    ...                                      "Thread MainThread (main):"}, {0: "barrier"}, 0.0))
    True
    >>> "No rank printed" in panel.html() and "waiting in barrier" in panel.html()
    True
    """

    def __init__(self) -> None:
        self._title = ""
        self._stacks: dict[int, str] = {}
        self._warning = False
        self._stall: StallWarning | None = None  # the last stall warning, for the summary

    def handle(self, event: Event) -> bool:
        """Take an event; True when it was a stall warning (the panel changed)."""
        if not isinstance(event, StallWarning):
            return False
        quiet = seconds_text(event.seconds)
        self._title = (
            f"No rank printed, logged a metric or finished a step for {quiet} "
            "(stall_warning): where each rank is now. The run goes on."
        )
        self._stacks, self._warning = dict(event.stacks), True
        self._stall = event
        return True

    def summary(self) -> str:
        """The last stall warning for the summary a saved notebook keeps (the live panel's
        stacks are gone with the widgets): why, then the first line of each rank's stack
        (its function and line, the collective it waited in); "" when there was none.

        >>> panel = StacksPanel()
        >>> stacks = {0: "rank 0: in train (t.py:3)\\nThread MainThread (main):"}
        >>> panel.handle(StallWarning(0.500663, stacks, {0: None}, 0.0))
        True
        >>> print(panel.summary())  # doctest: +ELLIPSIS
        stall warning: no rank printed, logged a metric or finished a step for 0.5 s ...
          rank 0: in train (t.py:3)
        """
        if self._stall is None:
            return ""
        stacks = self._stall.stacks
        where = [f"  {stacks[rank].splitlines()[0]}" for rank in sorted(stacks) if stacks[rank]]
        head = (
            "stall warning: no rank printed, logged a metric or finished a step for "
            f"{seconds_text(self._stall.seconds)} (stall_warning); where each rank was:"
        )
        return "\n".join([head, *where])

    def take(self, stacks: Mapping[int, str] | str, when: float | None = None) -> None:
        """The Stacks button's answer: ``{rank: text}``, or why there is none."""
        clock = time.strftime("%H:%M:%S", time.localtime(when))
        if isinstance(stacks, str):
            self._title, self._stacks = f"Stacks at {clock}: {stacks}", {}
        else:
            self._title, self._stacks = f"Stacks at {clock}: where each rank is now.", dict(stacks)
        self._warning = False

    def html(self) -> str:
        """The panel, or "" before anything was asked or warned (nothing shown)."""
        if not self._title:
            return ""
        colour = "#f0ad4e" if self._warning else "#4c9be8"
        blocks = []
        for rank in sorted(self._stacks):
            head, _, rest = self._stacks[rank].partition("\n")
            blocks.append(
                f"<details><summary><code>{html.escape(head)}</code></summary>"
                f"<pre style='margin:2px 0 6px 12px'>{html.escape(rest)}</pre></details>"
            )
        return (
            f"<div style='border-left:4px solid {colour};padding:4px 8px'>"
            f"<b>{html.escape(self._title)}</b>{''.join(blocks)}</div>"
        )
