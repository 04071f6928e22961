"""A rank's pdb session in the cell: its output printed, each line typed with ``input()``.

``DebugConsole.serve`` takes one stop from the hub (``hub.Stop``), answers it (yes, or no
and why: nobody can type), prints a header naming the rank and where it stopped, then
relays pdb's prompts: its output to ``sys.stdout``, the line from ``input(prompt)`` back
(Jupyter's input box in a kernel, the terminal elsewhere). An interrupt while it waits for
a line (■, Ctrl-C) is the caller's: the run ends as an interrupt ends it. When the rank stops
waiting for the line meanwhile (its worker ended: a peer failed, the run was stopped; it was
interrupted), the read is abandoned (``reading.LineReader``) and the cell says so and goes on.
Stdlib only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from nbaccel.launcher.debug.hub import DebugHub, Stop
from nbaccel.launcher.debug.reading import LineReader, PromptGone

_SKIPPED = object()  # no line to send: the rank was told to skip the session
_GONE = object()  # no line to send: the rank stopped waiting for it (the next frame says why)
_KINDS = {
    "breakpoint": "breakpoint()",
    "post_mortem": "an exception (post-mortem)",
    "step": "a step",
}


def nobody_to_type() -> str | None:
    """Why nobody can type into a debugger from this process now; None when someone can:
    a Jupyter kernel whose request allows input (a frontend, not nbclient/nbconvert), or a
    terminal.

    >>> import sys, io
    >>> sys.stdin, saved = io.StringIO(), sys.stdin
    >>> nobody_to_type()
    'standard input is not a terminal (a script run without one, a pipe)'
    >>> sys.stdin = saved
    """
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    kernel = getattr(shell, "kernel", None)
    if kernel is not None:  # ipykernel: its request says whether the frontend takes input
        if not getattr(kernel, "_allow_stdin", True):
            return (
                "this notebook runs without a frontend that takes input (executed headless: "
                "nbclient, nbconvert, papermill)"
            )
        return None
    stdin = sys.stdin
    if stdin is None or stdin.closed or not stdin.isatty():
        return "standard input is not a terminal (a script run without one, a pipe)"
    return None


class DebugConsole:
    """Serves the stops of one run's ranks in this process's cell or terminal.

    ``prompt``/``write``: how a line is read and output shown (``input()`` in a kernel, the
    terminal, and ``sys.stdout``; tests pass their own); ``can_type``: why nobody can type
    now, or None.
    """

    def __init__(
        self,
        hub: DebugHub,
        *,
        prompt: Callable[[str], str] | None = None,
        write: Callable[[str], None] | None = None,
        can_type: Callable[[], str | None] = nobody_to_type,
    ) -> None:
        self._hub = hub
        self._reader = LineReader(prompt)
        self._reading: Stop | None = None  # the session whose line is being read
        hub.on_session_end = self._session_ended  # the hub's thread abandons a dead read
        self._write = write or _write_stdout
        self._can_type = can_type
        self._refused: str | None = None  # the frontend refused input once: it will again
        self._last: int | None = None  # the rank of the last session shown
        self.quit_ends = "the run"  # what q ends (interactive workers: "the call")

    def serve(self, stop: Stop) -> bool:
        """Hold ``stop``'s session until the rank runs on; whether it is stepping (it will
        stop again soon, and is served before other ranks)."""
        why = self._refused or self._can_type()
        if why is not None:
            self._hub.answer(stop, False, why)
            return False
        self._hub.answer(stop, True)
        post_mortem = stop.kind == "post_mortem"
        if stop.kind != "step" or stop.rank != self._last:
            what = _KINDS.get(stop.kind, stop.kind)
            keys = "c or q leaves" if post_mortem else f"c continues, q ends {self.quit_ends}"
            self._write(
                f"--- pdb on rank {stop.rank} ({stop.host}), stopped by {what} at "
                f"{stop.where}: {keys} ---\n"
            )
        self._last = stop.rank
        while (frame := self._hub.session_frame(stop)) is not None:
            if frame.get("output"):
                self._write(str(frame["output"]))
            if frame["op"] == "resumed":
                stepping = bool(frame.get("stepping"))
                if post_mortem:
                    self._write(f"--- post-mortem of rank {stop.rank} ended ---\n")
                elif frame.get("quit"):
                    self._write(f"--- quit on rank {stop.rank}: {self.quit_ends} ends ---\n")
                elif frame.get("interrupted"):
                    self._write(
                        f"--- rank {stop.rank} was interrupted (the run or the call is being "
                        "stopped): its pdb session is over ---\n"
                    )
                elif not stepping:
                    self._write(f"--- rank {stop.rank} runs on ---\n")
                return stepping
            line = self._read(stop, str(frame.get("prompt", "(Pdb) ")))
            if line is _GONE:
                self._write("\n")  # the prompt's line ends unanswered; what follows says why
            elif line is not _SKIPPED:
                self._hub.send_line(stop, line)  # type: ignore[arg-type]
        self._write(
            f"--- rank {stop.rank} has ended: its worker is gone (the run failed or was "
            "stopped), so its pdb prompt is closed ---\n"
        )
        return False

    def _session_ended(self, rank: int | None) -> None:
        """On the hub's thread: the rank's session ended without our line (None: every
        rank's, the run ended); a read for it is abandoned."""
        reading = self._reading
        if reading is not None and rank in (None, reading.rank):
            self._reader.abandon()

    def _read(self, stop: Stop, prompt: str) -> object:
        self._reading = stop
        try:
            return self._reader.read(prompt, over=lambda: self._hub.session_over(stop))
        except PromptGone:
            return _GONE
        except EOFError:
            return None  # end of input: pdb quits, as in a terminal
        except Exception as error:
            if type(error).__name__ != "StdinNotImplementedError":
                raise
            # The frontend refused input after all: the rank leaves pdb and runs on.
            self._refused = f"this frontend does not take input ({error})"
            self._hub.skip(stop, self._refused)
            return _SKIPPED
        finally:
            self._reading = None


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
