"""Where a rank is now: every thread's Python stack, read on the rank itself.

``stacks_now`` formats ``sys._current_frames()``: the main thread first (it runs the user's
function), then the other threads; the frames of nbaccel's launcher under the user's code
(the bootstrap, the helper that forked the worker, the serve loop of interactive workers)
and the ``threading`` module's own bootstrap are left out, and nbaccel's own threads (the
debug channel, the event writer) are named on one line. ``waits_in`` reads the collective
the main thread waits in (the innermost ``torch.distributed`` function); ``user_frame`` the
innermost frame of the user's code. Stdlib only: a rank answers without importing anything.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import traceback
from types import FrameType
from typing import Any

STACKS_TIMEOUT = 2.0  # how long a rank's channel may take to answer "stacks"
_NBACCEL = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LAUNCHER = os.path.join(_NBACCEL, "launcher") + os.sep
_THREADING = os.path.abspath(threading.__file__)
_STDLIB = tuple(
    os.path.abspath(path) + os.sep
    for path in {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}
    if path
)
# Functions of torch.distributed that only wrap the collective (c10d's logger, the
# deprecation and exception wrappers): the collective is the function they call.
_WRAPPERS = frozenset({"wrapper", "_wrapper", "inner", "_inner", "wrapped", "_wrapped"})


def stacks_now(skip: set[int] | None = None) -> dict[str, Any]:
    """This process's threads' stacks, now: ``{"text": ..., "waits_in": collective or None,
    "at": the user's innermost frame or None}``. ``skip``: thread ids not to show (the
    calling thread, which only reads the others).

    >>> now = stacks_now()
    >>> now["text"].splitlines()[0]
    'Thread MainThread (main):'
    >>> "stacks_now" in now["text"] and now["waits_in"] is None
    True
    """
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: (ident != main, names.get(ident, "")))
    sections, own = [], []
    for ident in order:
        if skip and ident in skip:
            continue
        name = names.get(ident, f"0x{ident:x}")
        if name.startswith("nbaccel-"):
            own.append(name)
            continue
        kept = shown_frames(frames[ident])
        head = f"Thread {name}" + (" (main)" if ident == main else "") + ":"
        body = "".join(traceback.format_list(kept)).rstrip("\n")
        if not body:  # no Python frame at all (a C thread), or only nbaccel's waiting
            idle = traceback.extract_stack(frames[ident])
            body = " in nbaccel's own code, idle" if idle else " (no Python frames)"
            sections.append(head + body)
            continue
        sections.append(f"{head}\n{body}")
    if own:
        sections.append("nbaccel's threads: " + ", ".join(sorted(own)))
    stack = shown_frames(frames[main]) if main in frames else []
    return {"text": "\n".join(sections), "waits_in": waits_in(stack), "at": user_frame(stack)}


def shown_frames(frame: FrameType | None) -> list[traceback.FrameSummary]:
    """A thread's frames, outermost first, without the launcher's and ``threading``'s own;
    none when all it runs is nbaccel's (a launcher frame waiting in the standard library:
    an interactive worker between calls)."""
    every = traceback.extract_stack(frame)
    kept = [summary for summary in every if not launcher_file(summary.filename)]
    if len(kept) < len(every) and all(_stdlib_file(summary.filename) for summary in kept):
        return []
    return kept


def launcher_file(filename: str) -> bool:
    """Whether ``filename`` is nbaccel's launcher's (or ``threading``'s, ``runpy``'s): code
    under the user's, which a stack or pdb need not show."""
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    return path.startswith(_LAUNCHER) or path == _THREADING or filename == "<frozen runpy>"


def waits_in(stack: list[traceback.FrameSummary]) -> str | None:
    """The ``torch.distributed`` function the innermost frames are in (the collective a rank
    waits in), or None.

    >>> frame = traceback.FrameSummary("/x/torch/distributed/distributed_c10d.py", 1, "barrier")
    >>> user = traceback.FrameSummary("/nb/train.py", 9, "train")
    >>> waits_in([user, frame]), waits_in([user])
    ('barrier', None)
    """
    for summary in reversed(stack):
        parts = summary.filename.replace(os.sep, "/")
        if "/torch/distributed/" in parts:
            if summary.name not in _WRAPPERS:
                return summary.name
            continue
        if not _library_frame(summary.filename):
            return None  # the user's own frame is innermost: not in a collective
    return None


def user_frame(stack: list[traceback.FrameSummary]) -> str | None:
    """The innermost frame of the user's code, as ``function (file:line)``: not torch's,
    nbaccel's or the standard library's.

    >>> user_frame([traceback.FrameSummary("/nb/train.py", 9, "train")])
    'train (/nb/train.py:9)'
    """
    for summary in reversed(stack):
        if not _library_frame(summary.filename):
            return f"{summary.name} ({summary.filename}:{summary.lineno})"
    return None


def _stdlib_file(filename: str) -> bool:
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    return filename.startswith("<frozen") or (
        path.startswith(_STDLIB) and "-packages" not in path.replace(os.sep, "/")
    )


def _library_frame(filename: str) -> bool:
    if filename.startswith("<frozen") or filename.startswith("<string"):
        return True
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    parts = path.replace(os.sep, "/")
    return (
        path.startswith(_NBACCEL + os.sep)
        or "/site-packages/torch/" in parts
        or "/dist-packages/torch/" in parts
        or (path.startswith(_STDLIB) and "-packages" not in parts)
    )


def describe(rank: int, host: str | None, answer: dict[str, Any]) -> str:
    """A rank's answer as text: a line saying where it is, then its threads' stacks.

    >>> print(describe(1, None, {"text": "Thread MainThread (main):", "at": "train (t.py:9)",
    ...                          "waits_in": "all_reduce"}))
    rank 1: in train (t.py:9), waiting in all_reduce
    Thread MainThread (main):
    """
    where = f"rank {rank}" + (f" on {host}" if host else "")
    parts = []
    if answer.get("at"):
        parts.append(f"in {answer['at']}")
    if answer.get("waits_in"):
        parts.append(f"waiting in {answer['waits_in']}")
    head = f"{where}: " + ", ".join(parts) if parts else where + ":"
    return f"{head}\n{answer.get('text', '')}"
