"""Local states to copy, fresh roots on fsspec's memory filesystem, and a flaky filesystem
whose writes fail or stall when a test says so."""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem


def make_state(root: Path, name: str, steps: int, *, seed: int = 0, saved_at: float = 0.0) -> Path:
    """A local state folder as the savers write it (then LATEST replaced), returned."""
    folder = root / name
    (folder / "sharded").mkdir(parents=True)
    meta = {
        "format": 1,
        "world_size": 2,
        "progress": {"completed_steps": steps, "epoch": 0},
        "saved_at": saved_at or 1_000.0 + steps,
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "model_0.pt").write_bytes(bytes((seed + i) % 251 for i in range(3000 + seed)))
    (folder / "optimizer_0.pt").write_bytes(b"opt" * (seed + 1))
    (folder / "random_states_0.pt").write_bytes(b"")  # an empty file is a file too
    (folder / "sharded" / "part-0.bin").write_bytes(name.encode() * 7)
    (root / "LATEST").write_text(f"{name}\n")
    return folder


def tree_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by relative path (the manifest left out)."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "MANIFEST.json"
    }


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A root of its own on fsspec's process-wide memory filesystem, removed afterwards."""
    root = f"/durable-test-{uuid.uuid4().hex[:8]}"
    yield f"memory://{root}"
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


class FlakyFileSystem(MemoryFileSystem):  # type: ignore[misc]
    """The memory filesystem under its own protocol and store, whose writes ask
    ``plan(operation, path)`` first: 'ok', 'fail' (OSError) or 'stall' (block until
    ``release_stalls``). Operations: 'put' (put_file), 'pipe' (pipe_file), 'mv'.

    Not being an object store, it gets small files (manifest, LATEST) as pipe to a temporary
    name then mv: a stalled pipe would leave its mv to land after ``release_stalls`` had
    returned, so pipe only fails; mv, the last step, stalls instead."""

    protocol = "flaky"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    plan: ClassVar[Callable[[str, str], str]] = staticmethod(lambda operation, path: "ok")
    release: ClassVar[threading.Event] = threading.Event()
    stalled = threading.Event()  # set when a call starts to stall
    calls_lock = threading.Condition()
    in_stall = 0  # stalled calls not finished yet

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str):
            path = path.removeprefix("flaky://")
        return super()._strip_protocol(path)

    @contextlib.contextmanager
    def _trouble(self, operation: str, path: str) -> Iterator[None]:
        cls = type(self)
        what = cls.plan(operation, path)
        if what == "stall" and operation == "pipe":
            what = "fail"
        if what == "fail":
            raise OSError(f"flaky: {operation} {path} failed")
        if what != "stall":
            yield
            return
        # Counted until the write itself is done: release_stalls waits for that.
        release = cls.release
        with cls.calls_lock:
            cls.in_stall += 1
        try:
            cls.stalled.set()
            assert release.wait(timeout=60), "a stalled call was never released"
            yield
        finally:
            with cls.calls_lock:
                cls.in_stall -= 1
                cls.calls_lock.notify_all()

    def put_file(self, lpath: Any, rpath: Any, *args: Any, **kwargs: Any) -> Any:
        with self._trouble("put", str(rpath)):
            return super().put_file(lpath, rpath, *args, **kwargs)

    def pipe_file(self, path: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        with self._trouble("pipe", str(path)):
            return super().pipe_file(path, value, *args, **kwargs)

    def mv(self, path1: Any, path2: Any, *args: Any, **kwargs: Any) -> Any:
        with self._trouble("mv", str(path2)):
            return super().mv(path1, path2, *args, **kwargs)

    @classmethod
    def release_stalls(cls) -> None:
        """Lets every stalled call go on, and waits (bounded) until they have finished, so that
        nothing writes the store behind a test's back afterwards."""
        cls.release.set()
        with cls.calls_lock:
            assert cls.calls_lock.wait_for(lambda: cls.in_stall == 0, timeout=30)
        cls.release = threading.Event()
        cls.stalled.clear()


@pytest.fixture
def flaky() -> Iterator[type[FlakyFileSystem]]:
    """The flaky filesystem, registered as flaky://, with an empty store and no trouble."""
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    FlakyFileSystem.store.clear()
    FlakyFileSystem.pseudo_dirs[:] = [""]
    FlakyFileSystem.plan = staticmethod(lambda operation, path: "ok")
    yield FlakyFileSystem
    FlakyFileSystem.release_stalls()
    FlakyFileSystem.plan = staticmethod(lambda operation, path: "ok")
    FlakyFileSystem.store.clear()
