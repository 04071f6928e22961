"""The helper's side of preloading: import an installed library, then check that the
helper can still fork.

A forked child inherits memory, not threads: a library that started a thread at import
leaves its children with a lock that may never be released; one that opened a socket shares
it with every worker; one that initialised CUDA (or the XLA runtime) makes every forked
worker fail to use the device. After each import the helper compares what it holds with
what it held before, and a library that changed any of it is refused:

- a thread (Python's, or a native one: ``/proc/self/task``), a socket, CUDA or XLA
  initialised: the helper is no longer safe to fork from. It says so, stops forking, and the
  kernel starts a fresh helper that never imports that library;
- a signal handler installed: the helper puts its own back and forgets the module (workers
  get the launch's handlers anyway); the helper stays.

``os.environ``, ``sys.path`` and the folder are put back after every import: workers get
the launch's, never what a library wrote into the helper's.

>>> before = Hazards.now()
>>> import_checked("colorsys", before) is None
True
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nbaccel.launcher.local.preloading.import_trace import ImportTrace

# Signals a module cannot catch; SIGALRM and SIGIO serve the kernel during imports
# (between_bytecodes.serving_while) and are the helper's own while it imports.
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP, signal.SIGALRM, signal.SIGIO}
_SIGNALS = tuple(s for s in signal.valid_signals() if s not in _UNCATCHABLE)
# How much the helper's resident memory may grow through preloading (forked workers share it
# copy-on-write, so the machine pays it about once): a kernel that imported something huge
# does not double its memory. What is left over, the workers import themselves.
MAX_GROWTH_BYTES = 2 << 30


@dataclass(frozen=True)
class Hazards:
    """What must not change while the helper imports a library, read in ~0.1 ms."""

    python_threads: int
    native_threads: int
    sockets: frozenset[str]
    handlers: tuple[object, ...]
    cuda: bool
    xla: bool

    @classmethod
    def now(cls) -> Hazards:
        return cls(
            python_threads=threading.active_count(),
            native_threads=_native_threads(),
            sockets=_sockets(),
            handlers=tuple(signal.getsignal(s) for s in _SIGNALS),
            cuda=_cuda_initialised(),
            xla=_xla_initialised(),
        )


@dataclass(frozen=True)
class Verdict:
    """What importing a library did to the helper: ``why`` it may no longer fork (None:
    it may); where it may not, the modules to ``refuse`` (``import_trace``) and the
    ``culprit``, the innermost of them, whose code ran when the hazard appeared."""

    why: str | None
    refuse: tuple[str, ...] = ()
    culprit: str = ""


def import_checked(
    name: str, before: Hazards, held: Callable[[], frozenset[str]] = frozenset
) -> str | None:
    """Import ``name``; why the helper may no longer fork (an unsafe import), or None.

    ``held()``: the sockets the helper itself came to hold during the import (a launch's
    rendezvous socket that arrived with a request served mid-import): not the library's.

    An import that fails is no hazard (the workers import it themselves and report what
    fails); a changed signal handler is undone here (see ``undo_handlers``) and reported
    with the prefix ``"handlers: "``.
    """
    return import_traced(name, before, held).why


def import_traced(
    name: str, before: Hazards, held: Callable[[], frozenset[str]] = frozenset
) -> Verdict:
    """``import_checked``, watched (``import_trace``): where the import is unsafe, which
    of the modules it loaded to refuse so that the next helper does not meet it again."""
    env, path, folder = dict(os.environ), list(sys.path), os.getcwd()
    trace = ImportTrace(_Probe(before, held))
    try:
        with trace:
            __import__(name)
    except Exception:  # noqa: BLE001 - workers import it themselves and report errors
        pass
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
        if os.getcwd() != folder:
            os.chdir(folder)
    after = Hazards.now()
    why = unsafe_change(before, after, held)
    if why is not None:
        return Verdict(why, tuple(trace.refused(name, why)), trace.culprit(name, why))
    if after.handlers != before.handlers:
        undo_handlers(before)
        return Verdict("handlers: it installed a signal handler at import")
    return Verdict(None)


def unsafe_change(
    before: Hazards, after: Hazards, held: Callable[[], frozenset[str]] = frozenset
) -> str | None:
    """Why the helper may no longer fork, holding ``after`` where it held ``before``."""
    if after.python_threads > before.python_threads or after.native_threads > before.native_threads:
        return "it started a thread at import"
    opened = after.sockets - before.sockets
    if opened and opened - held():
        return "it opened a socket at import"
    if after.cuda and not before.cuda:
        return "it initialised CUDA at import"
    if after.xla and not before.xla:
        return "it initialised the XLA runtime at import"
    return None


class _Probe:
    """``unsafe_change`` since ``before``, cheap enough to ask at every module an import
    loads (``import_trace``): the sockets are read again only when the count of open fds
    changed, the signal handlers not at all (they are undone, never unsafe)."""

    def __init__(self, before: Hazards, held: Callable[[], frozenset[str]]) -> None:
        self._before = before
        self._held = held
        self._fds = -1
        self._sockets = before.sockets

    def __call__(self) -> str | None:
        fds = _open_fds()
        if fds != self._fds:
            self._fds, self._sockets = fds, _sockets()
        now = Hazards(
            python_threads=threading.active_count(),
            native_threads=_native_threads(),
            sockets=self._sockets,
            handlers=self._before.handlers,
            cuda=_cuda_initialised(),
            xla=_xla_initialised(),
        )
        return unsafe_change(self._before, now, self._held)


def undo_handlers(before: Hazards) -> None:
    """Put back the signal handlers ``before`` recorded."""
    for signum, handler in zip(_SIGNALS, before.handlers, strict=True):
        if signal.getsignal(signum) is not handler and handler is not None:
            signal.signal(signum, handler)  # type: ignore[arg-type]


def forget(name: str) -> None:
    """Drop ``name`` and its submodules from ``sys.modules`` (a refused library's handlers
    are undone; workers import it afresh)."""
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[loaded]


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: Python's count is all there is
        return 1


def sockets_of(fds: list[int]) -> frozenset[str]:
    """The socket identities (``socket:[inode]``) of these fds."""
    found = set()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return frozenset(found)


def _sockets() -> frozenset[str]:
    try:
        return sockets_of([int(fd) for fd in os.listdir("/proc/self/fd")])
    except OSError:  # not Linux: no socket is seen
        return frozenset()


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a broken build: nothing was initialised by us
        return False


def _xla_initialised() -> bool:
    xlac = sys.modules.get("torch_xla._XLAC")
    check = getattr(xlac, "_xla_runtime_is_initialized", None)
    try:
        return bool(check is not None and check())
    except Exception:  # noqa: BLE001 - an older torch_xla without the check
        return False


class Preloader:
    """The helper's list of libraries to preload, and whether forking is still safe.

    ``ask`` adds names (each once, however often asked); ``run`` imports them in order,
    checked, each after a ``begin()`` and before a ``between()`` call (the helper notes the
    files it loaded there: ``installed_files``),
    replies ``preload_refused`` for each refused library (``unsafe``: the helper must not
    fork again) and leaves in ``report`` the ``preloaded`` message, with the helper's
    memory, which the helper sends once its spares are as new as its imports.
    """

    def __init__(self, max_growth: int = MAX_GROWTH_BYTES) -> None:
        self.max_growth = max_growth
        self.pending: list[str] = []
        self.asked: set[str] = set()
        self.unsafe: str | None = None  # why the helper may not fork any more
        self.report: dict[str, Any] = {}
        self._base_rss: int | None = None

    @property
    def wanted(self) -> bool:
        """Whether there is something to import, and forking is still safe."""
        return bool(self.pending) and self.unsafe is None

    def progress(self) -> dict[str, Any]:
        """The last ``preloaded`` report, brought up to date: names dealt with so far."""
        asked = len(self.asked) - len(self.pending)
        return {**self.report, "op": "preloaded", "asked": asked, "modules": len(sys.modules)}

    def ask(self, names: list[str]) -> None:
        """Add names to import; those already imported are done at once (a launch waits
        only for what is really still to be imported)."""
        fresh = [name for name in names if name not in self.asked]
        self.asked.update(fresh)
        self.pending += [name for name in fresh if name not in sys.modules]

    def run(
        self,
        reply: Callable[[dict[str, Any]], None],
        between: Callable[[], None],
        held: Callable[[], frozenset[str]] = frozenset,
        begin: Callable[[], None] = lambda: None,
    ) -> None:
        import psutil

        process = psutil.Process()
        if self._base_rss is None:
            self._base_rss = process.memory_info().rss
        capped = False
        while self.pending:  # names asked for while it runs are taken too
            name = self.pending.pop(0)
            if name in sys.modules:
                continue
            if process.memory_info().rss - self._base_rss > self.max_growth:
                capped = True  # what is left, the workers import themselves
                self.pending.clear()
                break
            begin()
            verdict = import_traced(name, Hazards.now(), held)
            why = verdict.why
            if why is not None and why.startswith("handlers: "):
                forget(name)  # its handlers are undone; workers import it afresh
                reply({"op": "preload_refused", "module": name, "why": why[10:]})
            elif why is not None:
                self.unsafe = f"preloading {name}: {verdict.culprit} {why.removeprefix('it ')}"
                reply(
                    {
                        "op": "preload_refused",
                        "module": name,
                        "why": why,
                        "unsafe": True,
                        "refused": list(verdict.refuse),
                        "culprit": verdict.culprit,
                    }
                )
                return
            between()
        rss = process.memory_info().rss
        self.report = {
            "op": "preloaded",
            "rss": rss,
            "grown": rss - self._base_rss,
            "capped": capped,
            "modules": len(sys.modules),
            "asked": len(self.asked) - len(self.pending),  # names dealt with so far
        }
