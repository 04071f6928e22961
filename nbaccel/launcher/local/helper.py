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
unsafe to fork retires that helper: the next launch starts a fresh one that never imports
it, and its text output says so.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nbaccel import unpickling
from nbaccel.env_names import PREWARM_VAR
from nbaccel.errors import HelperError
from nbaccel.launcher import control
from nbaccel.launcher.local.preload_choice import PreloadChoice
from nbaccel.launcher.starter import StarterListener


class HelperProcess:
    """A running helper and the channel to it."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._sock, helper_end = control.socket_pair()
        package_root = str(Path(__file__).resolve().parents[3])  # above nbaccel/launcher/local
        helper_env = dict(env)
        # The helper must never create a CUDA context: a forked worker could not use CUDA.
        helper_env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        helper_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH", "")) if p
        )
        # No parent-death signal for the helper: the kernel may start it from a short-lived
        # thread (the prewarm), and PR_SET_PDEATHSIG fires when that *thread* ends. The helper
        # watches the kernel's pid and its socket instead.
        try:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "nbaccel.launcher.local.helper_main",
                    str(helper_end.fileno()),
                    str(os.getpid()),
                ],
                pass_fds=[helper_end.fileno()],
                env=helper_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # the kernel's interrupt must not reach it
            )
        finally:
            helper_end.close()
        self._send_lock = threading.Lock()
        self._listeners: dict[str, StarterListener] = {}
        self._listeners_lock = threading.Lock()
        self._failure: str | None = None
        self._alive = True
        self._retired = False  # a preloaded library made it unsafe: no new launches here
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
            done = self._retired and not self._listeners
        if done:  # its last run ended: a retired helper goes
            threading.Thread(target=self.close, name="nbaccel-helper-close", daemon=True).start()

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
        self.preload(CHOICE.choose_files(modules))

    def spawn(self, request: dict[str, Any], fds: list[int]) -> None:
        """Ask for one worker; its exit code (or a spawn failure) goes to the run's listener."""
        self._send({"op": "spawn", **request}, fds)

    def signal(self, run_id: str, signum: int, ranks: list[int] | None = None) -> None:
        """Send ``signum`` to the process groups of a run's live workers."""
        self._send({"op": "signal", "run": run_id, "signal": int(signum), "ranks": ranks})

    def host_of(self, rank: int) -> str | None:
        return None  # every worker runs on this machine

    def close(self) -> None:
        """Stop the helper: it kills its workers and exits when the socket closes."""
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
        CHOICE.refuse(message["module"])
        unsafe = bool(message.get("unsafe"))
        NOTICES.append(
            f"not preloaded: {message['module']} ({message['why']}); workers import it "
            + ("themselves, and a fresh helper was started" if unsafe else "themselves")
        )
        if unsafe:
            with self._preload_seen:
                self._retired = True
                self._preload_seen.notify_all()
            with self._listeners_lock:
                idle = not self._listeners
            if idle:
                threading.Thread(
                    target=self.close, name="nbaccel-helper-close", daemon=True
                ).start()


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
    global _shared
    if not _shared_lock.acquire(timeout=timeout):
        raise HelperError(
            f"the nbaccel helper process was still being started by another thread after "
            f"{timeout:.0f} s: starting a process (subprocess.Popen of {sys.executable}) did "
            "not return, which points at a machine out of memory or process ids. Free some "
            f"and launch again; {PREWARM_VAR}=0 before starting the kernel turns off the "
            "start at import."
        )
    try:
        if _shared is None or not _shared.usable:
            _shared = HelperProcess(os.environ)
        return _shared
    finally:
        _shared_lock.release()


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
