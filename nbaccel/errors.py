"""Exceptions that nbaccel raises in the parent (the notebook kernel or a script).

Every message says what happened, why, and what to do about it. Plain data, stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import types
from pathlib import Path


class CallError(TypeError):
    """The function given to a launch, or its arguments, cannot make the call; raised before
    any process starts. A ``TypeError``, as calling the function itself would raise.

    >>> raise CallError("args must be a tuple or list of positional arguments, got int.")
    Traceback (most recent call last):
    ...
    nbaccel.errors.CallError: args must be a tuple or list of positional arguments, got int.
    """


class ConfigError(ValueError):
    """A configuration value is invalid; raised before any process starts.

    >>> raise ConfigError("num_processes must be >= 1, got 0")
    Traceback (most recent call last):
    ...
    nbaccel.errors.ConfigError: num_processes must be >= 1, got 0
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class SerializationError(ValueError):
    """The function, its closure or its arguments cannot be sent to the workers."""


class HelperError(RuntimeError):
    """The helper process that starts workers could not start or died."""


# What a rank says of a stop it was not asked for itself: the agreement carries that a stop
# was asked, not why (the rank that was asked says, and the run reports its words).
ANOTHER_RANK = "asked on another rank"


class TrainingStopped(BaseException):
    """Raised in every rank's loop once all ranks saved at the same step on a stop request
    (SIGTERM/SIGUSR1, ``max_duration``, save and stop): the function ends, the rank exits 0
    and the run is ``stopped``. A BaseException, so a loop's ``except Exception`` lets it by.

    >>> TrainingStopped(1200, "/ckpt", "SIGTERM").completed_steps
    1200
    """

    def __init__(self, completed_steps: int, checkpoint_dir: str, why: str) -> None:
        super().__init__(completed_steps, checkpoint_dir, why)
        self.completed_steps, self.checkpoint_dir, self.why = completed_steps, checkpoint_dir, why

    def __str__(self) -> str:
        return (
            f"stopped ({self.why}), saved at step {self.completed_steps:,} in {self.checkpoint_dir}"
        )


class RunCancelled(RuntimeError):
    """The run was stopped before it finished, so it has no result."""


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback; chained as ``__cause__`` of the raised error."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


class WorkerError(RuntimeError):
    """A worker failed and its own exception could not be re-raised in the parent.

    Attributes name the failing rank and, for a process that died, its exit code or signal;
    ``run_dir`` is the run's folder (every rank's whole output, ``rank<N>.log``), set for a
    launch's error: ``notebook_launcher``'s caller has no ``Run`` to ask.
    """

    run_dir: Path | None = None

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        exitcode: int | None = None,
        signal_name: str | None = None,
        exc_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.signal_name = signal_name
        self.exc_type = exc_type


class WorkersEnded(RuntimeError):
    """Interactive workers (``nbaccel.Workers``) have ended, or were ended because a rank
    would not stop; the message says why. ``workers.restart()`` starts them again."""


class DebuggerQuit(WorkerError):
    """``q`` (or end of input) in pdb on a rank ended the run: every rank was stopped.

    >>> print(DebuggerQuit(rank=1, where="train.py:12"))  # doctest: +ELLIPSIS
    quit in the debugger on rank 1 (at train.py:12): every rank was stopped, so the run has ...
    """

    def __init__(
        self,
        *,
        rank: int,
        where: str | None = None,
        host: str | None = None,
        ended: str = "every rank was stopped, so the run has no result",
    ) -> None:
        at = f" on host {host}" if host else ""
        at += f" (at {where})" if where else ""
        super().__init__(
            f"quit in the debugger on rank {rank}{at}: {ended}. Type c instead of q to let "
            "the ranks run on.",
            rank=rank,
            exc_type="bdb.BdbQuit",
        )
        self.where, self.host = where, host


class CollectiveTimeout(WorkerError):
    """Ranks waited in a collective longer than ``collective_timeout`` seconds."""

    def __init__(self, message: str, *, rank: int, stuck_ranks: tuple[int, ...]) -> None:
        super().__init__(message, rank=rank)
        self.stuck_ranks = stuck_ranks


def logs_hint(rank: int, run_dir: Path | None) -> str:
    """How to read a rank's whole output from where the error is raised: its file in the run
    folder (``notebook_launcher`` returns no ``Run``), and ``run.logs`` for ``launch``'s.

    >>> print(logs_hint(1, Path("/runs/r1")))
    print(open('/runs/r1/rank1.log').read()) in a cell, or run.logs(1) on a Run from nbaccel.launch
    >>> logs_hint(1, None)
    'run.logs(1)'
    """
    if run_dir is None:
        return f"run.logs({rank})"
    log = str(run_dir / f"rank{rank}.log")
    return (
        f"print(open({log!r}).read()) in a cell, or run.logs({rank}) on a Run from nbaccel.launch"
    )


def describe_exit(rank: int, status: int, run_dir: Path | None = None) -> WorkerError:
    """Turn a raw exit code (negative = killed by that signal) into an explained error;
    ``run_dir``: the run's folder, where the rank's output is (named in the message).

    >>> str(describe_exit(1, -9)).splitlines()[0]
    'rank 1 was killed by SIGKILL (signal 9).'
    >>> describe_exit(0, 3).exitcode
    3
    """
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        message = f"rank {rank} was killed by {name} (signal {-status})."
        if name == "SIGKILL":
            message += (
                "\nNothing in the worker could report it: this is most often the kernel's "
                "out-of-memory killer. Check `dmesg`, and lower the batch size, the model size "
                "or num_processes."
            )
        elif name == "SIGSEGV":
            message += (
                "\nThe process crashed in native code; the Python stack at the crash is at the "
                f"end of its output: {logs_hint(rank, run_dir)}."
            )
        else:  # SIGABRT (a C++ exception: its text is on stderr), SIGTERM from outside, ...
            message += f"\nIts output may say why: {logs_hint(rank, run_dir)}."
        return WorkerError(message, rank=rank, signal_name=name)
    message = (
        f"rank {rank} exited with code {status} without reporting a result or an exception "
        f"(os._exit or a crash in native code). Its output: {logs_hint(rank, run_dir)}."
    )
    return WorkerError(message, rank=rank, exitcode=status)


# nbaccel's own folder: frames of its files are what a launch error leaves out.
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class hidden_frames(contextlib.AbstractContextManager[None]):
    """Around a public entry point (``launch``, ``notebook_launcher``): an error nbaccel
    raises on purpose (its own classes, a run's error, which carries ``run_dir``) leaves
    with none of nbaccel's frames, as a worker's error does. Its message says what happened
    and its causes keep their frames outside nbaccel (the user's, a library's). Any other
    exception, a bug in nbaccel, keeps every frame.

    The traceback is replaced on the way out of the ``with`` block: Python re-raises the
    exception as it is, and the caller's frames are added on top of none, so plain
    tracebacks, IPython's and pdb's post-mortem all see the user's frames only (Python 3.11+;
    3.10 re-raises the traceback it saved, whole).

    >>> import traceback
    >>> def entry():
    ...     with hidden_frames():
    ...         raise ConfigError("num_processes must be >= 1, got 0")
    >>> try:
    ...     entry()
    ... except ConfigError as error:
    ...     frames = len(traceback.extract_tb(error.__traceback__))
    >>> frames  # this doctest's own frame only (entry's: 2 before)
    1
    """

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        if error is None or not _on_purpose(error):
            return
        error.__traceback__ = None
        seen = {id(error)}
        cause = _shown_cause(error)
        while cause is not None and id(cause) not in seen:  # a chain can loop
            seen.add(id(cause))
            cause.__traceback__ = _outside_nbaccel(cause.__traceback__)
            cause = _shown_cause(cause)


def _shown_cause(error: BaseException) -> BaseException | None:
    """The exception a traceback shows above ``error``: its cause, else its context."""
    if error.__cause__ is not None:
        return error.__cause__
    return None if error.__suppress_context__ else error.__context__


# What nbaccel raises to say something (a bug is anything else).
_OURS: tuple[type[BaseException], ...] = (CallError, ConfigError, SerializationError)
_OURS += (HelperError, RunCancelled, WorkerError, WorkersEnded)


def _on_purpose(error: BaseException) -> bool:
    """An error nbaccel raised to say something: one of this module's classes, or a run's
    error (a rank's own exception type, given ``run_dir`` by the launcher)."""
    return isinstance(error, _OURS) or getattr(error, "run_dir", None) is not None


def _outside_nbaccel(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback without nbaccel's frames (those of the user and of other libraries)."""
    kept: list[types.TracebackType] = []
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_PACKAGE):
            kept.append(tb)
        tb = tb.tb_next
    rebuilt = None
    for entry in reversed(kept):
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return rebuilt
