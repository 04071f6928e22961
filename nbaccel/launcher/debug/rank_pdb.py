"""``ChannelPdb``: Python's own ``pdb.Pdb``, typed into from the kernel's cell.

Its stdin and stdout are a rank's debug channel (``rank_channel.py``): what pdb writes is
held until it reads a line, then goes to the kernel with the prompt in one frame; the line
typed in the cell comes back. Each time pdb stops (the breakpoint, then every ``n``, ``s``
or breakpoint after ``c``) it asks the kernel first whether someone can answer; when it
resumes, it says so, and whether it is stepping (it will stop again soon) or not. pdb is
used through its public API only (``Pdb(stdin=, stdout=)``, ``set_trace``, ``interaction``),
so its commands are Python's, whatever the version. Each interaction holds the link's lock
(one pdb at a time in the rank: its threads share one channel). Stdlib only.
"""

from __future__ import annotations

import io
import pdb
import sys
import threading
from types import FrameType, TracebackType
from typing import Protocol

from nbaccel.launcher.debug.stacks import launcher_file

# Frames pdb never steps into: nbaccel's launcher under the user's function (the bootstrap,
# the serve loop), so ``n`` at the function's last line ends the session instead of stopping
# in the launcher's code.
SKIPPED_MODULES = ("nbaccel.launcher.*",)


class Skipped(Exception):
    """The kernel cannot take this session after all (its frontend refused input)."""


class SessionLink(Protocol):
    """What a ``ChannelPdb`` needs of the rank's channel (``rank_channel.RankDebugger``)."""

    lock: threading.RLock  # held by the thread in pdb: one at a time

    def ask(self, kind: str, where: str) -> tuple[bool, str]:
        """Whether someone in the kernel can answer a stop of ``kind`` at ``where``; why not."""

    def read_line(self, output: str, prompt: str) -> str | None:
        """Send ``output`` and ``prompt``; the line typed (None: end of input, the session
        is over). Raises ``Skipped`` or ``KeyboardInterrupt``."""

    def resumed(
        self, output: str, stepping: bool, quitting: bool, interrupted: bool = False
    ) -> None:
        """pdb let the program run again (``stepping``: it will stop again soon), or quit
        (``quitting``: ``q``, the run ends), or left because the rank was interrupted."""

    def skipped(self, where: str, why: str) -> None:
        """Say, once, that a stop was skipped and why."""


class _HeldOutput(io.StringIO):
    """pdb's stdout: kept until the next prompt (``take``), so one frame carries both."""

    def take(self) -> str:
        text = self.getvalue()
        self.seek(0)
        self.truncate()
        return text

    def flush(self) -> None:
        """Nothing: everything goes with the next prompt or at resume."""


class _LineReader:
    """pdb's stdin: each ``readline`` sends the held output and the prompt, and waits."""

    def __init__(self, owner: ChannelPdb) -> None:
        self._owner = owner

    def readline(self) -> str:
        owner = self._owner
        held = owner.held.take()
        prompt = owner.prompt
        output = held[: -len(prompt)] if prompt and held.endswith(prompt) else held
        try:
            line = owner.link.read_line(output, prompt)
        except KeyboardInterrupt:
            # pdb would catch it and read again; the run is being interrupted: leave pdb
            # (end of input quits it) and raise it in the user's code (``interaction``).
            owner.interrupted = True
            return ""
        return "" if line is None else line + "\n"


class ChannelPdb(pdb.Pdb):
    """A pdb session over a rank's channel.

    >>> import threading
    >>> class Typed:  # a kernel that types two commands
    ...     lines = ["p x * 2", "c"]
    ...     lock = threading.RLock()
    ...     def ask(self, kind, where): return True, ""
    ...     def read_line(self, output, prompt):
    ...         print(output, end=""); return self.lines.pop(0)
    ...     def resumed(self, output, stepping, quitting, interrupted=False): print(output, end="")
    ...     def skipped(self, where, why): print("skipped", why)
    >>> cell = {"__name__": "__main__", "ChannelPdb": ChannelPdb, "Typed": Typed, "sys": sys}
    >>> exec('''def f():
    ...     x = 21
    ...     ChannelPdb(Typed(), "(Pdb rank 1) ").set_trace(sys._getframe())
    ...     return x''', cell)
    >>> cell["f"]()  # doctest: +ELLIPSIS
    > <string>(4)f()
    42
    21
    """

    def __init__(self, link: SessionLink, prompt: str) -> None:
        self.link = link
        self.held = _HeldOutput()
        super().__init__(
            stdin=_LineReader(self),  # type: ignore[arg-type]
            stdout=self.held,
            skip=SKIPPED_MODULES,
            nosigint=True,  # no SIGINT handler of pdb's: the run's interrupt stays the run's
            readrc=False,  # a ~/.pdbrc written for a terminal is not read on every rank
        )
        self.prompt = prompt
        self.use_rawinput = False
        self.interrupted = False
        self._first = True  # the stop the kernel already answered (set_trace, post_mortem)
        # The link's lock, taken for the first stop before it was asked (set_trace): given
        # back when that stop's interaction ends.
        self.holds_lock = False

    def interaction(self, frame: FrameType | None, tb: TracebackType | None) -> None:
        with self.link.lock:  # a second thread that stops meanwhile waits for this session
            try:
                self._interact(frame, tb)
            finally:
                if self.holds_lock:
                    self.holds_lock = False
                    self.link.lock.release()

    def _interact(self, frame: FrameType | None, tb: TracebackType | None) -> None:
        if not self._first:  # a later stop (n, s, a breakpoint): asked again
            yes, why = self.link.ask("step", self._where(frame, tb))
            if not yes:
                self.link.skipped(self._where(frame, tb), why)
                self._leave()
                return
        self._first = False
        skipped = False
        try:
            super().interaction(frame, tb)
        except Skipped:
            skipped = True
            self.forget()
        stepping = not (skipped or self.quitting) and self.stopframe is not self.botframe
        quitting = self.quitting and not (skipped or self.interrupted) and frame is not None
        self.link.resumed(
            self.held.take(), stepping and not self.interrupted, quitting, self.interrupted
        )
        if skipped:
            self._leave()
        if self.interrupted:
            self.interrupted = False
            raise KeyboardInterrupt

    def get_stack(
        self, f: FrameType | None, t: TracebackType | None
    ) -> tuple[list[tuple[FrameType, int]], int]:
        """pdb's stack without the frames under the user's code that are nbaccel's launcher
        or ``runpy``'s (the helper that forked the worker, the bootstrap): ``w`` starts and
        ``u`` ends at the user's outermost frame."""
        stack, index = super().get_stack(f, t)
        cut = 0
        while cut < min(index, len(stack) - 1) and _not_users(stack[cut][0]):
            cut += 1
        return stack[cut:], index - cut

    def post_mortem(self, tb: TracebackType) -> None:
        """Open the session at ``tb``'s innermost frame (the frame that raised)."""
        self.reset()
        self.interaction(None, tb)

    def _leave(self) -> None:
        """Let the program run on without stopping again (nobody answers)."""
        self.clear_all_breaks()
        self.set_continue()
        sys.settrace(None)

    @staticmethod
    def _where(frame: FrameType | None, tb: TracebackType | None) -> str:
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None:
            frame = tb.tb_frame
        return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


def _not_users(frame: FrameType) -> bool:
    return launcher_file(frame.f_code.co_filename)
