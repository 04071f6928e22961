"""Parent side of the helper process: one shared helper, started on first use, replaced
when it must go; which libraries it is offered, and what the next launch's output says.

One helper serves every launch of a kernel (that is what makes later launches as fast as a
fork). It is started from a clean interpreter with ``subprocess``, so it never inherits the
kernel's CUDA context, threads or sockets (``helper_process.HelperProcess``: the handle on
one helper). If the helper dies, runs in flight fail with HelperError and the next launch
starts a new one; a helper that retires serves the runs in flight and the launch being
started on it (``held_helper``), and goes after.

In a Jupyter kernel the helper is started at ``import nbaccel`` (``nbaccel.launcher.prewarm``)
from a background thread, through the same ``shared_helper`` a launch calls: one lock, so a
launch that comes meanwhile waits for that start instead of making a second helper.

``offer_libraries`` tells the helper which installed libraries this process (and the last
launch's workers) imported, for it to preload before forking the next spares
(``preload_choice`` picks them; the helper checks each). A library that made the helper
unsafe to fork retires that helper, with what led to it (``import_trace``): the next launch
gets one that never imports them, and its text output says so.

Before each launch (in a kernel also after each cell) ``shared_helper`` checks with a few
stat calls that the installed files the helper loaded are still those on disk
(``installed_files``). If one changed (a ``pip install`` in the notebook), the helper retires
and the launch's output says ``nbaccel: reloaded: NAME (changed on disk)``. A retired helper
is replaced by its successor, forked when it said "ready", with torch imported (ready in
milliseconds: ``successor``), or by a fresh helper where that is stale too; the replacement
is asked for what the old one was, and imports it from the disk as it is now.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from nbaccel.env_names import PREWARM_VAR
from nbaccel.errors import HelperError
from nbaccel.launcher.local.helper_process import HelperProcess
from nbaccel.launcher.local.preloading.preload_choice import PreloadChoice


def refusal_notice(names: list[str], why: str, culprit: str | None, unsafe: bool) -> str:
    """What a launch's output says of libraries the helper refused.

    >>> refusal_notice(["thready"], "it started a thread at import", "thready", True)
    'not preloaded: thready (it started a thread at import); workers import it themselves, \
and a fresh helper was started'
    >>> print(refusal_notice(["datasets", "pandas", "pyarrow"], "it started a thread at "
    ...                      "import", "pyarrow", True))  # doctest: +NORMALIZE_WHITESPACE
    not preloaded: datasets, pandas, pyarrow (pyarrow: it started a thread at import; the
    others import it); workers import them themselves, and a fresh helper was started
    """
    if len(names) == 1:
        told, them = f"{names[0]} ({why})", "it"
    else:
        told, them = f"{', '.join(names)} ({culprit}: {why}; the others import it)", "them"
    fresh = ", and a fresh helper was started" if unsafe else ""
    return f"not preloaded: {told}; workers import {them} themselves{fresh}"


# Which of this process's modules may be preloaded (judged once each), and what the helper
# refused, for the text output of the next launch. Caches of this process, like the helper.
CHOICE = PreloadChoice()
NOTICES: list[str] = []


class _ThisProcess:
    """What every ``HelperProcess`` of this process asks of it (``helper_process.Kernel``):
    ``CHOICE`` is looked up at each call (a test may put another in its place)."""

    def choose_files(self, modules: Iterable[tuple[str, str | None]]) -> list[str]:
        return CHOICE.choose_files(modules)

    def refused(self, helper: HelperProcess, message: dict[str, Any]) -> None:
        names = list(message.get("refused") or [message["module"]])
        for name in names:  # first: its replacement is asked for what was offered but these
            CHOICE.refuse(name)
        unsafe = bool(message.get("unsafe"))
        NOTICES.append(refusal_notice(names, message["why"], message.get("culprit"), unsafe))
        if unsafe:  # replaced at once: the replacement is ready for the next launch
            helper.stop_new_launches()
            threading.Thread(
                target=_replace, args=(helper,), name="nbaccel-renew", daemon=True
            ).start()


THIS_PROCESS = _ThisProcess()


def offer_libraries(helper: HelperProcess, modules: Mapping[str, Any] | None = None) -> None:
    """Offer the helper the installed libraries this process imported (``sys.modules``)."""
    if helper.preload_wanted:
        helper.preload(CHOICE.choose(sys.modules if modules is None else modules))


def take_notices() -> list[str]:
    """What the helper refused since the last call (each told once)."""
    told = list(NOTICES)
    del NOTICES[: len(told)]
    return told


# Starting the helper is one Popen (milliseconds; its torch import then runs on its own):
# a launch waits this long for a start made by another thread before giving up.
HELPER_START_TIMEOUT_S = 60.0

_shared: HelperProcess | None = None
_shared_lock = threading.Lock()


def shared_helper(timeout: float = HELPER_START_TIMEOUT_S) -> HelperProcess:
    """The helper for this process, started on first use (or again if it died).

    A call made while another thread is starting it (the prewarm at ``import nbaccel``)
    waits for that start, at most ``timeout`` seconds, and gets the same helper.
    This is a resource cache, like a connection pool: it holds no configuration.
    """
    with _helper_lock(timeout):
        return _current()


@contextlib.contextmanager
def held_helper(timeout: float = HELPER_START_TIMEOUT_S) -> Iterator[HelperProcess]:
    """``shared_helper``, held while a launch is started on it: if it retires meanwhile (a
    library it preloaded turned out unsafe to fork with, a file it loaded changed), it is not
    closed under the launch, and serves it (from its spares, or from spares started in a
    fresh interpreter where forking became unsafe); it goes once the launch's run ends."""
    with _helper_lock(timeout):
        helper = _current()
        helper.hold()
    try:
        yield helper
    finally:
        helper.release()


@contextlib.contextmanager
def _helper_lock(timeout: float) -> Iterator[None]:
    if not _shared_lock.acquire(timeout=timeout):
        raise HelperError(
            f"the nbaccel helper process was still being started by another thread after "
            f"{timeout:.0f} s: starting a process (subprocess.Popen of {sys.executable}) did "
            "not return, which points at a machine out of memory or process ids. Free some "
            f"and launch again; {PREWARM_VAR}=0 before starting the kernel turns off the "
            "start at import."
        )
    try:
        yield
    finally:
        _shared_lock.release()


def _current() -> HelperProcess:
    """The shared helper, checked, replaced or started as needed (under ``_shared_lock``)."""
    global _shared
    if _shared is not None and _shared.usable:
        _shared = _checked(_shared)
    if _shared is None or not _shared.alive:
        gone = _shared is not None
        _shared = HelperProcess(os.environ, THIS_PROCESS)
        if gone:
            _shared.starting = "a new helper imports torch (the last one exited)"
    elif not _shared.usable:  # retired (unsafe) before its replacement was made
        _shared = _replacement(_shared, set())
    return _shared


def renew_if_changed() -> None:
    """Replace the shared helper now if what it preloaded changed on disk (in a kernel,
    after each cell: a ``pip install`` cell is followed by a pause, in which the successor
    preloads). Never waits for another thread, never starts a first helper."""
    global _shared
    if not _shared_lock.acquire(blocking=False):
        return  # a launch or the prewarm holds it: the launch checks itself
    try:
        if _shared is not None and _shared.usable:
            _shared = _checked(_shared)
    finally:
        _shared_lock.release()


# How long a launch waits for a successor's "ready" (a fork's child answering; the old
# helper hands it the socket even mid-import) before it starts a fresh helper instead.
SUCCESSOR_READY_TIMEOUT_S = 10.0


def _checked(helper: HelperProcess) -> HelperProcess:
    """``helper`` if every installed file it loaded is still on disk as it was, else its
    replacement, with the notice for the next launch (under ``_shared_lock``)."""
    changed = helper.changed_on_disk()
    if not changed:
        return helper
    NOTICES.append(changed.notice())
    return _replacement(helper, changed.paths)


def _replacement(old: HelperProcess, stale: set[str]) -> HelperProcess:
    """A helper to replace ``old``: its successor unless ``stale`` files are in its base
    (or it has none, or it fails), else a fresh one; asked for what ``old`` was asked for
    (never what was refused), read from the disk as it is now. ``old`` retires."""
    new = old.succeed() if not old.base_holds(stale) else None
    if new is not None and not new.wait_ready(SUCCESSOR_READY_TIMEOUT_S):
        new.close()
        new = None
    if new is None:
        new = HelperProcess(os.environ, THIS_PROCESS)
        new.starting = "a new helper imports torch (the last one was retired)"
    new.preload_wanted = old.preload_wanted
    if new.preload_wanted:
        new.preload([name for name in old.offered if not CHOICE.refused(name)])
    old.retire()
    return new


def _replace(helper: HelperProcess) -> None:
    """A library made ``helper`` unsafe: replaced now if it is the shared one."""
    global _shared
    with _shared_lock:
        if _shared is helper:
            _shared = _replacement(helper, set())  # which retires it
        else:
            helper.retire()  # closed once its runs end


def current_helper() -> HelperProcess | None:
    """The shared helper if one is started and usable; never starts one."""
    helper = _shared
    return helper if helper is not None and helper.usable else None


def shutdown_shared_helper() -> None:
    """Stop the shared helper (tests use it; the helper also exits with this process)."""
    global _shared
    with _shared_lock:
        helper, _shared = _shared, None
    if helper is not None:
        helper.close()
