"""The kernel's handle on one helper process: start it (or adopt the successor an old one's
base became), ask it for workers, stops and preloads, and route its replies (exit codes,
spawn failures) to the run they belong to; a reader thread reads them. If the helper dies,
runs in flight fail with HelperError (``helper`` starts another for the next launch).

The process-wide part (one shared helper, its replacement, which modules to offer, what the
next launch's output says) is ``helper``'s: a ``HelperProcess`` asks it through ``Kernel``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from nbaccel import unpickling
from nbaccel.errors import HelperError
from nbaccel.launcher import control
from nbaccel.launcher.local.helper_start import Adopted, start
from nbaccel.launcher.local.preloading.installed_files import Changed, InstalledCheck
from nbaccel.launcher.starter import StarterListener


class Kernel(Protocol):
    """What a helper's handle asks of the process that owns it."""

    def choose_files(self, modules: Iterable[tuple[str, str | None]]) -> list[str]:
        """The installed libraries among these (name, file) pairs, to offer the helper."""

    def refused(self, helper: HelperProcess, message: dict[str, Any]) -> None:
        """The helper refused to preload a library (``preload_refused``), and retires where
        it made the helper unsafe."""


# nbaccel's own worker-side modules, which the kernel's choice leaves out (the kernel's
# nbaccel modules are not the workers'): preloaded when a launch's rank 0 imported them, as
# the helper does of its own accord when idle (warm_up.WARM_LATER), which launches back to
# back never are.
WORKER_MODULES = frozenset({"nbaccel.accel"})


# What the first launch of a process waits for (the helper's "ready" after its torch import).
IMPORTING_TORCH = "the helper imports torch (the first launch only; later ones fork from it)"


class HelperProcess:
    """A running helper and the channel to it."""

    def __init__(
        self,
        env: Mapping[str, str],
        kernel: Kernel,
        *,
        successor: tuple[int, socket.socket, InstalledCheck] | None = None,
    ) -> None:
        """Start a helper with ``env``; or, with ``successor`` (its pid, our socket, the
        check of the files it holds), talk to the helper an old one's base became.
        ``kernel``: what it asks of this process (which modules to offer; refusals)."""
        self._kernel = kernel
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
        # What a launch waits for until "ready" (events.Waiting); a replacement says why.
        self.starting = IMPORTING_TORCH
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
        return HelperProcess({}, self._kernel, successor=(self._base, ours, check))

    def retire(self) -> None:
        """No new launch here; closed now if no run is in flight and no launch is being
        started here (``held_helper``), else when the last of them ends."""
        self.stop_new_launches()
        with self._listeners_lock:
            idle = not self._listeners and not self._holds
        if idle:
            self._close_soon()

    def stop_new_launches(self) -> None:
        """No new launch here, but not closed yet (its base is still to succeed it:
        ``retire`` once that is done)."""
        with self._preload_seen:
            self._retired = True
            self._preload_seen.notify_all()

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
        if not self._answered.is_set():  # its workers wait for torch: said while they do
            listener({"op": "waiting", "text": self.starting})

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
        self.preload(self._kernel.choose_files(modules) + ours)

    def spawn(self, request: dict[str, Any], fds: list[int]) -> None:
        """Ask for one worker; its exit code (or a spawn failure) goes to the run's listener."""
        self._send({"op": "spawn", **request}, fds)

    def signal(
        self, run_id: str, signum: int, ranks: list[int] | None = None, *, group: bool = True
    ) -> None:
        """Send ``signum`` to the process groups of a run's live workers (``group=False``:
        to each worker's pid only)."""
        message = {"op": "signal", "run": run_id, "signal": int(signum), "ranks": ranks}
        self._send({**message, "group": group})

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
                self._kernel.refused(self, message)
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
