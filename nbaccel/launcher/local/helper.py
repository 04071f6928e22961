"""Parent side of the helper process: start it on first use, ask it to fork workers.

One helper serves every launch of a kernel (that is what makes later launches as fast as a
fork). It is started from a clean interpreter with ``subprocess``, so it never inherits the
kernel's CUDA context, threads or sockets. A reader thread routes the helper's replies
(exit codes, spawn failures) to the run they belong to. If the helper dies, runs in flight fail with
HelperError and the next launch starts a new one.

In a Jupyter kernel the helper is started at ``import nbaccel`` (``nbaccel.launcher.prewarm``)
from a background thread, through the same ``shared_helper`` a launch calls: one lock, so a
launch that comes meanwhile waits for that start instead of making a second helper.

``offer_libraries`` tells the helper which installed libraries this process (and the last
launch's workers) imported, for it to preload before forking the next spares
(``preload_choice`` picks them; the helper checks each). A library that made the helper
unsafe to fork retires that helper: the next launch gets one that never imports it, and its
text output says so.

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
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from nbaccel import unpickling
from nbaccel.env_names import PREWARM_VAR
from nbaccel.errors import HelperError
from nbaccel.launcher import control
from nbaccel.launcher.local.helper_start import Adopted, start
from nbaccel.launcher.local.installed_files import Changed, InstalledCheck
from nbaccel.launcher.local.preload_choice import PreloadChoice
from nbaccel.launcher.starter import StarterListener

# nbaccel's own worker-side modules, which CHOICE leaves out (the kernel's nbaccel modules
# are not the workers'): preloaded when a launch's rank 0 imported them, as the helper does
# of its own accord when idle (warm_up.WARM_LATER), which launches back to back never are.
WORKER_MODULES = frozenset({"nbaccel.accel"})


class HelperProcess:
    """A running helper and the channel to it."""

    def __init__(
        self,
        env: Mapping[str, str],
        *,
        successor: tuple[int, socket.socket, InstalledCheck] | None = None,
    ) -> None:
        """Start a helper with ``env``; or, with ``successor`` (its pid, our socket, the
        check of the files it holds), talk to the helper an old one's base became."""
        self._process: subprocess.Popen[bytes] | Adopted
        if successor is not None:
            pid, self._sock, self._check = successor
            self._process = Adopted(pid)
        else:
            self._check = InstalledCheck()  # site-packages before the helper imports
            self._sock, self._process = start(env)
        self._base: int | None = None  # its base (successor.py), once forked
        self._base_paths: set[str] = set()  # the installed files the base holds
        self._send_lock = threading.Lock()
        self._listeners: dict[str, StarterListener] = {}
        self._listeners_lock = threading.Lock()
        self._failure: str | None = None
        self._alive = True
        self._closed = False
        self._retired = False  # unsafe, or what it preloaded changed: no new launches here
        self._holds = 0  # launches being started here (``held_helper``): it stays till they end
        self._offered: set[str] = set()  # libraries asked for, each once
        self.preloaded: dict[str, Any] = {}  # the helper's last "preloaded" report
        self._preload_seen = threading.Condition()
        self.preload_wanted = True  # the last launch's preload_libraries
        self._answered = threading.Event()  # "ready", "failed" or gone
        self._reader = threading.Thread(target=self._read_loop, name="nbaccel-helper", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def usable(self) -> bool:
        """Alive, and not retired by a library that made it unsafe to fork from."""
        return self._alive and not self._retired

    @property
    def offered(self) -> list[str]:
        """The libraries asked for so far (what a replacement is asked for again)."""
        return sorted(self._offered)

    def changed_on_disk(self) -> Changed:
        """The installed files it loaded that changed since (or may have); a few stat calls
        while no site-packages folder changed (``installed_files``)."""
        return self._check.changed()

    def base_holds(self, paths: set[str]) -> bool:
        """Whether its base holds any of these files (then a successor would be stale too)."""
        return bool(paths & self._base_paths)

    def succeed(self) -> HelperProcess | None:
        """Ask the helper to hand its base our end of a new socket: the helper that base
        becomes (not waited for: ``wait_ready``), or None without a base."""
        if self._base is None or not self._alive:
            return None
        ours, theirs = control.socket_pair()
        try:
            self._send({"op": "succeed", "parent_pid": os.getpid()}, [theirs.fileno()])
        except HelperError:
            ours.close()
            return None
        finally:
            theirs.close()
        check = self._check.keeping(self._base_paths)
        return HelperProcess({}, successor=(self._base, ours, check))

    def retire(self) -> None:
        """No new launch here; closed now if no run is in flight and no launch is being
        started here (``held_helper``), else when the last of them ends."""
        with self._preload_seen:
            self._retired = True
            self._preload_seen.notify_all()
        with self._listeners_lock:
            idle = not self._listeners and not self._holds
        if idle:
            self._close_soon()

    def hold(self) -> None:
        """A launch is being started here: a retirement leaves it open (``release``)."""
        with self._listeners_lock:
            self._holds += 1

    def release(self) -> None:
        """That launch's run has subscribed (or it failed before): a retired helper goes
        once no run is left in flight."""
        with self._listeners_lock:
            self._holds -= 1
            done = self._retired and not self._listeners and not self._holds
        if done:
            self._close_soon()

    def _close_soon(self) -> None:
        threading.Thread(target=self.close, name="nbaccel-helper-close", daemon=True).start()

    def preload(self, names: list[str]) -> None:
        """Ask the helper to import these libraries once idle (each asked for once)."""
        fresh = [name for name in names if name not in self._offered]
        if fresh and self._alive:
            self._offered.update(fresh)
            try:
                self._send({"op": "preload", "modules": fresh})
            except HelperError:
                pass  # gone: the next launch starts a new helper, and offers again

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the helper has preloaded torch (or failed, or exited); True if ready."""
        return self._answered.wait(timeout) and self._alive and self._failure is None

    def subscribe(self, run_id: str, listener: StarterListener) -> None:
        with self._listeners_lock:
            self._listeners[run_id] = listener

    def unsubscribe(self, run_id: str) -> None:
        with self._listeners_lock:
            self._listeners.pop(run_id, None)
            done = self._retired and not self._listeners and not self._holds
        if done:  # its last run ended: a retired helper goes
            self._close_soon()

    def wait_preloaded(self, timeout: float) -> bool:
        """Wait until the helper has dealt with every library offered so far (imported or
        refused), at most ``timeout`` s; False if it did not, or is retired or gone."""
        with self._preload_seen:
            done = self._preload_seen.wait_for(
                lambda: not self.usable or self.preloaded.get("asked", -1) >= len(self._offered),
                timeout,
            )
        return done and self.usable

    def offer_modules(self, modules: list[tuple[str, str | None]]) -> None:
        """What a launch's worker imported (name, file): the libraries among them are
        preloaded for the next launch (the ``WorkerStarter`` call the pump makes)."""
        ours = [name for name, _ in modules if name in WORKER_MODULES]
        self.preload(CHOICE.choose_files(modules) + ours)

    def spawn(self, request: dict[str, Any], fds: list[int]) -> None:
        """Ask for one worker; its exit code (or a spawn failure) goes to the run's listener."""
        self._send({"op": "spawn", **request}, fds)

    def signal(self, run_id: str, signum: int, ranks: list[int] | None = None) -> None:
        """Send ``signum`` to the process groups of a run's live workers."""
        self._send({"op": "signal", "run": run_id, "signal": int(signum), "ranks": ranks})

    def host_of(self, rank: int) -> str | None:
        return None  # every worker runs on this machine

    def close(self) -> None:
        """Stop the helper: it kills its workers and exits when the socket closes (once)."""
        with self._listeners_lock:
            if self._closed:
                return
            self._closed = True
        self._alive = False
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout=5)
        self._sock.close()

    def _send(self, message: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
        if not self._alive:
            raise HelperError(self._failure or "the nbaccel helper process has exited")
        try:
            with self._send_lock:
                control.send(self._sock, message, fds)
        except OSError as error:
            raise HelperError(f"lost the nbaccel helper process: {error}") from error

    def _read_loop(self) -> None:
        while True:
            try:
                message, _ = control.receive(self._sock, loads=unpickling.loads)
            except OSError:
                message = None
            if message is None:
                break
            op = message["op"]
            if op == "ready":
                self._answered.set()
                continue  # requests were queued on the socket meanwhile: nothing to wait for
            if op == "preloaded":
                with self._preload_seen:
                    self.preloaded = message
                    self._preload_seen.notify_all()
                continue
            if op == "preload_refused":
                self._refused(message)
                continue
            if op == "loaded":
                self._check.note(message["files"])
                continue
            if op == "base":
                self._base, self._base_paths = int(message["pid"]), self._check.paths()
                continue
            if op == "failed":
                self._failure = (
                    "the nbaccel helper process could not preload torch and nbaccel's worker "
                    "code. Check that torch is installed for "
                    f"{sys.executable}:\n{message['error']}"
                )
            elif op == "crashed":
                self._failure = (
                    "the nbaccel helper process failed, which is a bug in nbaccel (please "
                    "report it with this traceback); the next launch starts a new helper:\n"
                    f"{message['error']}"
                )
            else:
                with self._listeners_lock:
                    listener = self._listeners.get(message.get("run", ""))
                if listener is not None:
                    listener(message)
        self._alive = False
        self._answered.set()
        with self._preload_seen:
            self._preload_seen.notify_all()
        code = self._process.wait()
        if self._failure is None:
            self._failure = f"the nbaccel helper process exited (code {code})"
        with self._listeners_lock:
            listeners = list(self._listeners.values())
        for listener in listeners:
            listener({"op": "helper_died", "error": self._failure})

    def _refused(self, message: dict[str, Any]) -> None:
        names = list(message.get("refused") or [message["module"]])
        for name in names:
            CHOICE.refuse(name)
        unsafe = bool(message.get("unsafe"))
        NOTICES.append(refusal_notice(names, message["why"], message.get("culprit"), unsafe))
        if unsafe:  # replaced at once: the replacement is ready for the next launch
            with self._preload_seen:
                self._retired = True
                self._preload_seen.notify_all()
            threading.Thread(
                target=_replace, args=(self,), name="nbaccel-renew", daemon=True
            ).start()


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
        _shared = HelperProcess(os.environ)
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
        new = HelperProcess(os.environ)
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
