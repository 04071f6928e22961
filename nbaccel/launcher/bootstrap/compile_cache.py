"""torch.compile's caches in a folder of the project's, so a relaunch (or a new machine that
resumes from a checkpoint) does not compile again from nothing.

By default Inductor, AOTAutograd and Triton keep their on-disk caches under ``/tmp``
(``/tmp/torchinductor_<user>``): a relaunch on the same machine compiles an 8-layer MLP in
~4 s instead of ~32 s, but a new VM (Colab, Kaggle, a preempted node) starts cold again.
Here, in a worker:

- ``cache_folder(config)``: the project's folder, ``config.dynamo.cache_dir`` or
  ``<runs_dir>/compile_cache``;
- ``use_project_caches(config)``: points this process's Inductor / AOTAutograd (its
  ``inductor`` subfolder), Triton (``triton``) and torch_xla's persistent cache (``xla``)
  at it, before anything compiles (through a link of plain name when its path has spaces:
  ``shell_safe``);
- ``save_artifacts(folder, rank)`` / ``load_artifacts(folder, rank)``: the artifacts this
  process compiled (``torch.compiler.save_cache_artifacts``), kept in
  ``folder/compile/rank<r>.bin`` beside a checkpoint and loaded back into the caches before
  the function runs on a machine that lost them;
- ``compile_seconds()``: how long this process has spent compiling (what the step-time
  line and the dashboard show).

What the artifacts hold: the traced and lowered graphs (AOTAutograd's and Inductor's cache
entries) and, on GPUs, Triton's compiled kernels (Inductor bundles them in its entries by
default). On CPU, Inductor's C++ kernels and its precompiled headers are not in them: a new
machine builds those again. Measured on this project's 2-core CPU machine, an 8-layer MLP
(width 256, forward and backward): cold 13.3 s of compiling, warm (same folder) 1.2 s, new
machine with the artifacts 11.5 s (``tests/multiprocess/test_compile_cache.py``'s slow
test prints them). A ``cache_dir`` on storage that outlives the machine (Drive) keeps all.

An artifact file is a header line (``nbaccel-compile-artifacts 1``), a JSON line naming
the torch and Python that wrote it, then ``save_cache_artifacts``' bytes as they are:
torch makes no promise that artifacts of another torch version load, so those are skipped
with a word instead of being handed to it.

Runs in workers only: torch is imported inside the functions, never at module level.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import secrets
import shlex
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from nbaccel.config.schema import Config
from nbaccel.metrics import compile_seconds

__all__ = [
    "cache_folder",
    "compile_seconds",
    "load_artifacts",
    "save_artifacts",
    "shell_safe",
    "use_project_caches",
]

DEFAULT_FOLDER = "compile_cache"  # under runs_dir when config.dynamo.cache_dir is empty
ARTIFACTS_FOLDER = "compile"  # under a checkpoint's folder: rank<r>.bin
MAGIC = b"nbaccel-compile-artifacts 1\n"
CODECACHE = "torch._inductor.codecache"  # fixes its precompiled headers' folder at import


def cache_folder(config: Config, *, create: bool = True) -> Path:
    """The project's compile-cache folder, absolute, created (0700) if missing and ``create``.

    ``config.dynamo.cache_dir``, or ``<runs_dir>/compile_cache`` when it is empty; a
    relative path is taken from the working directory (a worker runs in the launching
    process's).

    >>> import tempfile
    >>> from nbaccel.config.schema import Config
    >>> from nbaccel.config.sections import DynamoOptions
    >>> runs = tempfile.mkdtemp()
    >>> cache_folder(Config(runs_dir=runs)) == Path(runs) / "compile_cache"
    True
    >>> chosen = Path(runs) / "mine"
    >>> cache_folder(Config(dynamo=DynamoOptions(cache_dir=str(chosen)))) == chosen
    True
    >>> oct(chosen.stat().st_mode & 0o777)
    '0o700'
    """
    chosen = config.dynamo.cache_dir or os.path.join(config.runs_dir, DEFAULT_FOLDER)
    folder = Path(chosen).expanduser().absolute()
    if create:
        # Compiled code is run from here: only its owner may write it (torch and Triton load
        # what they find as trusted).
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def use_project_caches(config: Config) -> Path:
    """Point this process's compile caches at ``cache_folder(config)``; returns the folder.

    Call it in the worker before anything compiles. Inductor (and AOTAutograd, which keeps
    its entries in Inductor's folder) reads ``TORCHINDUCTOR_CACHE_DIR`` whenever it needs
    the folder, so setting it works even though the helper that forked this worker had
    torch imported already; what torch memoised from the old folder is dropped. Triton
    reads ``TRITON_CACHE_DIR``; torch_xla, when this process uses it, gets its persistent
    cache here too (written by local rank 0, read by the others). The project's folder wins
    over a ``TORCHINDUCTOR_CACHE_DIR`` inherited from the environment: the config is how to
    choose it. (No example here: it changes the calling process's environment.)

    Inductor builds its C++ commands by splitting strings on spaces, so a folder whose path
    a shell would need quoted ("My Drive/...") fails every CPU compile; such a folder is
    reached through a private link of plain name in the temp dir (``shell_safe``).
    """
    # Made when something compiles (Inductor makes its folder), not by every launch: a
    # run that compiles nothing leaves nothing, in runs_dir or elsewhere. A folder reached
    # through a link must exist for the link to lead somewhere.
    folder = cache_folder(config, create=False)
    if shlex.quote(str(folder)) != str(folder):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _use_xla_cache(folder / "xla")  # torch_xla takes the path as it is
    reachable = shell_safe(folder)
    if reachable is None:
        return folder  # said why on stderr: torch's own caches stay as they were
    inductor = reachable / "inductor"
    # Override, not setdefault: the helper that forked this worker may have imported
    # torch._dynamo, whose import calls Inductor's cache_dir(), which writes the /tmp
    # default into os.environ; this worker inherits that value.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
    os.environ["TRITON_CACHE_DIR"] = str(reachable / "triton")
    _forget_old_folder(str(inductor))
    _move_precompiled_headers(os.path.join(inductor, "precompiled_headers"))
    return folder


def shell_safe(folder: Path) -> Path | None:
    """``folder``, or a link to it whose path needs no shell quoting; None when there can be
    none (said on stderr).

    The link lives in ``<temp dir>/nbaccel-<uid>/``, a folder only this user may enter
    (checked: a link another user planted there would run their compiled code), and is
    named after the folder, so each launch finds the same path (and torch the same keys).

    >>> import tempfile
    >>> plain = Path(tempfile.mkdtemp())
    >>> shell_safe(plain) == plain
    True
    >>> spaced = plain / "My Drive"
    >>> spaced.mkdir()
    >>> link = shell_safe(spaced)
    >>> " " in str(link), link.resolve() == spaced.resolve()
    (False, True)
    """
    if shlex.quote(str(folder)) == str(folder):
        return folder
    links = Path(tempfile.gettempdir()) / f"nbaccel-{os.getuid()}"
    why = None
    if shlex.quote(str(links)) != str(links):
        why = f"the temp dir {links.parent} needs quoting too"
    else:
        with contextlib.suppress(FileExistsError):
            links.mkdir(mode=0o700)
        held = links.lstat()
        if not stat.S_ISDIR(held.st_mode) or held.st_uid != os.getuid() or held.st_mode & 0o077:
            why = f"{links} is not a private folder of this user's"
    if why is not None:
        print(
            f"nbaccel: torch.compile's caches stay in torch's default folder: {folder} needs "
            f"shell quoting, which Inductor's C++ commands lack, and {why}",
            file=sys.stderr,
        )
        return None
    name = hashlib.sha256(str(folder).encode()).hexdigest()[:16]
    link = links / f"compile-{name}"
    if not (link.is_symlink() and os.readlink(link) == str(folder)):
        # Aside, then renamed over: ranks starting together each make it, the last one stays.
        aside = links / f".compile-{name}-{os.getpid()}-{secrets.token_hex(4)}"
        os.symlink(folder, aside)
        os.replace(aside, link)
    return link


def _forget_old_folder(inductor: str) -> None:
    """Drop what torch computed from the folder it used before, where it is loaded."""
    utils = sys.modules.get("torch._inductor.utils")
    if utils is not None and hasattr(utils, "clear_caches"):
        # Inductor's memoised lookups (registered with clear_on_fresh_cache) may hold paths
        # under the old folder; torch's own temporary_cache_dir clears them the same way.
        utils.clear_caches()
    package = sys.modules.get("torch._dynamo.package")
    store = getattr(package, "DynamoCache", None) if package is not None else None
    if store is not None and hasattr(store, "_path_prefix"):
        # torch._dynamo.package fixes its precompile store's folder at import (one object
        # that other modules hold too): point it at ours in place. Private, so checked.
        store._path_prefix = os.path.join(inductor, "dynamo")


def _move_precompiled_headers(headers: str) -> None:
    """Inductor's precompiled C++ headers (CPU kernels: ~3 s to build) in our folder too.

    ``torch._inductor.codecache`` takes their folder from the temp dir (not from
    ``TORCHINDUCTOR_CACHE_DIR``) when it is imported, and its functions read the module's
    globals: set them now if it is loaded, else as soon as it is (an import hook, gone
    once it ran; importing Inductor here would cost a worker that never compiles ~1 s).
    """

    def point(module: ModuleType) -> None:
        if hasattr(module, "_HEADER_DIR"):  # private: checked, not assumed
            setattr(module, "_HEADER_DIR", headers)  # noqa: B010 - mypy: ModuleType
            setattr(module, "_HEADER_LOCK_DIR", os.path.join(headers, "locks"))  # noqa: B010

    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImport)]
    module = sys.modules.get(CODECACHE)
    if module is not None:
        point(module)
    else:
        sys.meta_path.insert(0, _AfterImport(CODECACHE, point))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` once module ``name`` has been imported; one use."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # the finders after us find the module itself
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """A module's own loader, then ``then(module)``; the module keeps its own loader."""

    def __init__(self, loader: importlib.abc.Loader, then: Callable[[ModuleType], None]):
        self.loader = loader
        self.then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The real loader back first: its module's source is read through it (inspect).
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.then(module)


def _use_xla_cache(folder: Path) -> None:
    """torch_xla's persistent cache in ``folder``, when this process uses torch_xla."""
    if "torch_xla" not in sys.modules and not os.environ.get("PJRT_DEVICE"):
        return  # no XLA here: nothing to point (and no folder to leave behind)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    # One writer per machine: the other ranks compile the same graphs and only read.
    readonly = os.environ.get("LOCAL_RANK", "0") != "0"
    if "torch_xla" not in sys.modules:
        # torch_xla reads these when it creates its computation cache, which is what
        # runtime.initialize_cache sets too; not importing it here keeps start-up cheap.
        os.environ["XLA_PERSISTENT_CACHE_PATH"] = str(folder)
        os.environ["XLA_PERSISTENT_CACHE_READ_ONLY"] = "1" if readonly else "0"
        return
    try:
        import torch_xla.runtime as xr

        xr.initialize_cache(str(folder), readonly=readonly)
    except Exception as error:  # noqa: BLE001 - the run goes on with torch_xla's own cache
        # initialize_cache asserts that nothing was compiled yet in this process.
        why = str(error) or type(error).__name__
        print(
            f"nbaccel: torch_xla's persistent cache not moved to {folder}: {why}",
            file=sys.stderr,
        )


def save_artifacts(folder: Path, rank: int) -> Path | None:
    """Write what this process compiled so far to ``folder/compile/rank<rank>.bin``.

    Returns the file, or None when nothing was compiled (torch.compile never ran, or found
    nothing to keep). The file is replaced whole (written aside, then renamed), so a crash
    never leaves half a file. Each call writes everything compiled since the process began.

    >>> import tempfile
    >>> saved = save_artifacts(Path(tempfile.mkdtemp()), 0)  # None: nothing compiled here
    >>> saved is None or saved.name == "rank0.bin"
    True
    """
    if "torch._dynamo" not in sys.modules:
        return None  # torch.compile never ran in this process: do not import it to ask
    import torch
    import torch.compiler

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    data, _info = saved
    target = Path(folder) / ARTIFACTS_FOLDER / f"rank{rank}.bin"
    target.parent.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"torch": torch.__version__, "python": _python()}).encode() + b"\n"
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(MAGIC + header)
            out.write(data)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return target


def load_artifacts(folder: Path, rank: int) -> bool:
    """Load ``folder/compile/rank<rank>.bin`` (rank 0's when this rank has none: more ranks
    now than when it was saved) into this process's compile caches; True when loaded.

    Call it after ``use_project_caches`` (the artifacts are written into the caches it
    chose) and before the function compiles. False when there is no file; a file that
    cannot be used (corrupt, another torch version) is skipped with one line on stderr
    saying why, never an exception: the run then compiles as usual.

    >>> import tempfile
    >>> load_artifacts(Path(tempfile.mkdtemp()), 0)
    False
    """
    path = _artifacts_file(Path(folder), rank)
    if path is None:
        return False
    try:
        data = _checked_payload(path.read_bytes())
        import torch.compiler

        # torch logs its own warning with a traceback for a file it cannot read; the one
        # line below says it instead.
        with _quiet("torch.compiler._cache"):
            info = torch.compiler.load_cache_artifacts(data)
        if info is None:
            raise ValueError("torch could not read it")
        if info.empty():
            raise ValueError("it holds no compiled artifacts")
    except Exception as error:  # noqa: BLE001 - a bad file costs a compile, never the run
        why = str(error) or type(error).__name__
        print(f"nbaccel: compile artifacts {path} skipped: {why}", file=sys.stderr)
        return False
    return True


def _artifacts_file(folder: Path, rank: int) -> Path | None:
    for candidate in (rank, 0):
        path = folder / ARTIFACTS_FOLDER / f"rank{candidate}.bin"
        if path.is_file():
            return path
    return None


def _checked_payload(raw: bytes) -> bytes:
    """``save_cache_artifacts``' bytes from a file's content, or ValueError saying why not."""
    if not raw.startswith(MAGIC):
        raise ValueError("not an nbaccel compile-artifacts file")
    header, newline, data = raw[len(MAGIC) :].partition(b"\n")
    if not newline:
        raise ValueError("the file is truncated")
    try:
        written: dict[str, Any] = json.loads(header)
    except ValueError as error:
        raise ValueError(f"its header is unreadable ({error})") from None
    import torch

    made = (written.get("torch"), written.get("python"))
    if made != (torch.__version__, _python()):
        raise ValueError(
            f"written by torch {made[0]} on Python {made[1]}, this is torch "
            f"{torch.__version__} on Python {_python()}"
        )
    return data


def _python() -> str:
    return "{}.{}".format(*sys.version_info[:2])


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
