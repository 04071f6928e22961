"""A line read for a rank's pdb, in a way another thread can abandon.

The console reads each line in the thread that serves the run (the cell's), as pdb would:
Jupyter's ``input()`` (an ``input_request`` to the frontend) or the terminal. When the rank
stops waiting for that line meanwhile (its worker is gone: a peer failed and the run ended;
it was interrupted), nothing would ever answer the prompt, so the hub's thread abandons the
read: ``PromptGone`` is raised in the reading thread, as an interrupt would be.

In a kernel, ipykernel's ``input()`` waits in a Python loop (a 10 ms ``zmq.select``), so an
exception set for the thread with ``PyThreadState_SetAsyncExc`` lands within 10 ms; it is a
``BaseException`` because that loop logs and swallows an ``Exception``. In a terminal,
``input()`` blocks in C, where nothing lands, so the line is awaited with ``select`` in short
spells first. The kernel's stdin socket purges a late reply before its next request. Stdlib
only.
"""

from __future__ import annotations

import builtins
import ctypes
import select
import sys
import threading
from collections.abc import Callable

SPELL_S = 0.1  # how long a terminal's wait for a line goes before an abandonment can land


class PromptGone(BaseException):
    """The rank that a prompt was for no longer waits for its line: the read is abandoned."""


class LineReader:
    """Reads lines with ``prompt`` (None: ``input()`` in a kernel, the terminal elsewhere);
    ``abandon`` from another thread ends the read in progress with ``PromptGone``.

    >>> import threading, time
    >>> def slow_typist(text):  # waits in Python code, as ipykernel's input() does
    ...     deadline = time.monotonic() + 10
    ...     while time.monotonic() < deadline:
    ...         threading.Event().wait(0.01)
    ...     return "too late"
    >>> reader = LineReader(slow_typist)
    >>> threading.Timer(0.1, reader.abandon).start()
    >>> reader.read("(Pdb) ", over=lambda: False)
    Traceback (most recent call last):
    nbaccel.launcher.debug.reading.PromptGone
    """

    def __init__(self, prompt: Callable[[str], str] | None = None) -> None:
        self._prompt = prompt
        self._lock = threading.Lock()
        self._reader: int | None = None  # the thread reading now

    def read(self, text: str, over: Callable[[], bool]) -> str:
        """The line typed at ``text``; ``PromptGone`` if abandoned or ``over()`` already."""
        prompt = self._prompt or _default_prompt()
        me = threading.get_ident()
        try:
            with self._lock:
                self._reader = me
            # Asked after the thread is known, so that an end that comes now is not missed:
            # either this sees it, or its abandon() sees this thread reading.
            if over():
                raise PromptGone
            try:
                return prompt(text)
            finally:
                with self._lock:
                    self._reader = None
                    _set_async(me, None)  # an abandonment that came as the line did
        finally:
            with self._lock:
                self._reader = None

    def abandon(self) -> None:
        """End the read in progress, if any (from any thread)."""
        with self._lock:
            if self._reader is not None and self._reader != threading.get_ident():
                _set_async(self._reader, PromptGone)


def _set_async(thread: int, error: type[BaseException] | None) -> None:
    # Untyped arguments: None is passed as NULL (clears a pending one), not as Py_None.
    exc = ctypes.py_object(error) if error is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), exc)


def _default_prompt() -> Callable[[str], str]:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if getattr(shell, "kernel", None) is not None:
        return builtins.input  # ipykernel's, while a cell runs: its wait is Python
    stdin = sys.stdin
    if stdin is not None and not stdin.closed and stdin.isatty():
        return _terminal_line
    return builtins.input


def _terminal_line(text: str) -> str:
    """``input(text)`` whose wait for the line can be abandoned: the terminal keeps what is
    typed (line editing by the terminal's own rules) until Enter, then it is read."""
    sys.stdout.write(text)
    sys.stdout.flush()
    while not select.select([sys.stdin], [], [], SPELL_S)[0]:
        pass
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")
