"""Which modules of an import led to a hazard: what the helper refuses, so that the same
cause does not retire the next helper again.

The helper imports a library the kernel offered, then checks that it can still fork
(``preload.import_checked``). When it cannot, refusing that one name is not enough:
``datasets`` imports ``pandas``, which imports ``pyarrow``, whose import starts a thread.
Refusing only ``datasets``, the next helper imports ``pandas`` and is retired in turn, then
``pyarrow``: three replacements, each one asking for everything again, and the launches
made meanwhile wait for them. Refusing everything the import brought in is no better: it
holds ``numpy`` and ``huggingface_hub`` too, which are safe, and which other libraries need.

So while the helper imports, ``ImportTrace`` watches, at every module the import loads
(a finder first on ``sys.meta_path``, which finds nothing) and at the return of every
``import`` statement that loaded something (``builtins.__import__``): a cheap probe says
whether a hazard is there. When one appears (a thread that a module started and joined
again does not count: the last onset of the hazard the final check names does), the modules
being executed at that moment (the frames running a module's body) are the *chain* that led
to it: here
``datasets``, ``datasets.arrow_dataset``, ``pandas``, ``pandas.compat``, ``pyarrow``. Every
module on the chain starts the hazard when imported afresh, and so does every module that
imports one of them: each ``import`` statement is noted (importer, imported), also of a
module already loaded, so ``pandas`` counts even where ``datasets`` had loaded ``pyarrow``
first. That closure, among the modules this import loaded, is what is refused (a package
stands for its submodules); the rest is offered again on its own.

Not seen: a library that the import did not load (a ``polars`` offered after, which imports
``pyarrow`` too) is found out when it is imported, by the helper it then retires.

Stdlib only; the helper's own state is left as it was (the finder and ``__import__`` are
put back, or passed through if a library wrapped them meanwhile).

>>> with ImportTrace(lambda: None) as trace:
...     import colorsys
>>> trace.chain("it started a thread at import") is None
True
"""

from __future__ import annotations

import builtins
import importlib.util
import sys
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

# A probe: why forking is no longer safe, or None (``preload``'s check, made cheap).
Probe = Callable[[], "str | None"]


class ImportTrace:
    """Watches the imports made while it is entered; ``refused(name)`` once it is left."""

    def __init__(self, probe: Probe) -> None:
        self._probe = probe
        self._active = False
        self._before: frozenset[str] = frozenset()
        # (importer, name, fromlist, level, package): resolved only if something is refused.
        self._edges: list[tuple[str | None, str, Sequence[str], int, str | None]] = []
        self._finder = _Watcher(self)
        self._real_import = builtins.__import__
        self._hook = self._import  # one bound method: ``is`` tells whether it is still ours
        self._state: str | None = None  # what the probe said last
        # Per hazard, the modules being executed when it last appeared, outermost first.
        self._onsets: dict[str, tuple[str, ...]] = {}

    def __enter__(self) -> ImportTrace:
        self._before = frozenset(sys.modules)
        self._real_import = builtins.__import__
        self._active = True
        builtins.__import__ = self._hook
        sys.meta_path.insert(0, self._finder)
        return self

    def __exit__(self, *_: object) -> None:
        self._active = False  # a wrapper of ours that stays somewhere passes through
        if builtins.__import__ is self._hook:
            builtins.__import__ = self._real_import
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)

    def chain(self, why: str) -> tuple[str, ...] | None:
        """The modules being executed when hazard ``why`` last appeared, outermost first;
        None if the probe never saw it (it appeared after the last module was loaded)."""
        return self._onsets.get(why)

    def refused(self, name: str, why: str) -> list[str]:
        """What to refuse after importing ``name`` made the helper unsafe (``why``): the
        chain and every module loaded by this import that imports one of it (a package
        stands for its submodules), sorted; ``[name]`` where nothing more is known."""
        new = set(sys.modules) - self._before
        found = {name} | {m for m in self.chain(why) or () if m in new}
        importers: dict[str, set[str]] = {}
        for importer, imported, fromlist, level, package in self._edges:
            if importer in new:
                targets = _targets(imported, fromlist, level, package)
                importers.setdefault(importer, set()).update(targets)
        grew = True
        while grew:
            grew = False
            for importer, targets in importers.items():
                if importer not in found and targets & found:
                    found.add(importer)
                    grew = True
        return sorted(m for m in found if not any(p in found for p in _parents(m)))

    def culprit(self, name: str, why: str) -> str:
        """The innermost module of the chain (whose code ran when the hazard appeared)."""
        chain = self.chain(why)
        return chain[-1] if chain else name

    # ----- the watch ------------------------------------------------------------------
    def _import(
        self,
        name: str,
        globals: Mapping[str, Any] | None = None,
        locals: Mapping[str, Any] | None = None,
        fromlist: Sequence[str] | None = (),
        level: int = 0,
    ) -> types.ModuleType:
        if not self._active:
            return self._real_import(name, globals, locals, fromlist or (), level)
        importer = globals.get("__name__") if globals else None
        package = _package_of(globals) if level and globals else None
        self._edges.append((importer, name, tuple(fromlist or ()), level, package))
        loaded = len(sys.modules)
        module = self._real_import(name, globals, locals, fromlist or (), level)
        if len(sys.modules) != loaded:
            self._look(_targets(name, fromlist or (), level, package))
        return module

    def loading(self, fullname: str) -> None:
        """The finder's call: ``fullname`` is about to be loaded (by any means)."""
        if not self._active:
            return
        running = self._running()
        self._edges.append((running[-1] if running else None, fullname, (), 0, None))
        self._look((), running)

    def _look(self, just_loaded: Iterable[str], running: list[str] | None = None) -> None:
        why = self._probe()
        if why is not None and why != self._state:
            running = self._running() if running is None else running
            fresh = [m for m in sorted(just_loaded) if m in sys.modules and m not in self._before]
            self._onsets[why] = tuple(running + [m for m in fresh if m not in running])
        self._state = why

    def _running(self) -> list[str]:
        """The modules whose body is being executed, loaded by this import, outermost first."""
        found: list[str] = []
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "<module>":
                module = frame.f_globals.get("__name__")
                if isinstance(module, str) and module not in self._before:
                    found.append(module)
            frame = frame.f_back
        return found[::-1]


class _Watcher:
    """First on ``sys.meta_path``: notes every module about to be loaded, finds nothing."""

    def __init__(self, trace: ImportTrace) -> None:
        self._trace = trace

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        self._trace.loading(fullname)


def _package_of(globals: Mapping[str, Any]) -> str | None:
    package = globals.get("__package__")
    if isinstance(package, str):
        return package
    name = globals.get("__name__")
    if not isinstance(name, str):
        return None
    return name if "__path__" in globals else name.rpartition(".")[0]


def _targets(name: str, fromlist: Sequence[str], level: int, package: str | None) -> set[str]:
    """The modules an ``import`` of these arguments may run: the name, its packages, and
    what the fromlist names below it (attributes too: harmless, never a module)."""
    if level:
        try:
            name = importlib.util.resolve_name("." * level + name, package)
        except (ImportError, ValueError):
            return set()
    if not name:
        return set()
    found = {name, *_parents(name)}
    found |= {f"{name}.{item}" for item in fromlist if isinstance(item, str) and item != "*"}
    return found


def _parents(name: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b"]``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]
