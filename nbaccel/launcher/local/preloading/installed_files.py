"""Whether what the helper imported is still what is installed: stat calls, never a read.

The helper preloads installed libraries (``preload_choice``) and forks every later launch's
workers from them. A ``pip install`` in the notebook replaces a library's files on disk; a
worker forked from the helper would still run the code imported before, where a fresh
interpreter runs the new one. So:

- the helper (``LoadedFiles``) notes, after each import, the file of every module it loaded
  from a site-packages folder, with its inode, size and modification time, and tells the
  parent (a ``loaded`` message). A file loaded while a site-packages folder changed is noted
  as unknown: the helper may have read half of an install;
- the parent (``InstalledCheck``), before a launch is served, stats the site-packages folders
  themselves: an install, upgrade, reinstall or uninstall (pip, uv, conda) adds, removes or
  renames entries there, which changes the folder's modification time. Unchanged, nothing
  more is done (a few stat calls, ~10 us). Changed, it stats every file the helper noted
  (~3 us each: a few ms, once per install) and names the libraries whose files differ.

Not seen: a file inside site-packages edited in place by hand, with no install since the
helper imported it (the folder itself does not change then). nbaccel's own modules are not
noted: the kernel runs the nbaccel it imported, and its helper must speak the same protocol.
Stdlib only: the parent (torch-free) and the helper use it.

>>> check = InstalledCheck(roots=())
>>> bool(check.changed())
False
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

from nbaccel.launcher.local.preloading.preload_choice import site_roots

# What identifies a file's content without reading it: a replaced file has a new inode, a
# rewritten one a new size or modification time.
FileStat = tuple[int, int, int]
# path -> (top-level module name, its stat when the helper loaded it; None: unknown)
Noted = dict[str, tuple[str, FileStat | None]]
NOT_NOTED = frozenset({"nbaccel"})


def file_stat(path: str) -> FileStat | None:
    """(inode, size, modification time in ns) of ``path``, or None if it cannot be read."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_ino, found.st_size, found.st_mtime_ns


def folders_now(roots: Sequence[str]) -> tuple[FileStat | None, ...]:
    return tuple(file_stat(root) for root in roots)


def site_prefixes(roots: Iterable[str]) -> tuple[str, ...]:
    """Path prefixes a module file in one of ``roots`` starts with, symlinked or not."""
    found = set()
    for root in roots:
        found |= {os.path.join(root, ""), os.path.join(os.path.realpath(root), "")}
    return tuple(sorted(found))


def raw_site_roots() -> tuple[str, ...]:
    """This interpreter's site-packages folders as ``site`` names them and resolved."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    raw = [*site.getsitepackages(), site.getusersitepackages(), paths["purelib"]]
    return tuple(sorted({p for p in (*raw, paths["platlib"], *site_roots()) if p}))


class LoadedFiles:
    """The helper's side: the site-packages files of the modules it has loaded.

    ``begin()`` before an import, ``since_last()`` after it: the files of the modules
    loaded since the last call (each module once), ready for a ``loaded`` message.

    >>> files = LoadedFiles(roots=(), modules={})
    >>> files.begin()
    >>> files.since_last()
    {}
    """

    def __init__(
        self, roots: Sequence[str] | None = None, modules: Mapping[str, ModuleType] | None = None
    ) -> None:
        self.roots = tuple(raw_site_roots() if roots is None else roots)
        self._prefixes = site_prefixes(self.roots)
        self._modules = sys.modules if modules is None else modules
        self._seen: set[str] = set()
        self._count = -1  # len(modules) when last looked at
        self._folders = folders_now(self.roots)

    def begin(self) -> None:
        """Note the site-packages folders as they are before an import."""
        self._folders = folders_now(self.roots)

    def since_last(self) -> Noted:
        """Files of the modules loaded since the last call that lie in site-packages; their
        stat is None if a site-packages folder changed since ``begin()`` (an install ran
        while we imported: what was read may be half old, half new)."""
        folders = folders_now(self.roots)
        torn = folders != self._folders
        self._folders = folders
        found: Noted = {}
        if len(self._modules) == self._count:
            return found  # nothing imported since (the helper's idle turns ask often)
        self._count = len(self._modules)
        for name, module in list(self._modules.items()):
            if name in self._seen:
                continue
            self._seen.add(name)
            path = getattr(module, "__file__", None)
            top = name.partition(".")[0]
            if isinstance(path, str) and path.startswith(self._prefixes) and top not in NOT_NOTED:
                found[path] = (top, None if torn else file_stat(path))
        return found


class InstalledCheck:
    """The parent's side: whether the files one helper loaded are still those on disk.

    ``note`` takes the helper's ``loaded`` messages (on its reader thread, off any launch's
    path: each file is compared with the disk at once, so an install that finished before
    the message arrived is not missed); ``changed`` is asked before each launch.
    """

    def __init__(self, roots: Sequence[str] | None = None) -> None:
        self.roots = tuple(raw_site_roots() if roots is None else roots)
        self._folders = folders_now(self.roots)  # before the helper loaded anything
        self._files: Noted = {}
        self._differ: set[str] = set()  # noted files that differed from the disk on arrival
        self._checked = self._folders  # the folders as the last ``changed`` found them
        self._lock = threading.Lock()

    def note(self, files: Noted) -> None:
        """Files the helper loaded, with their stat then (None: unknown)."""
        differ = {
            path for path, (_, seen) in files.items() if seen is None or file_stat(path) != seen
        }
        with self._lock:
            self._files.update(files)
            self._differ |= differ

    def changed(self) -> Changed:
        """The noted files that are no longer, or may no longer be, what the helper loaded.
        A few stat calls while no site-packages folder changed."""
        folders = folders_now(self.roots)
        with self._lock:
            self._checked = folders
            if folders == self._folders and not self._differ:
                return Changed({}, {})
            files = dict(self._files)
            differ = set(self._differ)
        found = Changed({}, {})
        for path, (top, seen) in files.items():
            if seen is None:
                found.unsure[path] = top
            elif path in differ or file_stat(path) != seen:
                found.files[path] = top
        if not found:
            with self._lock:
                self._folders = folders  # an unrelated install: the next launch is cheap again
        return found

    def keeping(self, paths: Iterable[str]) -> InstalledCheck:
        """A check for a helper that holds only these of our files (a successor forked from
        a process that had loaded just them), as they were noted here. Its folders are those
        the last ``changed`` saw, before it compared the files: nothing in between is missed."""
        kept = InstalledCheck(self.roots)
        with self._lock:
            kept._folders = self._checked
            kept._files = {path: self._files[path] for path in paths if path in self._files}
            kept._differ = self._differ & set(kept._files)
        return kept

    def paths(self) -> set[str]:
        with self._lock:
            return set(self._files)


@dataclass(frozen=True)
class Changed:
    """What ``InstalledCheck.changed`` found: noted files whose stat differs now (``files``)
    and files loaded while site-packages changed (``unsure``), path -> top-level name."""

    files: dict[str, str]
    unsure: dict[str, str]

    def __bool__(self) -> bool:
        return bool(self.files or self.unsure)

    @property
    def paths(self) -> set[str]:
        return set(self.files) | set(self.unsure)

    def notice(self, held: Container[str] = sys.modules) -> str:
        """What the launch tells; the libraries this process still ``held`` (imported before
        the change: the kernel's own copy) get a word on the kernel.

        >>> Changed({"/site/tinylib/__init__.py": "tinylib"}, {}).notice(held=())
        'reloaded: tinylib (changed on disk)'
        >>> Changed({}, {"/site/torch/fx/graph.py": "torch"}).notice(held=())
        'reloaded: torch (site-packages changed while the helper imported it)'
        """
        names = sorted(set(self.files.values()))
        text = f"reloaded: {', '.join(names)} (changed on disk)"
        if not names:
            names = sorted(set(self.unsure.values()))
            text = (
                f"reloaded: {', '.join(names)} (site-packages changed while the helper imported it)"
            )
        kept = [name for name in names if name in held]
        if kept:
            text += (
                f"; this process (the kernel) still runs the {', '.join(kept)} it imported "
                "before, its workers the new one: restart it to use the new one here too"
            )
        return text
