"""Which of a process's modules the helper may import before forking spares: installed
libraries only, never the user's own code.

A relaunch from a notebook pays each worker's imports again (``import transformers``: 3 s
here) where a forked kernel inherits them. The helper wins that back by importing, before
it forks the spares of the next launch, the libraries the kernel imported (and those the
last launch's workers imported). What it imports then stays as it was imported for every
later launch, so only code that does not change between launches qualifies:

- a module whose file lies in one of this interpreter's site-packages folders;
- not of a distribution installed in editable mode (``pip install -e``: its files are the
  user's working copy, whatever folder they are in);
- not the kernel's own machinery (IPython, ipykernel, zmq, ...): workers never use it;
- not refused before (the helper found it unsafe to hold across a fork).

A module from the notebook's folder, from any other ``sys.path`` entry, or from an editable
install is never preloaded: a worker imports it afresh at every launch, so an edit shows.
Stdlib only: the parent (torch-free) and the workers both use it.

>>> choice = PreloadChoice(roots=("/venv/lib/site-packages",))
>>> choice.qualifies("tqdm", "/venv/lib/site-packages/tqdm/__init__.py")
True
>>> choice.qualifies("mymodel", "/home/me/notebooks/mymodel.py")
False
"""

from __future__ import annotations

import json
import os
import site
import sysconfig
import threading
from collections.abc import Iterable, Mapping
from importlib import metadata
from types import ModuleType

# The kernel's machinery, test runners and the launcher's own start-up: never worth a
# worker's memory (workers do not use them) and some start threads or sockets when used.
# Matched on the top-level package name.
KERNEL_MACHINERY = frozenset(
    {
        "IPython",
        "ipykernel",
        "ipywidgets",
        "jupyter_client",
        "jupyter_core",
        "jupyterlab_widgets",
        "widgetsnbextension",
        "comm",
        "zmq",
        "tornado",
        "traitlets",
        "debugpy",
        "prompt_toolkit",
        "jedi",
        "parso",
        "pexpect",
        "ptyprocess",
        "nest_asyncio",
        "matplotlib_inline",
        "stack_data",
        "executing",
        "asttokens",
        "pure_eval",
        "pickleshare",
        "backcall",
        "wcwidth",
        "nbaccel",
        "pytest",
        "_pytest",
        "pluggy",
        "iniconfig",
        "_pydevd_bundle",
        "_pydev_bundle",
        "_pydevd_frame_eval",
        "pydevd",
        "pydevd_plugins",
    }
)


def site_roots() -> tuple[str, ...]:
    """This interpreter's site-packages folders, resolved (the user site too)."""
    found = [*site.getsitepackages(), site.getusersitepackages()]
    paths = sysconfig.get_paths()
    found += [paths["purelib"], paths["platlib"]]
    return tuple(sorted({os.path.realpath(p) for p in found if p}))


class PreloadChoice:
    """Sorts a process's modules into preloadable installed libraries and the rest.

    Each module name is judged once (a module's file does not move while a process runs),
    so a launch pays only for the modules imported since the last one: a few microseconds
    each, against ~2,000 names in ``sys.modules`` once transformers is imported.
    """

    def __init__(
        self,
        roots: Iterable[str] | None = None,
        refused: Iterable[str] = (),
        editable: frozenset[str] | None = None,
    ) -> None:
        self._roots = tuple(os.path.join(r, "") for r in (site_roots() if roots is None else roots))
        self._judged: dict[str, bool] = {}
        self._refused = set(refused)
        self._editable = editable
        self._lock = threading.Lock()  # launches, the pump and the helper's reader all ask

    def refuse(self, name: str) -> None:
        """Never choose ``name`` or its submodules again (the helper found it unsafe)."""
        with self._lock:
            self._refused.add(name)
            self._forget(name)

    def refused(self, name: str) -> bool:
        """Whether ``name`` (or a package above it) was refused."""
        with self._lock:
            return any(name == r or name.startswith(r + ".") for r in self._refused)

    def _forget(self, name: str) -> None:
        for judged in [n for n in self._judged if n == name or n.startswith(name + ".")]:
            self._judged[judged] = False

    def choose(self, modules: Mapping[str, ModuleType | None]) -> list[str]:
        """The preloadable names among ``modules`` (e.g. ``sys.modules``), parents first."""
        return self.choose_files(
            (name, getattr(module, "__file__", None)) for name, module in list(modules.items())
        )

    def choose_files(self, named: Iterable[tuple[str, str | None]]) -> list[str]:
        """The preloadable names among (name, file) pairs (what a worker reports)."""
        chosen = []
        with self._lock:
            for name, file in named:
                verdict = self._judged.get(name)
                if verdict is None:
                    verdict = self._judged[name] = self.qualifies(name, file)
                if verdict:
                    chosen.append(name)
        return sorted(chosen)

    def qualifies(self, name: str, file: str | None) -> bool:
        """Whether module ``name``, loaded from ``file``, is an installed library to preload."""
        top = name.partition(".")[0]
        if (
            not file
            or name == "__main__"
            or top in KERNEL_MACHINERY
            or top.startswith("pytest_")  # pytest's plugins (and others' pytest_plugin
            or "pytest_plugin" in name  # modules): loaded by a test run, never by workers
            or any(name == r or name.startswith(r + ".") for r in self._refused)
        ):
            return False
        real = os.path.realpath(file)
        if not real.startswith(self._roots):
            return False
        return top not in self._editable_tops()

    def _editable_tops(self) -> frozenset[str]:
        if self._editable is None:
            self._editable = editable_packages()
        return self._editable


def editable_packages() -> frozenset[str]:
    """Top-level import names of the distributions installed in editable mode (PEP 660:
    ``direct_url.json`` says ``"editable": true``). Read once per process (~10-50 ms)."""
    tops: set[str] = set()
    for dist in metadata.distributions():
        text = dist.read_text("direct_url.json")
        if not text:
            continue
        try:
            editable = json.loads(text).get("dir_info", {}).get("editable", False)
        except ValueError:
            continue
        if editable:
            tops |= set(_top_names(dist))
    return frozenset(tops)


def _top_names(dist: metadata.Distribution) -> list[str]:
    listed = dist.read_text("top_level.txt")
    if listed:
        return [line.strip() for line in listed.splitlines() if line.strip()]
    name = dist.metadata["Name"] or ""
    return [name.replace("-", "_").lower(), name.replace("-", "_")]
