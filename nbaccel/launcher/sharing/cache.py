"""The kernel's segments, kept between launches: data that did not change is not copied again.

A launch (or ``Workers.push``) hands ``SegmentCache.place`` the large buffers its pickle
kept out. Each buffer is looked up by where it lies in this process and its length; a hit
counts only if the bytes are still the same (their digest against the one taken when they
were written, ``digests``: ~0.02-0.03 s per GiB here), so an array changed in place between
two launches is written again, and an unchanged one costs a digest instead of a copy. The
buffers not found go into one new segment. Entries go when their array is garbage-collected
(a weak reference to the numpy array, tensor... that handed the buffer out); where that
object lives only as long as one pickle (pyarrow makes a buffer object for each, over memory
the table owns) the entry stays as long as launches keep sending its data, and goes at the
first that does not. The least recently used go when the segments kept would pass the
launch's limit (``shared_memory_limit_gb``; by default half of the machine's memory). Data
larger than the limit is not shared at all: ``place`` says why, and the caller sends it
inside the pickle, as before.

Closing a segment here never takes data from a run: each rank mapped it, and the mapping
keeps the pages. This is a resource cache, like the helper process: it holds no settings.
"""

from __future__ import annotations

import errno
import functools
import os
import resource
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nbaccel.launcher.sharing.digests import copy_digest, digest
from nbaccel.launcher.sharing.late_check import LateCheck
from nbaccel.launcher.sharing.memfd import NoSharedMemory
from nbaccel.launcher.sharing.packing import BufferRef, Dumps, Packed, close_fds, split
from nbaccel.launcher.sharing.segments import Segment, aligned, buffer_address
from nbaccel.launcher.sharing.tensors import owner_of

GIB = 1 << 30


@dataclass(frozen=True)
class _Unchecked:
    """A buffer ``place`` reused from the cache without checking it (``settle`` does)."""

    index: int  # among the placement's buffers
    key: tuple[int, int]
    buffer: memoryview
    digest: bytes  # what the reused segment holds


@dataclass
class _Entry:
    segment: Segment
    offset: int
    length: int
    digest: bytes  # of the bytes written (``digests``)
    owner: weakref.ref[object] | None  # None: the object that handed out the buffer is gone
    used: int = 0  # the last placement that used it


@dataclass
class Placement:
    """Where a message's buffers lie: ``refs`` index ``fds`` (this placement's own copies of
    the segments' fds: close them once sent, with ``close``)."""

    refs: tuple[BufferRef, ...]
    fds: list[int] = field(default_factory=list)
    check: LateCheck | None = None  # data reused unchecked, checked once ranks are started

    def __post_init__(self) -> None:
        # A plan dropped without starting (an error, a replaced payload) closes them too.
        self._closer = weakref.finalize(self, close_fds, list(self.fds))

    def add_check(self, check: LateCheck) -> None:
        """Check the reused data late: its two fds travel after the segments'."""
        self.check = check
        self.fds = [*self.fds, *check.fds]

    def close(self) -> None:
        self._closer()
        if self.check is not None:
            self.check.close()
        self.fds = []

    def __reduce__(self) -> tuple[Any, ...]:
        # The fd numbers as they are: a process started with them (``pass_fds``, a
        # detached run's supervisor) has the same numbers, and closes them in its turn.
        return Placement, (self.refs, list(self.fds))


class Refused(Exception):
    """The buffers cannot be shared (too large for the limit, or no memory): the reason."""


class SegmentCache:
    """See the module's doc. Thread-safe; one per process (``CACHE``)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # an owner's weakref callback may run inside place()
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._segments: dict[int, Segment] = {}  # by id(): every segment an entry uses
        self._placements = 0  # placements made so far: an entry's ``used`` is one of them
        self._packing = False  # within ``pack``: owners that die now were temporaries
        self.bytes_written = 0  # copied into segments so far (what a hit saves)

    @property
    def size(self) -> int:
        """Bytes held in segments now."""
        with self._lock:
            return sum(segment.size for segment in self._segments.values())

    def place(
        self, buffers: Sequence[memoryview], limit: int, settle_later: bool = False
    ) -> tuple[Placement, list[_Unchecked]]:
        """Where each buffer lies in shared memory, writing what is not there yet; raises
        ``Refused`` with the reason when the buffers must travel inside the pickle.
        ``settle_later``: buffers found in the cache are reused unchecked, and returned, for
        ``settle`` to check once the ranks are started (``late_check``)."""
        needed = sum(aligned(buffer.nbytes) for buffer in buffers)
        if needed > limit:
            raise Refused(
                f"the arrays and tensors sent to the workers ({_size(needed)}) are more than "
                f"shared_memory_limit_gb={limit / GIB:g} allows ({_size(limit)}), so they went "
                "through the pipe, a copy per rank; raise shared_memory_limit_gb to share them"
            )
        with self._lock:
            self._placements += 1
            now = self._placements
            found: list[tuple[Segment, int] | None] = []
            keys = [(buffer_address(buffer), buffer.nbytes) for buffer in buffers]
            unchecked: list[_Unchecked] = []
            for index, (key, buffer) in enumerate(zip(keys, buffers, strict=True)):
                entry = self._entries.get(key)
                if entry is not None and settle_later:
                    unchecked.append(_Unchecked(index, key, buffer, entry.digest))
                elif entry is None or digest(buffer) != entry.digest:
                    found.append(None)
                    # Changed: its old copy goes before the new one is written, so that
                    # the memory holds one copy at a time (where no other entry or run
                    # holds the old segment; a run's mapping keeps its pages for it).
                    self._drop(key)
                    continue
                entry.used = now
                found.append((entry.segment, entry.offset))
            missing = [index for index, hit in enumerate(found) if hit is None]
            if missing:
                try:
                    # The digests kept are of the bytes as they were copied: a thread that
                    # changes an array meanwhile cannot leave a segment its digest belies.
                    segment, offsets, digests = Segment.write_with(
                        [buffers[i] for i in missing], copy_digest
                    )
                except OSError as error:
                    raise Refused(_why_not(error)) from error
                self.bytes_written += sum(buffers[i].nbytes for i in missing)
                self._segments[id(segment)] = segment
                for index, offset, content in zip(missing, offsets, digests, strict=True):
                    found[index] = (segment, offset)
                    self._remember(keys[index], buffers[index], content, segment, offset, now)
            used = {id(hit[0]) for hit in found if hit is not None}
            self._drop_orphans(now)
            self._evict(limit, keep=used)
            return self._placement(found, buffers), unchecked

    def _placement(
        self, found: list[tuple[Segment, int] | None], buffers: Sequence[memoryview]
    ) -> Placement:
        """The placement's own fd of each segment it uses, and each buffer's ref."""
        order: dict[int, int] = {}
        fds: list[int] = []
        refs: list[BufferRef] = []
        try:
            for hit, buffer in zip(found, buffers, strict=True):
                assert hit is not None
                segment, offset = hit
                if id(segment) not in order:
                    order[id(segment)] = len(fds)
                    fds.append(os.dup(segment.fd))
                refs.append((order[id(segment)], offset, buffer.nbytes))
        except OSError as error:  # out of fds, most likely: none made so far stays open
            close_fds(fds)
            raise Refused(_why_not(error)) from error
        return Placement(tuple(refs), fds)

    def settle(
        self, unchecked: list[_Unchecked], late: int, late_index: int, room: int
    ) -> dict[int, BufferRef]:
        """Check buffers that ``place`` reused unchecked: those whose bytes changed since are
        written into ``late`` (an empty memfd that travelled as segment ``late_index``), after
        ``room`` bytes left for ``late_check``'s header, and kept in place of the old. Their
        new refs, by buffer index."""
        with self._lock:
            self._packing = True
            try:
                return self._write_changed(unchecked, late, late_index, room)
            finally:
                unchecked.clear()  # buffer objects made for the pickle die now (see _forget)
                self._packing = False

    def _write_changed(
        self, unchecked: list[_Unchecked], late: int, late_index: int, room: int
    ) -> dict[int, BufferRef]:
        changed = [item for item in unchecked if digest(item.buffer) != item.digest]
        if not changed:
            return {}
        for item in changed:  # the old copy goes first, as in ``place``
            self._drop(item.key)
        mine = os.dup(late)  # the cache keeps the segment; the launch closes its own fd
        try:
            # Unsealed: ``late_check`` writes its header at the start, then seals it. The
            # digests kept are of the bytes copied, as in ``place``.
            segment, offsets, digests = Segment.write_with(
                [memoryview(bytes(room)), *(item.buffer for item in changed)],
                copy_digest,
                into=mine,
                seal=False,
            )
        except BaseException:
            os.close(mine)
            raise
        self.bytes_written += sum(item.buffer.nbytes for item in changed)
        self._segments[id(segment)] = segment
        refs: dict[int, BufferRef] = {}
        for item, offset, content in zip(changed, offsets[1:], digests[1:], strict=True):
            self._remember(item.key, item.buffer, content, segment, offset, self._placements)
            refs[item.index] = (late_index, offset, item.buffer.nbytes)
        return refs

    def clear(self) -> None:
        """Forget every entry and close every segment (runs keep what they mapped)."""
        with self._lock:
            self._entries.clear()
            segments, self._segments = list(self._segments.values()), {}
        for segment in segments:
            segment.close()

    def pack(
        self, obj: Any, dumps: Dumps, limit: int, settle_later: bool = False
    ) -> tuple[Packed, Placement | None, str | None]:
        """``obj`` packed for this machine's ranks: its large buffers placed here (``limit``:
        the launch's ``shared_memory_limit_gb`` in bytes; 0 turns sharing off), or inside the
        pickle, with the reason when sharing was refused (a notice for the user).
        ``settle_later``: data kept from earlier launches is checked once the ranks are
        started (``placement.check``, see ``late_check``); the ranks wait for it."""
        if limit <= 0:  # sharing off: one plain pickle, no buffers split out
            return Packed(dumps(obj, None)), None, None
        with self._lock:
            self._packing = True
            try:
                kept = split(obj, dumps)
                if not kept.buffers:
                    return Packed(kept.data), None, None
                try:
                    placement, unchecked = self.place(kept.buffers, limit, settle_later)
                    if unchecked:
                        settle = functools.partial(self.settle, unchecked)
                        try:
                            placement.add_check(LateCheck(placement.refs, kept.asked, settle))
                        except OSError as error:
                            placement.close()
                            raise Refused(_why_not(error)) from error
                except Refused as why:
                    # No shared memory at all is said once (``memfd.take_notice``).
                    told = isinstance(why.__cause__, NoSharedMemory)
                    return Packed(dumps(obj, None)), None, None if told else str(why)
                packed = Packed(kept.data, kept.refs(placement.refs))
                del kept  # buffer objects made for this pickle go now (see _forget)
                return packed, placement, None
            finally:
                self._packing = False

    def _remember(
        self,
        key: tuple[int, int],
        buffer: memoryview,
        content: bytes,
        segment: Segment,
        offset: int,
        now: int,
    ) -> None:
        self._drop(key)
        owner: weakref.ref[object] | None = None
        try:
            # The object the user holds: a tensor's buffer is a numpy view of its storage
            # made for this pickle (``tensors``), which dies with it.
            owner = weakref.ref(owner_of(buffer.obj), lambda _: self._forget(key, owner))
        except TypeError:
            pass  # an owner without weak references: kept while launches use it
        self._entries[key] = _Entry(segment, offset, buffer.nbytes, content, owner, now)

    def _drop(self, key: tuple[int, int]) -> None:
        """Forget ``key``'s entry; its segment goes once no entry uses it."""
        old = self._entries.pop(key, None)
        if old is not None:
            self._close_unused(old.segment)

    def _forget(self, key: tuple[int, int], owner: weakref.ref[object] | None) -> None:
        """The object that handed out an entry's buffer is gone. A numpy array is the
        user's: gone, its segment goes. An Arrow buffer object is made for each pickle and
        dies with it (``pack``): the entry is kept while launches use it (``_drop_orphans``)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.owner is not owner:
                return
            if self._packing and entry.used == self._placements:
                entry.owner = None
            else:
                del self._entries[key]
                self._close_unused(entry.segment)

    def _drop_orphans(self, now: int) -> None:
        """Entries without an owner that this placement did not use: what a launch no longer
        sends goes (nothing else can say that their data is gone)."""
        for key, entry in list(self._entries.items()):
            if entry.owner is None and entry.used < now:
                del self._entries[key]
                self._close_unused(entry.segment)

    def _evict(self, limit: int, keep: set[int]) -> None:
        total = sum(segment.size for segment in self._segments.values())
        for key, entry in sorted(self._entries.items(), key=lambda item: item[1].used):
            if total <= limit:
                break
            if id(entry.segment) in keep:
                continue
            del self._entries[key]
            if self._close_unused(entry.segment):
                total -= entry.segment.size

    def _close_unused(self, segment: Segment) -> bool:
        if any(entry.segment is segment for entry in self._entries.values()):
            return False
        if self._segments.pop(id(segment), None) is not None:
            segment.close()
        return True


def _why_not(error: OSError) -> str:
    """What a user is told when shared memory could not be had for a launch's data."""
    if error.errno in (errno.EMFILE, errno.ENFILE):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        hard = 65536 if hard == resource.RLIM_INFINITY else hard
        return (
            f"the kernel may open no more files ({error.strerror}: its limit on open file "
            f"descriptors, ulimit -n, is {soft}), so the arrays and tensors sent to the "
            "workers went through the pipe, a copy per rank; raise the limit before "
            "starting Jupyter (ulimit -n 65536), or in the kernel: import resource; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({hard}, {hard}))"
        )
    return (
        f"no shared memory could be had for the arrays and tensors sent to the workers "
        f"({error}), so they went through the pipe, a copy per rank; free some memory, or "
        "set shared_memory_limit_gb=0 to stop trying"
    )


def limit_bytes(gib: float | None) -> int:
    """``shared_memory_limit_gb`` in bytes: None is half of this machine's memory.

    >>> limit_bytes(1.5), limit_bytes(0), limit_bytes(None) > 0
    (1610612736, 0, True)
    """
    if gib is None:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    return int(gib * GIB)


def _size(size: int) -> str:
    """
    >>> _size(8 << 20), _size(3 << 29)
    ('8.0 MiB', '1.50 GiB')
    """
    return f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / (1 << 20):.1f} MiB"


CACHE = SegmentCache()


def pack_shared(
    obj: Any, dumps: Dumps, limit: int, settle_later: bool = False
) -> tuple[Packed, Placement | None, str | None]:
    """``CACHE.pack``: ``obj`` packed for this machine's ranks (see ``SegmentCache.pack``)."""
    return CACHE.pack(obj, dumps, limit, settle_later)
