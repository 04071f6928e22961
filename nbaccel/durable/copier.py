"""Copying each new local state folder to a durable place, in a background thread.

One copy, in this order, each remote call bounded by ``timeout`` (run in a daemon thread
that is abandoned, never waited for, when it stalls):

1. the local state's manifest (sizes and sha256) is computed;
2. every file the remote lacks (or holds with another size) is uploaded to
   ``target/<name>/...`` (states are immutable by name, so a file of the right size that a
   failed attempt already put there is kept);
3. ``target/<name>/MANIFEST.json`` is written;
4. the remote sizes are listed and checked against the manifest, and the manifest read back;
5. only then is ``target/LATEST`` replaced (never while an earlier, abandoned write of
   LATEST may still land: that one could otherwise name an older state over a newer one);
6. remote states beyond the newest ``keep`` are removed, never the one LATEST names.

Any failure stops the copy before LATEST moves, so LATEST always names a verified state.
A copy is tried ``1 + retries`` times; when it gives up, ``warn`` is called once for the
whole streak of failing copies (until one succeeds again) and ``failures`` counts it. Nothing
is raised into the caller: training goes on, the local checkpoints stay, the next save
tries again. One copier per target: two copiers writing the same target are not supported.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from nbaccel.durable import manifest
from nbaccel.durable.places import Store, check_place, open_place

T = TypeVar("T")


class Stalled(TimeoutError):
    """A remote call that did not finish in time; ``thread`` still runs it."""

    def __init__(self, message: str, thread: threading.Thread) -> None:
        super().__init__(message)
        self.thread = thread


def bounded(call: Callable[[], T], timeout: float, what: str) -> T:
    """``call()`` in a daemon thread, waited for at most ``timeout`` seconds.

    A daemon thread, not an executor's: a call stalled for ever must not hold up the
    process's exit (executors join their threads at exit).

    >>> bounded(lambda: 6 * 7, 1.0, "arithmetic")
    42
    """
    box: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            box.append((True, call()))
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread, raised there
            box.append((False, error))

    thread = threading.Thread(target=run, name=f"nbaccel durable: {what}"[:60], daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise Stalled(f"{what} did not finish within {timeout:g} s", thread)
    ok, value = box[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]  # call's own result


class DurableCopier:
    """Copies each new local state folder to the durable place in a background thread.

    ``target`` is a local folder or an fsspec URL; ``keep`` how many states stay there;
    ``warn`` is told (once per streak of failing copies) when copies fail. ``submit``
    returns at once: if a copy is in progress, the newest submission waits, replacing any
    older one still waiting. ``wait`` before the process exits. ``failures`` counts the
    copies given up, ``copied`` those that reached LATEST.

    >>> import json, tempfile
    >>> from pathlib import Path
    >>> from nbaccel.durable import newest_complete
    >>> local = Path(tempfile.mkdtemp())
    >>> (local / "state-1").mkdir()
    >>> meta = {"format": 1, "world_size": 1, "progress": {"completed_steps": 3},
    ...         "saved_at": 0.0}
    >>> _ = (local / "state-1" / "meta.json").write_text(json.dumps(meta))
    >>> copier = DurableCopier("memory://doctest-copier", keep=2, warn=print)
    >>> copier.submit(local, "state-1")
    >>> copier.wait(timeout=60), copier.failures
    (True, 0)
    >>> copier.close()
    >>> newest_complete("memory://doctest-copier").name
    'state-1'
    """

    def __init__(
        self,
        target: str,
        *,
        keep: int,
        warn: Callable[[str], None],
        retries: int = 3,
        retry_wait: float = 2.0,
        timeout: float = 600.0,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the newest state must stay")
        if retries < 0 or retry_wait < 0 or timeout <= 0:
            raise ValueError(f"retries={retries}, retry_wait={retry_wait}, timeout={timeout}")
        check_place(target)  # a missing gcsfs is said now, not in the thread
        self.target = target
        self.keep = keep
        self.warn = warn
        self.retries = retries
        self.retry_wait = retry_wait
        self.timeout = timeout
        self.copied = 0  # copies that reached LATEST
        self._failures = 0
        self._warned = False  # the current failing streak has been told
        self._store: Store | None = None
        self._latest_writer: threading.Thread | None = None
        self._cond = threading.Condition()
        self._queued: tuple[Path, str] | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def failures(self) -> int:
        """Copies given up after their retries."""
        return self._failures

    def submit(self, local_root: Path, name: str) -> None:
        """Queues the copy of ``local_root/name``; returns at once (ignored once closed)."""
        with self._cond:
            if self._closed:
                return
            self._queued = (Path(local_root), name)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="nbaccel durable copier", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """True once everything submitted is copied or given up; False at ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: self._queued is None and not self._busy, timeout)

    def close(self) -> None:
        """Stops taking copies: one waiting is dropped, one in progress ends after its current
        attempt (call ``wait`` first to let them finish). Does not block."""
        with self._cond:
            self._closed = True
            self._queued = None
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued is not None or self._closed)
                if self._queued is None:
                    return
                job, self._queued = self._queued, None
                self._busy = True
            try:
                self._copy_with_retries(*job)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _copy_with_retries(self, local_root: Path, name: str) -> None:
        error: Exception | None = None
        for attempt in range(1 + self.retries):
            if attempt:
                with self._cond:
                    if self._cond.wait_for(lambda: self._closed, self.retry_wait):
                        return  # closing: the local checkpoint stays, nothing to tell
            try:
                self._copy(local_root, name)
            except Exception as failure:  # noqa: BLE001 - whatever the target does stays here
                error = failure
                continue
            self.copied += 1
            self._warned = False
            return
        self._failures += 1
        if not self._warned:
            self._warned = True
            self._tell(local_root, name, error)

    def _tell(self, local_root: Path, name: str, error: Exception | None) -> None:
        tries = 1 + self.retries
        message = (
            f"nbaccel: could not copy checkpoint {name} to {self.target} "
            f"({tries} {'try' if tries == 1 else 'tries'}; last: "
            f"{type(error).__name__}: {error}). Training goes on and the local checkpoints "
            f"remain in {local_root}; the next save tries the durable copy again "
            f"(this is said once until a copy succeeds)."
        )
        try:
            self.warn(message)
        except Exception:  # noqa: BLE001 - a broken warn must not end the copies
            pass

    def _call(self, call: Callable[[], T], what: str) -> T:
        return bounded(call, self.timeout, f"{what} on {self.target}")

    def _copy(self, local_root: Path, name: str) -> None:
        folder = local_root / name
        if not (folder / "meta.json").is_file():
            raise FileNotFoundError(f"{folder} has no meta.json: no complete local state")
        if self._store is None:
            self._store = self._call(functools.partial(open_place, self.target), "opening")
        store = self._store
        files = manifest.build(folder)
        listed = manifest.encode(name, files)
        there = self._call(functools.partial(store.sizes, name), f"listing {name}")
        for rel, (size, _) in files.items():
            if there.get(rel) != size:
                upload = functools.partial(store.put_file, folder / rel, f"{name}/{rel}")
                self._call(upload, f"uploading {name}/{rel}")
        manifest_rel = f"{name}/{manifest.MANIFEST}"
        self._call(functools.partial(store.write_bytes, manifest_rel, listed), "the manifest")
        found = self._call(functools.partial(store.sizes, name), f"verifying {name}")
        wrong = manifest.problems(files, found)
        if wrong:
            raise OSError(f"the copy of {name} did not verify: {'; '.join(wrong[:3])}")
        if self._call(functools.partial(store.read_bytes, manifest_rel), "rereading") != listed:
            raise OSError(f"{manifest_rel} reads back other bytes than were written")
        self._write_latest(store, name)
        try:
            self._prune(store, name)
        except Exception:  # noqa: BLE001 - the copy is done; the next one prunes again
            pass

    def _write_latest(self, store: Store, name: str) -> None:
        earlier = self._latest_writer
        if earlier is not None:
            earlier.join(self.timeout)
            if earlier.is_alive():
                raise TimeoutError(f"an earlier write of LATEST on {self.target} is stuck")
            self._latest_writer = None
        write = functools.partial(store.write_bytes, manifest.LATEST, f"{name}\n".encode())
        try:
            self._call(write, "writing LATEST")
        except Stalled as stall:
            self._latest_writer = stall.thread
            raise

    def _prune(self, store: Store, name: str) -> None:
        files = self._call(functools.partial(store.sizes, ""), "listing states")
        states = {rel.split("/", 1)[0] for rel in files if rel.startswith("state-")} - {name}
        complete = [s for s in states if f"{s}/{manifest.MANIFEST}" in files]

        def saved_at(state: str) -> float:
            # States sort by when they were saved, not by name: only LATEST's is certain.
            try:
                read = functools.partial(store.read_bytes, f"{state}/meta.json")
                return float(json.loads(self._call(read, "reading meta"))["saved_at"])
            except Exception:  # noqa: BLE001 - an unreadable state counts as the oldest
                return float("-inf")

        newest = sorted(complete, key=lambda s: (saved_at(s), s), reverse=True)
        # Partial states (no manifest: a copy given up) go too; LATEST's stays.
        for state in sorted(states - set(newest[: self.keep - 1])):
            self._call(functools.partial(store.remove, state), f"removing {state}")
