"""Decide which rank really failed, and build the exception the parent raises for it.

When one rank fails, its peers fail too, a little later ("Connection closed by peer",
collective timeouts). Blaming the first report received is wrong surprisingly often, so a
failure is classified by cause and the rank that failed on its own wins. Stdlib only.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbaccel import unpickling
from nbaccel.errors import (
    CollectiveTimeout,
    DebuggerQuit,
    RemoteTraceback,
    WorkerError,
    describe_exit,
    logs_hint,
)
from nbaccel.events import WorkerFailed

# Lower sorts first: a rank's own error or death beats a failure caused by a peer.
_PRIORITY = {"error": 0, "exit": 0, "timeout": 1, "peer": 2}


@dataclass(frozen=True)
class Failure:
    """One rank's failure: ``cause`` is 'error', 'exit', 'timeout' or 'peer'."""

    rank: int
    cause: str
    time: float
    report: WorkerFailed | None = None  # what the worker sent about it, if it could
    exitcode: int | None = None
    error: BaseException | None = None  # a launcher-side failure (the helper died)


def choose_culprit(failures: Sequence[Failure]) -> Failure:
    """The failure to report: own errors before collateral ones, then the earliest.

    >>> peer = Failure(rank=0, cause="peer", time=1.0)
    >>> killed = Failure(rank=1, cause="exit", time=2.0, exitcode=-9)
    >>> choose_culprit([peer, killed]).rank
    1
    """
    return min(failures, key=lambda f: (_PRIORITY[f.cause], f.time, f.rank))


def describe_failure(failure: Failure) -> str:
    """A failure in a few words, for the line that says the workers restart.

    >>> describe_failure(Failure(rank=1, cause="exit", time=0.0, exitcode=-9))
    'killed by SIGKILL'
    >>> report = WorkerFailed(1, "builtins.ValueError", "bad shard", "", None, "error", 0.0)
    >>> describe_failure(Failure(1, "error", 0.0, report=report))
    'raised ValueError: bad shard'
    """
    if failure.error is not None:
        return str(failure.error).splitlines()[0]
    if failure.report is not None:
        kind = failure.report.type.rsplit(".", 1)[-1]
        message = failure.report.message.strip().splitlines()
        return f"raised {kind}" + (f": {message[0]}" if message else "")
    if failure.exitcode is None:
        return "its process ended without a result"
    if failure.exitcode < 0:
        try:
            return f"killed by {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            return f"killed by signal {-failure.exitcode}"
    return f"exited with code {failure.exitcode}"


def attempt_text(attempt: int, max_restarts: int) -> str:
    """Which attempt a failure ended, for runs that restart (``max_restarts`` > 0).

    >>> attempt_text(1, 1)
    'in attempt 2 of 2, after 1 restart'
    """
    restarts = f"{attempt} restart" + ("" if attempt == 1 else "s")
    return f"in attempt {attempt + 1} of {max_restarts + 1}, after {restarts}"


def build_error(
    failure: Failure,
    *,
    world_size: int,
    collective_timeout: float,
    stuck_ranks: Sequence[int] = (),
    stuck_logs: Mapping[int, str] | None = None,
    host: str | None = None,
    restarts: tuple[int, int] | None = None,
    run_dir: Path | None = None,
) -> BaseException:
    """The exception the parent raises, with the worker traceback chained as ``__cause__``.

    ``host``: where the failing rank ran, on several machines (named in the message).
    ``restarts``: (the attempt that failed, max_restarts) of a run that restarts its workers.
    ``run_dir``: the run's folder, kept on the error as ``run_dir`` (where every rank's output
    is: ``notebook_launcher``'s caller has no ``Run``) and named where the output says why.
    """
    error = _build_error(
        failure, world_size, collective_timeout, stuck_ranks, stuck_logs, host, restarts, run_dir
    )
    if run_dir is not None:
        try:
            error.run_dir = run_dir  # type: ignore[attr-defined]
        except AttributeError:
            pass  # an exception class with __slots__: its message has what there is
    return error


def _build_error(
    failure: Failure,
    world_size: int,
    collective_timeout: float,
    stuck_ranks: Sequence[int],
    stuck_logs: Mapping[int, str] | None,
    host: str | None,
    restarts: tuple[int, int] | None,
    run_dir: Path | None,
) -> BaseException:
    if failure.error is not None:
        return failure.error
    report = failure.report
    if report is None:
        exited = describe_exit(
            failure.rank, failure.exitcode if failure.exitcode is not None else 1, run_dir
        )
        if host is not None:
            exited.args = (f"{exited.args[0]} It ran on host {host}.",)
        if restarts is not None:
            text = attempt_text(*restarts)
            exited.args = (f"{exited.args[0]} It failed {text} (max_restarts={restarts[1]}).",)
        return exited
    at = f" on host {host}" if host is not None else ""
    at += f" {attempt_text(*restarts)}" if restarts is not None else ""
    text = f"Traceback from rank {failure.rank}{at}:\n{report.traceback}"
    if run_dir is not None:  # the last line a reader sees before the error: where the rest is
        hint = logs_hint(failure.rank, run_dir)
        text = f"{text.rstrip()}\n\nRank {failure.rank}'s whole output: {hint}"
    remote = RemoteTraceback(text)
    if report.type == "bdb.BdbQuit":  # q in pdb on the rank (launch.debug): ends the run
        error: BaseException = DebuggerQuit(
            rank=failure.rank, where=report.message or None, host=host
        )
    elif failure.cause == "timeout":
        error = _timeout_error(failure, collective_timeout, stuck_ranks, stuck_logs or {})
    else:
        what = (
            f"called sys.exit({report.message})"
            if report.type == "builtins.SystemExit"
            else f"raised {report.type}: {report.message}"
        )
        original = _original_exception(report)
        if original is not None:
            _name_rank(original, failure.rank, world_size, at)
        error = original or WorkerError(
            f"rank {failure.rank}{at} {what}", rank=failure.rank, exc_type=report.type
        )
    error.__cause__ = remote
    return error


def _timeout_error(
    failure: Failure, timeout: float, stuck: Sequence[int], logs: Mapping[int, str]
) -> CollectiveTimeout:
    if stuck:
        who = f"rank(s) {', '.join(map(str, stuck))} never joined it"
        where = "".join(
            f"\n--- rank {r}, last output (stack dump) ---\n{logs.get(r, '')}" for r in stuck
        )
    else:
        who = "every rank timed out: they were waiting in different collectives (a mismatch)"
        where = ""
    message = (
        f"rank {failure.rank} waited more than collective_timeout={timeout:g} s in a collective; "
        f"{who}. Look for a rank that skips or repeats a collective (a rank-dependent branch, "
        f"uneven data), or raise collective_timeout for slow steps.{where}"
    )
    return CollectiveTimeout(message, rank=failure.rank, stuck_ranks=tuple(stuck))


def _original_exception(report: WorkerFailed) -> BaseException | None:
    """Unpickle the worker's exception, but only if its module is already loaded here.

    That keeps the parent free of torch (a torch error becomes a WorkerError naming it) and
    of any import side effects; classes defined in the notebook come back as themselves.
    Only ``Exception`` subclasses come back: a worker's SystemExit or KeyboardInterrupt
    re-raised here would end the parent's script or look like the user's own interrupt.
    """
    module = report.type.rsplit(".", 1)[0]
    if report.exception is None or module.split(".")[0] not in sys.modules:
        return None
    try:  # also refused: an error whose arguments hold a torch object (or any not loaded)
        error = unpickling.loads(report.exception)
    except Exception:  # noqa: BLE001 - any failure falls back to WorkerError
        return None
    return error if isinstance(error, Exception) else None


def _name_rank(error: BaseException, rank: int, world_size: int, at: str) -> None:
    if len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (f"[rank {rank}{at}] {error.args[0]}",)
    note = f"[nbaccel] raised on rank {rank} of {world_size}{at}; the worker's traceback is above."
    if hasattr(error, "add_note"):
        error.add_note(note)
    try:
        error.rank = rank  # type: ignore[attr-defined]
    except AttributeError:
        pass


# The files of nbaccel's launcher (the helper that forked the worker, the bootstrap): their
# frames sit below the user's in a stuck rank's stack and say nothing about where it hangs.
_LAUNCHER_FILES = f"{os.sep}nbaccel{os.sep}launcher{os.sep}"


def last_output(log: str, lines: int = 20) -> str:
    """What a stuck rank's error shows of its log: from its last stack dump (faulthandler's,
    innermost frame first), the frames that are not nbaccel's launcher's, else the log's last
    ``lines`` lines.

    >>> dump = 'step 3\\nThread 0x1 (most recent call first):\\n'
    >>> dump += '  File "/nb/t.py", line 9 in train\\n'
    >>> dump += '  File "/x/nbaccel/launcher/local/helper_main.py", line 5 in serve\\n'
    >>> print(last_output(dump))
    Thread 0x1 (most recent call first):
      File "/nb/t.py", line 9 in train
    """
    kept = log.splitlines()
    header = max(
        (i for i, line in enumerate(kept) if "(most recent call first)" in line), default=-1
    )
    if header >= 0:
        kept = [line for line in kept[header:] if _LAUNCHER_FILES not in line]
        return "\n".join(kept[:lines])
    return "\n".join(kept[-lines:])


_NOT_DEFINED = re.compile(r"name '(\w+)' is not defined")


def note_kernel_name(error: BaseException, kernel: Mapping[str, Any] | None, op: str) -> None:
    """Add a note to a rank's NameError for a name the kernel's namespace (``kernel``) has:
    the ranks have their own namespaces, and a function takes the kernel's globals when it
    is sent or launched (``op``: "exec" for a cell, "run" for a function sent to interactive
    workers, "launch" for a launched one), not later.

    >>> error = NameError("[rank 0] name 'lr' is not defined")
    >>> note_kernel_name(error, {"lr": 0.1}, "run")
    >>> said = [str(error), *getattr(error, "__notes__", [])]  # Python 3.10: in the message
    >>> print(said[-1].splitlines()[-1])  # doctest: +ELLIPSIS
    [nbaccel] 'lr' is defined in this kernel now, but it was not when the function was sent: ...
    """
    found = _NOT_DEFINED.search(str(error)) if isinstance(error, NameError) else None
    if found is None or kernel is None or found.group(1) not in kernel:
        return  # a name the kernel lacks too: the error says all there is
    name = found.group(1)
    if op == "launch":
        note = (
            f"[nbaccel] '{name}' is defined in this kernel now, but it was not when the "
            "function was launched: the workers get the globals a function uses as they are "
            "at the launch, not later. Run the cell that defines it, then launch again (or "
            "pass it as an argument)."
        )
    elif op == "exec":
        note = (
            f"[nbaccel] '{name}' is defined in this kernel, but not on the ranks: a %%nbaccel "
            "cell runs in each rank's own namespace, and a function sent to the ranks took "
            "the kernel's globals when it was sent, not later. Send it with "
            f"workers.push({name}={name}), or define it in a %%nbaccel cell."
        )
    else:
        note = (
            f"[nbaccel] '{name}' is defined in this kernel now, but it was not when the "
            "function was sent: a function takes the kernel's globals when it is sent "
            "(workers.run) or launched, not later. Run the cell that defines it first, pass it "
            f"as an argument, or send it with workers.push({name}={name})."
        )
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10: no notes
        error.args = (f"{error.args[0]}\n{note}", *error.args[1:])
